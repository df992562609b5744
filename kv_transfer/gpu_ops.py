"""The CUDA and NCCL calls a transfer thread makes while it queues a part's GPU work, made without letting go of
Python's interpreter lock.

Why: a decode worker's engine loop runs Python nearly all the time. Each call that releases the lock (every
torch event or stream call, every CuPy NCCL call, a pinned-memory copy) costs the transfer thread a wait of
about 0.1-0.5 ms to get it back. Queueing a 390 MiB handoff made ~40 such calls, and on 2x H200 under load the
decode side spent 16 ms queueing it, 2.8 ms of which on the CPU (bench/results/kv_handoff_h200x2, run 6).
These calls only enqueue work and return in microseconds, so holding the lock through them costs the engine
loop nothing measurable.

    ops = gpu_ops()                       # RawOps when libcuda (and, for NCCL, the libnccl CuPy loaded) is
                                          # found, else TorchOps (torch and CuPy calls); TANDEM_KV_RAW_CALLS=0
                                          # forces TorchOps
    event = ops.new_event(); ops.record(event, stream); ops.wait(other_stream, event); event.query()
    a, b = ops.new_event(timed=True), ops.new_event(timed=True); ...; ops.elapsed_s(a, b)   # both completed
    ops.nccl(send, comm, ptr, nbytes, peer, stream)       # ncclSend (send=True) or ncclRecv of NCCL_UINT8
    ids = ops.ids(pool, block_ids)        # block ids on the device: a memmove and one async copy on pool.stream
    ops.launch(function, grid, threads, shared, stream, params)   # a compiled kernel (RawOps only; see
                                          # block_copy: Triton's own launcher lets go of the lock)

Raw calls go through ctypes.PyDLL, which keeps the lock during the call (ctypes.CDLL would release it). The NCCL
communicator stays CuPy's: the raw calls use its handle (`comm.comm`) in the same libnccl CuPy loaded.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import functools
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

RAW_CALLS_ENV = "TANDEM_KV_RAW_CALLS"
NCCL_UINT8 = 1  # ncclDataType_t ncclUint8 (nccl.h): bytes, bit-exact for any dtype
CUDA_SUCCESS, CUDA_ERROR_NOT_READY = 0, 600
CU_EVENT_DISABLE_TIMING = 0x2
# Transfer streams run at the device's highest priority (torch maps a number below the range to its highest):
# their kernels (NCCL, block copies) are scheduled ahead of the engine's queued kernels.
HIGHEST_PRIORITY = -64


def transfer_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device, priority=HIGHEST_PRIORITY)


class GpuCallFailed(RuntimeError):
    """A CUDA driver or NCCL call returned an error code."""


class RawEvent:
    """A CUDA event created through the driver (timing disabled), destroyed when nothing refers to it any more
    (like torch's): a transfer still polling an event of a pair that was dropped keeps it valid."""

    __slots__ = ("_lib", "handle")

    def __init__(self, lib: _Driver, timed: bool = False) -> None:
        self._lib = lib
        self.handle = 0
        self.handle = lib.event_create(timed)

    def query(self) -> bool:
        return self._lib.event_query(self.handle)

    def __del__(self) -> None:
        if self.handle:
            with contextlib.suppress(Exception):  # at interpreter exit the driver may be gone already
                self._lib.event_destroy(self.handle)
            self.handle = 0


class _Driver:
    """libcuda.so.1 through PyDLL."""

    def __init__(self, lib: ctypes.PyDLL) -> None:
        p, u, i, s = ctypes.c_void_p, ctypes.c_uint, ctypes.c_int, ctypes.c_size_t
        self._create = _fn(lib, "cuEventCreate", [ctypes.POINTER(p), u])
        self._destroy = _fn(lib, "cuEventDestroy_v2", [p])
        self._record = _fn(lib, "cuEventRecord", [p, p])
        self._query = _fn(lib, "cuEventQuery", [p])
        self._wait = _fn(lib, "cuStreamWaitEvent", [p, p, u])
        self._elapsed = _fn(lib, "cuEventElapsedTime", [ctypes.POINTER(ctypes.c_float), p, p])
        self._htod = _fn(lib, "cuMemcpyHtoDAsync_v2", [ctypes.c_uint64, p, s, p])
        self._launch = _fn(lib, "cuLaunchKernel", [p, u, u, u, u, u, u, u, p, p, p])
        self._name = _fn(lib, "cuGetErrorName", [i, ctypes.POINTER(ctypes.c_char_p)])

    def check(self, code: int, what: str) -> None:
        if code != CUDA_SUCCESS:
            name = ctypes.c_char_p()
            self._name(code, ctypes.byref(name))
            raise GpuCallFailed(f"{what}: {(name.value or b'CUDA error').decode()} ({code})")

    def event_create(self, timed: bool = False) -> int:
        handle = ctypes.c_void_p()
        flags = 0 if timed else CU_EVENT_DISABLE_TIMING
        self.check(self._create(ctypes.byref(handle), flags), "cuEventCreate")
        return int(handle.value or 0)

    def elapsed_s(self, start: int, end: int) -> float:
        ms = ctypes.c_float()
        self.check(self._elapsed(ctypes.byref(ms), start, end), "cuEventElapsedTime")
        return ms.value / 1000

    def event_destroy(self, handle: int) -> None:
        self._destroy(handle)

    def event_query(self, handle: int) -> bool:
        code = self._query(handle)
        if code == CUDA_ERROR_NOT_READY:
            return False
        self.check(code, "cuEventQuery")
        return True

    def record(self, handle: int, stream: int) -> None:
        self.check(self._record(handle, stream), "cuEventRecord")

    def wait(self, stream: int, handle: int) -> None:
        self.check(self._wait(stream, handle, 0), "cuStreamWaitEvent")

    def htod(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.check(self._htod(dst, src, nbytes, stream), "cuMemcpyHtoDAsync")

    def launch(self, function: int, grid: int, threads: int, shared: int, stream: int, params: Any) -> None:
        """A 1-D grid of `grid` blocks of `threads` threads; params: a ctypes array of pointers to each
        kernel parameter's value."""
        self.check(
            self._launch(function, grid, 1, 1, threads, 1, 1, shared, stream, params, None), "cuLaunchKernel"
        )


class _Nccl:
    """ncclSend / ncclRecv of the libnccl CuPy loaded, through PyDLL."""

    def __init__(self, lib: ctypes.PyDLL) -> None:
        p, s, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        self._send = _fn(lib, "ncclSend", [p, s, i, i, p, p])
        self._recv = _fn(lib, "ncclRecv", [p, s, i, i, p, p])
        self._error = _fn(lib, "ncclGetErrorString", [i], restype=ctypes.c_char_p)

    def call(self, send: bool, comm: Any, ptr: int, nbytes: int, peer: int, stream: int) -> None:
        handle = comm.comm
        if not handle:
            raise GpuCallFailed("NCCL: the communicator was aborted")
        fn = self._send if send else self._recv
        code = fn(ptr, nbytes, NCCL_UINT8, peer, handle, stream)
        if code != 0:
            what = "ncclSend" if send else "ncclRecv"
            raise GpuCallFailed(f"{what}: {(self._error(code) or b'NCCL error').decode()} ({code})")


def _fn(lib: ctypes.PyDLL, name: str, argtypes: list[Any], restype: Any = ctypes.c_int) -> Any:
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = argtypes, restype
    return fn


@dataclass
class IdsSlot:
    """A pinned host buffer and a device buffer for one list of block ids; `copied` is recorded after the
    copy between them, and the slot is free again once it completed."""

    host: torch.Tensor
    device: torch.Tensor
    copied: Any
    in_use: bool = True


class IdsPool:
    """Block-id buffers, each for up to `capacity` ids (a whole cache's blocks), copied and used on one stream
    only: stream order keeps a device buffer from being overwritten while queued work still reads it, and a
    slot's host buffer is rewritten only once its last copy completed (else a new slot is made)."""

    def __init__(self, stream: torch.cuda.Stream, capacity: int) -> None:
        self.stream, self.device, self.capacity = stream, stream.device, capacity
        self._lock = threading.Lock()
        self._slots: list[IdsSlot] = []

    def take(self, ops: GpuOps) -> IdsSlot:
        with self._lock:
            for slot in self._slots:
                if not slot.in_use and slot.copied.query():
                    slot.in_use = True
                    return slot
        slot = IdsSlot(
            torch.empty(self.capacity, dtype=torch.int64, pin_memory=True),
            torch.empty(self.capacity, dtype=torch.int64, device=self.device),
            ops.new_event(),
        )
        with self._lock:
            self._slots.append(slot)
        return slot

    def put(self, slot: IdsSlot) -> None:
        with self._lock:
            slot.in_use = False


class GpuOps:
    """What a transfer thread needs; RawOps keeps the interpreter lock through each call, TorchOps does not."""

    raw = False

    def new_event(self, timed: bool = False) -> Any:
        """timed: the event can be an end of elapsed_s (timing costs a little on record)."""
        raise NotImplementedError

    def elapsed_s(self, start: Any, end: Any) -> float:
        """Seconds between two completed timed events."""
        raise NotImplementedError

    def record(self, event: Any, stream: torch.cuda.Stream) -> None:
        raise NotImplementedError

    def wait(self, stream: torch.cuda.Stream, event: Any) -> None:
        raise NotImplementedError

    def nccl(
        self, send: bool, comm: Any, ptr: int, nbytes: int, peer: int, stream: torch.cuda.Stream
    ) -> None:
        raise NotImplementedError

    def ids(self, pool: IdsPool, block_ids: tuple[int, ...]) -> torch.Tensor:
        """block_ids as an int64 device tensor, copied on pool.stream (no host wait): valid for work queued on
        that stream after this call, and only there."""
        if len(block_ids) > pool.capacity:
            raise ValueError(f"{len(block_ids)} block ids exceed the cache's {pool.capacity} blocks")
        slot, n = pool.take(self), len(block_ids)
        try:
            ids = array.array("q", block_ids)
            ctypes.memmove(slot.host.data_ptr(), ids.buffer_info()[0], 8 * n)
            self._copy_ids(slot, n, pool.stream)
            self.record(slot.copied, pool.stream)
        finally:
            pool.put(slot)
        return slot.device[:n]

    def _copy_ids(self, slot: IdsSlot, n: int, stream: torch.cuda.Stream) -> None:
        raise NotImplementedError

    def launch(self, function: int, grid: int, threads: int, shared: int, stream: int, params: Any) -> None:
        """A compiled kernel (a CUfunction handle) through cuLaunchKernel: RawOps only (`raw`)."""
        raise NotImplementedError


class TorchOps(GpuOps):
    def new_event(self, timed: bool = False) -> Any:
        return torch.cuda.Event(enable_timing=timed)

    def elapsed_s(self, start: Any, end: Any) -> float:
        return float(start.elapsed_time(end)) / 1000

    def record(self, event: Any, stream: torch.cuda.Stream) -> None:
        event.record(stream)

    def wait(self, stream: torch.cuda.Stream, event: Any) -> None:
        stream.wait_event(event)

    def nccl(
        self, send: bool, comm: Any, ptr: int, nbytes: int, peer: int, stream: torch.cuda.Stream
    ) -> None:
        call = comm.send if send else comm.recv
        call(ptr, nbytes, NCCL_UINT8, peer, stream.cuda_stream)

    def _copy_ids(self, slot: IdsSlot, n: int, stream: torch.cuda.Stream) -> None:
        with torch.cuda.stream(stream):
            slot.device[:n].copy_(slot.host[:n], non_blocking=True)


class RawOps(GpuOps):
    raw = True

    def __init__(self, driver: _Driver, nccl: _Nccl | None) -> None:
        self._driver = driver
        self._nccl = nccl
        self._cupy_nccl = TorchOps()  # NCCL through CuPy when its libnccl could not be called directly

    def new_event(self, timed: bool = False) -> RawEvent:
        return RawEvent(self._driver, timed)

    def elapsed_s(self, start: Any, end: Any) -> float:
        return self._driver.elapsed_s(_handle(start), _handle(end))

    def record(self, event: Any, stream: torch.cuda.Stream) -> None:
        self._driver.record(_handle(event), stream.cuda_stream)

    def wait(self, stream: torch.cuda.Stream, event: Any) -> None:
        self._driver.wait(stream.cuda_stream, _handle(event))

    def nccl(
        self, send: bool, comm: Any, ptr: int, nbytes: int, peer: int, stream: torch.cuda.Stream
    ) -> None:
        if self._nccl is None:
            self._cupy_nccl.nccl(send, comm, ptr, nbytes, peer, stream)
        else:
            self._nccl.call(send, comm, ptr, nbytes, peer, stream.cuda_stream)

    def _copy_ids(self, slot: IdsSlot, n: int, stream: torch.cuda.Stream) -> None:
        self._driver.htod(slot.device.data_ptr(), slot.host.data_ptr(), 8 * n, stream.cuda_stream)

    def launch(self, function: int, grid: int, threads: int, shared: int, stream: int, params: Any) -> None:
        self._driver.launch(function, grid, threads, shared, stream, params)


def _handle(event: Any) -> int:
    """A RawEvent's handle, or a torch.cuda.Event's (one that was recorded: an unrecorded one has none)."""
    if isinstance(event, RawEvent):
        return event.handle
    handle = int(event.cuda_event)
    if not handle:
        raise GpuCallFailed("a torch.cuda.Event that was never recorded has no CUDA event to wait for")
    return handle


def loaded_libraries(fragment: str) -> list[str]:
    """Distinct paths of shared libraries mapped into this process whose file name contains `fragment`."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if fragment in line.rsplit("/", 1)[-1]}
    except OSError:
        return []
    return sorted(p for p in paths if p.startswith("/"))


@functools.lru_cache(maxsize=1)
def gpu_ops() -> GpuOps:
    """RawOps when the libraries are found (once per process), else TorchOps; TANDEM_KV_RAW_CALLS=0 forces
    TorchOps (to compare the two)."""
    if os.environ.get(RAW_CALLS_ENV, "1") == "0":
        log.info("%s=0: KV transfers queue GPU work through torch and CuPy calls", RAW_CALLS_ENV)
        return TorchOps()
    try:
        driver = _Driver(ctypes.PyDLL("libcuda.so.1"))
    except (OSError, AttributeError) as exc:
        log.warning("KV transfers: no raw CUDA driver calls (%s); using torch's", exc)
        return TorchOps()
    return RawOps(driver, _load_nccl())


def _load_nccl() -> _Nccl | None:
    try:
        from cupy.cuda import nccl  # type: ignore[import-not-found]  # noqa: F401  (maps its libnccl)
    except ImportError:
        return None
    paths = loaded_libraries("libnccl.so")
    if len(paths) != 1:
        log.warning(
            "KV transfers: %d libnccl libraries loaded (%s); NCCL calls go through CuPy", len(paths), paths
        )
        return None
    try:
        return _Nccl(ctypes.PyDLL(paths[0]))
    except (OSError, AttributeError) as exc:
        log.warning("KV transfers: cannot call %s directly (%s); NCCL calls go through CuPy", paths[0], exc)
        return None
