"""cuda_ipc transport: same node; the receiver pulls (copies) from the sender's cache, mapped once per pair.

Why pull rather than push (the sender writing into the receiver's exposed cache): the receiver stays the only
writer of its own cache. It knows exactly when its copies finished (its own stream's event), so it can free or
admit blocks on its own authority; a pushing sender that stalls or dies could leave a write in flight into
blocks the receiver has already handed to another request, and the receiver could never rule that out. Pull is
one-sided, so it cannot hang on a missing peer, and the sender only reads: it keeps its blocks until KVAck.

Copying: by default one kernel (kv_transfer.block_copy) whose SMs read the peer's blocks over NVLink and write
ours, whatever the ids; COPY_ENGINE_MAX_RUNS > 0 switches parts with at most that many runs of consecutive
blocks to the copy engines, one 2-D copy per run (bench/kv_transfer.py measures both):

Pair setup: the sender exports the CUDA allocation that holds its cache (cudaIpcGetMemHandle of the
allocation's base, plus the cache's offset in it and its num_blocks); the receiver opens it once and keeps it.
Per part, for each run of consecutive (src, dst) block ids, one 2-D copy moves rows of one (layer, K|V) block
run; rows repeat every K|V plane:

    cache[l, kv, b] starts at base + l*S0 + kv*S1 + b*S2   (S = byte strides of KVLayout.cache_shape)
    copy run (s..s+k) -> (d..d+k): width k*S2, height 2*(l1-l0), pitches S1 (sender) and S1' (receiver)

Doorbells (kv_transfer.doorbell): a receiver reserving for a sender it is paired with may arm the lease, queueing
its copies on its GPU behind a slot of the pair's doorbell page; that sender then rings the slot from its GPU
as each layer group is ready and never waits on the host. Without a doorbell: the sender's `ready` event is
waited on the host before KVPart goes out, since the receiver copies as soon as it reads it. The receiver
queues each part's copies as its frame arrives and waits once, at KVDone, for the last.

Caveat: the mapping assumes the sender's cache outlives its transfers (it does: the cache lives as long as the
prefill worker); a mapping stays open until the receiver closes.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch

from kv_transfer.block_copy import DevicePointer, cache_pointer, copy_blocks
from kv_transfer.config import TransferConfig
from kv_transfer.contracts import FailureReason, TransferFailed
from kv_transfer.cuda_events import CopyClock, bind_device, require_cuda, wait_event
from kv_transfer.doorbell import Armed
from kv_transfer.frames import FrameConnection, Watch, expect
from kv_transfer.gpu_ops import IdsPool, gpu_ops, transfer_stream
from kv_transfer.ipc_bells import ReceiverBells, SenderBells
from kv_transfer.transport import PartJob, PartSink, ReceiverTransport, SenderTransport, part_frame
from model_runtime.config import ConfigError
from model_runtime.kv_layout import KVLayout
from model_runtime.layer_stream import group_ends
from tandem_api.tandem.v1 import kv_pb2

log = logging.getLogger(__name__)
COPY_ENGINE_MAX_RUNS = (
    0  # parts with at most this many block runs use cudaMemcpy2DAsync instead of the kernel
)


def _runtime() -> Any:
    try:
        from cupy.cuda import runtime  # type: ignore[import-not-found]
    except ImportError as exc:
        raise TransferFailed(
            FailureReason.PAIR_SETUP_FAILED, f"transport cuda_ipc needs CuPy: {exc}"
        ) from None
    return runtime


def allocation_range(ptr: int) -> tuple[int, int]:
    """(base, size) of the CUDA allocation containing `ptr` (cuMemGetAddressRange; the IPC handle covers a
    whole allocation, and PyTorch's caching allocator may place the cache inside a larger one)."""
    libcuda = ctypes.CDLL("libcuda.so.1")
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    status = libcuda.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if status != 0:
        raise TransferFailed(
            FailureReason.PAIR_SETUP_FAILED, f"cuMemGetAddressRange failed with CUresult {status}"
        )
    return int(base.value), int(size.value)


def byte_strides(layout: KVLayout) -> tuple[int, ...]:
    """Byte strides of a contiguous cache of `layout`, derived from KVLayout.cache_shape (a meta tensor:
    no memory), so the 2-D copy geometry never restates the layout."""
    meta = torch.empty(layout.cache_shape, dtype=getattr(torch, layout.dtype), device="meta")
    return tuple(stride * meta.element_size() for stride in meta.stride())


def block_runs(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) for maximal runs where both id lists advance by one together."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


class IpcSenderTransport(SenderTransport):
    def __init__(self, layout: KVLayout, cache: torch.Tensor, config: TransferConfig) -> None:
        self._device = require_cuda(cache, "cuda_ipc")
        self._layout = layout
        self._cache = cache
        self._export: kv_pb2.KVIpcExport | None = None
        self._lock = threading.Lock()
        self.bells = SenderBells(self._device, gpu_ops())  # receivers' doorbell pages (kv_transfer.ipc_bells)

    def ensure_pair(
        self, peer_id: bytes, peer_ready: bool, conn: FrameConnection, watch: Watch, since: float
    ) -> None:
        if peer_ready:
            return
        setup = kv_pb2.KVPairSetup(cuda_ipc=self._exported())
        conn.send_frame(kv_pb2.KVFrame(pair_setup=setup), watch)
        ack = expect(conn.read_frame(watch), "pair_setup_ack", FailureReason.PAIR_SETUP_FAILED)
        if ack.pair_setup_ack.HasField("doorbell"):
            self.bells.open(peer_id, ack.pair_setup_ack.doorbell)

    def _exported(self) -> kv_pb2.KVIpcExport:
        with self._lock:
            if self._export is None:
                bind_device(self._device)
                base, _ = allocation_range(self._cache.data_ptr())
                try:
                    handle = _runtime().ipcGetMemHandle(base)
                except Exception as exc:  # e.g. expandable_segments allocations cannot be exported this way
                    raise TransferFailed(
                        FailureReason.PAIR_SETUP_FAILED, f"cudaIpcGetMemHandle failed: {exc}"
                    ) from None
                self._export = kv_pb2.KVIpcExport(
                    mem_handle=bytes(handle),
                    offset=self._cache.data_ptr() - base,
                    num_blocks=self._layout.num_blocks,
                )
            return self._export

    def close(self) -> None:
        self.bells.close()

    def send_part(self, job: PartJob) -> None:
        if job.armed is not None:
            pass  # the caller's thread rang the receiver's doorbell (SendHandle.send_layers): no wait here
        elif job.ready is not None and not job.ready.query():
            # The earlier parts' frames go out before this thread blocks: the receiver copies them meanwhile.
            # (Deferred past the wait, a prompt's groups would all reach it after its forward pass.)
            job.conn.flush(job.watch)
            job.ready.synchronize()  # the receiver copies as soon as it reads KVPart
        job.conn.defer_frame(part_frame(job))  # with the next frame, or before the session waits


@dataclass(frozen=True)
class _Mapping:
    handle: bytes
    offset: int
    mapped_ptr: int  # what ipcOpenMemHandle returned (to close it)
    remote: KVLayout  # the sender's layout (its own num_blocks)
    strides: tuple[int, ...]  # bytes

    @functools.cached_property
    def source(self) -> DevicePointer:
        """The sender's cache as a kernel argument."""
        # An FP8 cache's codes move as bytes, as the receiver's own cache does (transport.byte_cache).
        dtype = torch.uint8 if self.remote.quantized else getattr(torch, self.remote.dtype)
        itemsize = torch.empty((), dtype=dtype).element_size()
        elements = tuple(stride // itemsize for stride in self.strides)
        return DevicePointer(self.cache_ptr, dtype, self.remote.cache_shape, elements)

    @property
    def cache_ptr(self) -> int:
        return self.mapped_ptr + self.offset


class IpcReceiverTransport(ReceiverTransport):
    def __init__(self, layout: KVLayout, cache: torch.Tensor, config: TransferConfig) -> None:
        self._device = require_cuda(cache, "cuda_ipc")
        self._layout = layout
        self._cache = cache
        self._strides = byte_strides(layout)
        self._cache_ptr = cache_pointer(cache)
        self._stream = transfer_stream(self._device)  # the device's highest priority
        self._ops = gpu_ops()  # events and block-id copies that keep the interpreter lock
        self._src_ids = IdsPool(self._stream, layout.num_blocks)
        self._dst_ids = IdsPool(self._stream, layout.num_blocks)
        self._clock = CopyClock()  # when the copies on _stream should end: waits sleep until then
        self._timers: list[Any] = []  # timed events of completed copies, reused (creating one costs more)
        self._lock = threading.Lock()
        self._setup_lock = threading.Lock()
        self._mappings: dict[bytes, _Mapping] = {}
        self._retired: list[_Mapping] = []
        # Doorbell pages by pair and the leases armed on them (kv_transfer.ipc_bells).
        self.bells = ReceiverBells(
            self._device,
            self._ops,
            config.doorbell_slots,
            config.doorbell_capacity,
            group_ends(layout.num_layers, max(1, config.layer_groups)),
        )

    def pair_ready(self, peer_id: bytes) -> bool:
        with self._lock:
            return peer_id in self._mappings

    def setup_pair(
        self, peer_id: bytes, setup: kv_pb2.KVPairSetup, conn: FrameConnection, watch: Watch
    ) -> None:
        if setup.WhichOneof("kind") != "cuda_ipc":
            raise TransferFailed(FailureReason.TRANSPORT_MISMATCH, "expected a cuda_ipc pair setup")
        export = setup.cuda_ipc
        with self._setup_lock:  # one handle is opened once per process (a second open of it fails)
            with self._lock:
                current = self._mappings.get(peer_id)
            if current is None or (current.handle, current.offset) != (
                bytes(export.mem_handle),
                export.offset,
            ):
                mapping = self._open(export)
                with self._lock:
                    old = self._mappings.get(peer_id)
                    self._mappings[peer_id] = mapping
                    if old is not None:  # a copy may still use it: close it with the receiver, not now
                        self._retired.append(old)
            with self._lock:
                mapping = self._mappings[peer_id]
            bell = self.bells.pair(peer_id, functools.partial(self._pull, mapping))
        conn.send_frame(kv_pb2.KVFrame(pair_setup_ack=kv_pb2.KVPairSetupAck(doorbell=bell)), watch)

    def arm(self, peer_id: bytes, block_ids: tuple[int, ...]) -> Armed | None:
        """Queue a lease's copies behind a free slot of this pair's doorbell (ReceiverBells.arm); None: unarmed."""
        with self._lock:
            mapping = self._mappings.get(peer_id)
        if mapping is None:
            return None
        return self.bells.arm(peer_id, block_ids, functools.partial(self._pull, mapping))

    def _open(self, export: kv_pb2.KVIpcExport) -> _Mapping:
        try:
            remote = dataclasses.replace(self._layout, num_blocks=export.num_blocks)
        except ConfigError as exc:
            raise TransferFailed(FailureReason.PAIR_SETUP_FAILED, f"sender's cache: {exc}") from None
        bind_device(self._device)
        try:
            ptr = int(_runtime().ipcOpenMemHandle(bytes(export.mem_handle)))
        except Exception as exc:
            raise TransferFailed(
                FailureReason.PAIR_SETUP_FAILED, f"cudaIpcOpenMemHandle failed: {exc}"
            ) from None
        mapping = _Mapping(bytes(export.mem_handle), export.offset, ptr, remote, byte_strides(remote))
        _, size = allocation_range(ptr)
        if export.offset + remote.total_bytes > size:
            _runtime().ipcCloseMemHandle(ptr)
            raise TransferFailed(
                FailureReason.PAIR_SETUP_FAILED,
                f"sender's cache (offset {export.offset} + {remote.total_bytes} bytes) "
                f"overruns its {size}-byte allocation",
            )
        return mapping

    def sink(self, peer_id: bytes) -> PartSink:
        return _IpcSink(self, peer_id)

    def check_source_ids(self, peer_id: bytes, block_ids: tuple[int, ...]) -> None:
        """The sender's block ids must lie in its cache (the copy kernel clamps them anyway)."""
        with self._lock:
            mapping = self._mappings.get(peer_id)
        if mapping is None:
            raise TransferFailed(FailureReason.PAIR_SETUP_FAILED, "no mapped cache for this sender")
        try:
            mapping.remote.check_block_ids(block_ids, "src block id")
        except ValueError as exc:
            raise TransferFailed(FailureReason.DESCRIPTOR_MISMATCH, str(exc)) from None

    def drain_sink(self, peer_id: bytes) -> PartSink | None:
        return _IpcDrain()  # the receiver pulls: a refused transfer has sent no data to take in

    def _start_part(self, job: PartJob, peer_id: bytes) -> _Copy:
        """Queue the part's copies on our stream, between two timed events."""
        with self._lock:
            mapping = self._mappings.get(peer_id)
        if mapping is None:
            raise TransferFailed(FailureReason.PAIR_SETUP_FAILED, "no mapped cache for this sender")
        try:
            mapping.remote.check_block_ids(job.remote_block_ids, "src block id")
        except ValueError as exc:  # never read outside the sender's cache
            raise TransferFailed(FailureReason.DESCRIPTOR_MISMATCH, str(exc)) from None
        bind_device(self._device)
        try:
            started = self._timer()
            self._ops.record(started, self._stream)
            runs = block_runs(job.remote_block_ids, job.block_ids) if COPY_ENGINE_MAX_RUNS else []
            if runs and len(runs) <= COPY_ENGINE_MAX_RUNS:
                self._enqueue_copies(job, mapping, runs)
            else:
                src_ids = self._ops.ids(self._src_ids, job.remote_block_ids)
                dst_ids = self._ops.ids(self._dst_ids, job.block_ids)
                l0, l1 = job.layer_begin, job.layer_end
                with torch.cuda.stream(self._stream):
                    self._pull(mapping, l0, l1, src_ids, dst_ids, self._stream)
            copied = self._timer()
            self._ops.record(copied, self._stream)
        except Exception as exc:
            raise TransferFailed(
                FailureReason.TRANSPORT_ERROR, f"CUDA copy: {type(exc).__name__}: {exc}"
            ) from None
        return _Copy(started, copied, job.num_bytes, self._clock.expect(job.num_bytes))

    def _pull(self, mapping: _Mapping, begin: int, end: int, src_ids: Any, dst_ids: Any, stream: Any) -> None:
        """Queue on `stream` (the current one) the copy of layers [begin, end) of the sender's blocks src_ids
        into ours, dst_ids, reading its mapped cache over NVLink (kv_transfer.block_copy)."""
        copy_blocks(
            mapping.source.layers(begin, end),
            self._cache_ptr.layers(begin, end),
            src_ids,
            dst_ids,
            self._ops,
            stream,
        )

    def _timer(self) -> Any:
        with self._lock:
            if self._timers:
                return self._timers.pop()
        return self._ops.new_event(timed=True)

    def _done(self, copies: list[_Copy], learn: bool) -> None:
        """The copies completed: teach the clock how fast they ran (learn) and keep their events for reuse."""
        for copy in copies:
            if learn:
                try:
                    self._clock.learn(copy.num_bytes, self._ops.elapsed_s(copy.started, copy.copied))
                except Exception:  # timing only: a failed query never fails a landed transfer
                    log.debug("timing a KV copy failed", exc_info=True)
                    learn = False
        with self._lock:
            self._timers.extend(e for copy in copies for e in (copy.started, copy.copied))

    def _enqueue_copies(self, job: PartJob, mapping: _Mapping, runs: list[tuple[int, int, int]]) -> None:
        runtime = _runtime()
        src, dst = mapping.strides, self._strides
        rows = 2 * (
            job.layer_end - job.layer_begin
        )  # (layer, K|V) planes, S0 == 2 * S1 for a contiguous cache
        src_base = mapping.cache_ptr + job.layer_begin * src[0]
        dst_base = self._cache.data_ptr() + job.layer_begin * dst[0]
        for s, d, length in runs:
            runtime.memcpy2DAsync(
                dst_base + d * dst[2],
                dst[1],
                src_base + s * src[2],
                src[1],
                length * dst[2],
                rows,
                runtime.memcpyDefault,
                self._stream.cuda_stream,
            )

    def close(self) -> None:
        self.bells.close()  # first: no armed wait may outlive its page, nor a copy its mapping
        runtime = _runtime()
        with self._lock:
            mappings = [*self._mappings.values(), *self._retired]
            self._mappings, self._retired = {}, []
        for mapping in mappings:
            runtime.ipcCloseMemHandle(mapping.mapped_ptr)


@dataclass(frozen=True)
class _Copy:
    """One part's copies on the receiver's stream: between two timed events, with the clock's predicted end."""

    started: Any
    copied: Any
    num_bytes: int
    expect_at: float


class _IpcSink(PartSink):
    def __init__(self, transport: IpcReceiverTransport, peer_id: bytes) -> None:
        self._t = transport
        self._peer_id = peer_id
        self._copies: list[_Copy] = []

    def part(self, job: PartJob) -> None:
        self._copies.append(self._t._start_part(job, self._peer_id))

    def finish(self, watch: Watch, conn: FrameConnection) -> None:
        if self._copies:
            # A local copy always finishes; only our own deadline and cancellation count. The connection is
            # not read here: the next thing on it may be the sender's next transfer.
            last = self._copies[-1]
            wait_event(last.copied, watch, None, FailureReason.SENDER_ABORTED, last.expect_at)
            copies, self._copies = self._copies, []
            self._t._done(copies, learn=True)

    def abandon(self) -> None:
        self._t._stream.synchronize()  # local copies always finish: no write pending on return
        copies, self._copies = self._copies, []
        self._t._done(copies, learn=False)


class _IpcDrain(PartSink):
    def part(self, job: PartJob) -> None:
        raise TransferFailed(FailureReason.INTERNAL, "a drain sink takes no parts")

    def discard(
        self, layer_begin: int, layer_end: int, num_blocks: int, heads: tuple[int, int] | None = None
    ) -> None:
        pass
