"""Doorbells: a cuda_ipc handoff that the sender's GPU starts, with no host on its path.

Without them a cuda_ipc handoff crosses both hosts before a byte moves: the sender's transfer thread waits for
the KV on the host, writes its frames, the receiver's session thread reads them and queues the copy, and at
the end notices that the copy ended. On 2x H200 that was 0.6-1.1 ms of a 2k-token handoff whose copy takes
0.7 ms (docs/performance.md, "KV handoff"). With a doorbell:

    reserve (receiver, pair warm)  take a slot and generation g; write the lease's block ids into the slot; on
                                   the slot's own stream queue, per layer group,
                                   cuStreamWaitValue32(bell >= g*1024 + group end) -> copy the group's layers
                                   and after the last cuStreamWriteValue32(done = g)
    send (sender, KVTarget.armed)  write its block ids into the slot, then per layer group, on its GPU behind
                                   the group's event: cuStreamWriteValue32(bell = g*1024 + group end)
    KVDone (receiver)              wait until the page says done == g (a memory read, no driver call): landed

The page is one mapping of POSIX shared memory that both processes pin for their GPUs (cuMemHostRegister). The
copies are the receiver's own (it pulls from the sender's mapped cache, as without a doorbell), so it stays the
only writer of its cache and frees its blocks on its own authority: to end an armed lease it writes the bell
itself (the waits pass), waits for `done`, and only then gives the blocks back. The sender only writes ids and
bells into its pair's page; the copy kernel clamps every source id into the sender's cache
(kv_transfer.block_copy), and the receiver checks the slot's ids against KVBegin's before landing.

Hazards, measured with bench/diag/doorbell.py on 2x H200 (driver 580): an armed wait held none of 48 other
streams' kernels in its process and no allocation; but a kernel's *first* launch (CUDA's lazy module loading)
waited for it. Workers load their kernels at start-up (captured graphs, warm-up), and a pair loads the copy
kernel variant before it arms anything; still, a kernel first launched in a decode worker while a lease is
armed waits until that lease's sender rings or the lease ends. A slot's stream is created through the driver,
never taken from torch's stream pool (a pooled stream is shared: work queued behind an armed wait would wait
for the sender).

A slot whose lease ended before any sender claimed it rests for QUARANTINE_S before it is armed again (its
sender may still write ids into it: SlotTable says how a late write is caught).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import numpy as np
import torch

from kv_transfer.contracts import FailureReason, TransferFailed
from kv_transfer.cuda_events import fine_timer
from kv_transfer.frames import Watch

log = logging.getLogger(__name__)

BELL_STEP = 1024  # a bell counts generation * BELL_STEP + layers ready (a model has fewer than 1024 layers)
ALL_LAYERS = BELL_STEP - 1
MAX_GENERATION = (2**32 - 1) // BELL_STEP - 1  # the last generation whose bells fit 32 bits
LINE_WORDS = 16  # 64 bytes: each bell and done word on its own cache line
PAGE_BYTES = 4096
STREAM_NON_BLOCKING = 0x1
WAIT_GEQ = 0x0
REGISTER_PORTABLE_DEVICEMAP = 0x1 | 0x2
SPIN_S = 30e-6  # a landing wait polls without sleeping this long, then every POLL_S
POLL_S = 20e-6
SLOW_POLL_S = 250e-6  # after SLOW_AFTER_S: a copy this long is not waited for finely
SLOW_AFTER_S = 0.02
QUARANTINE_S = 60.0  # a slot whose lease ended unclaimed is armed again after this (SlotTable)
RELEASE_TIMEOUT_S = 10.0  # a released chain's copies end within a copy's time; past this something is broken


def bell_value(generation: int, layers: int) -> int:
    return generation * BELL_STEP + layers


@dataclass(frozen=True)
class Geometry:
    """Where a page's words are (uint32 indexes): per slot a bell line and a done line, then per slot the
    source ids and the destination ids, `capacity` each."""

    slots: int
    capacity: int

    def __post_init__(self) -> None:
        if not 1 <= self.slots <= 1024 or not 1 <= self.capacity <= 2**20:
            raise ValueError(f"doorbell page: {self.slots} slots of {self.capacity} ids is out of range")

    def bell(self, slot: int) -> int:
        return slot * 2 * LINE_WORDS

    def done(self, slot: int) -> int:
        return slot * 2 * LINE_WORDS + LINE_WORDS

    def src(self, slot: int) -> int:
        return self.slots * 2 * LINE_WORDS + slot * 2 * self.capacity

    def dst(self, slot: int) -> int:
        return self.src(slot) + self.capacity

    @property
    def num_bytes(self) -> int:
        words = self.slots * 2 * LINE_WORDS + self.slots * 2 * self.capacity
        return -(-words * 4 // PAGE_BYTES) * PAGE_BYTES


_CREATED: set[str] = set()  # pages this process made


class Page:
    """The host side of a doorbell page: its shared memory and its words."""

    def __init__(self, shm: shared_memory.SharedMemory, geometry: Geometry, owner: bool) -> None:
        self.shm, self.geometry, self.owner = shm, geometry, owner
        self.name = shm.name
        assert shm.buf is not None, "an open shared memory segment has a buffer"
        self.words: Any = np.frombuffer(shm.buf, dtype=np.uint32, count=geometry.num_bytes // 4)

    @classmethod
    def create(cls, geometry: Geometry) -> Page:
        shm = shared_memory.SharedMemory(
            f"tandem-kv-{secrets.token_hex(8)}", create=True, size=geometry.num_bytes
        )
        _CREATED.add(shm.name)
        page = cls(shm, geometry, owner=True)
        page.words[:] = 0
        return page

    @classmethod
    def open(cls, name: str, geometry: Geometry) -> Page:
        if not name.startswith("tandem-kv-") or "/" in name:
            raise ValueError(f"doorbell page: {name!r} is not a page name this project makes")
        shm = shared_memory.SharedMemory(name)
        try:
            _untrack(shm)
            if shm.size < geometry.num_bytes:
                raise ValueError(f"doorbell page {name!r}: {shm.size} bytes, expected {geometry.num_bytes}")
            return cls(shm, geometry, owner=False)
        except BaseException:
            shm.close()
            raise

    @property
    def host_ptr(self) -> int:
        return int(self.words.ctypes.data)

    def write_ids(self, start: int, ids: Sequence[int]) -> None:
        self.words[start : start + len(ids)] = ids

    def read_ids(self, start: int, n: int) -> Any:
        return self.words[start : start + n].copy()

    def close(self) -> None:
        self.words = None  # the shared memory cannot close while a view of it exists
        self.shm.close()
        if self.owner:
            with contextlib.suppress(FileNotFoundError):
                self.shm.unlink()


def _untrack(shm: shared_memory.SharedMemory) -> None:
    """A page we opened is the receiver's to unlink: keep Python's resource tracker from unlinking it when
    this process exits (it registers every SharedMemory it sees opened, Python < 3.13)."""
    if shm.name in _CREATED:  # ours: tracked once, unlinked by its owner
        return
    try:
        from multiprocessing import resource_tracker

        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    except Exception:  # a Python that does not track opened segments
        pass


class MemOps:
    """The driver calls a doorbell needs, through ctypes.PyDLL (they keep the interpreter lock: each returns in
    microseconds)."""

    def __init__(self, lib: ctypes.PyDLL) -> None:
        p, u, s, u64 = ctypes.c_void_p, ctypes.c_uint, ctypes.c_size_t, ctypes.c_uint64

        def fn(name: str, args: list[Any]) -> Any:
            f = getattr(lib, name)
            f.argtypes, f.restype = args, ctypes.c_int
            return f

        self._register = fn("cuMemHostRegister_v2", [p, s, u])
        self._unregister = fn("cuMemHostUnregister", [p])
        self._device_ptr = fn("cuMemHostGetDevicePointer_v2", [ctypes.POINTER(u64), p, u])
        self._wait = fn("cuStreamWaitValue32_v2", [p, u64, ctypes.c_uint32, u])
        self._write = fn("cuStreamWriteValue32_v2", [p, u64, ctypes.c_uint32, u])
        self._stream_create = fn("cuStreamCreateWithPriority", [ctypes.POINTER(p), u, ctypes.c_int])
        self._stream_destroy = fn("cuStreamDestroy_v2", [p])

    @staticmethod
    def _check(code: int, what: str) -> None:
        if code != 0:
            raise TransferFailed(FailureReason.TRANSPORT_ERROR, f"{what} failed with CUresult {code}")

    def register(self, page: Page) -> int:
        """Pin the page for every GPU of this process; its device address."""
        self._check(
            self._register(page.host_ptr, page.geometry.num_bytes, REGISTER_PORTABLE_DEVICEMAP),
            "cuMemHostRegister",
        )
        address = ctypes.c_uint64()
        code = self._device_ptr(ctypes.byref(address), page.host_ptr, 0)
        if code != 0:
            self._unregister(page.host_ptr)
            self._check(code, "cuMemHostGetDevicePointer")
        return int(address.value)

    def unregister(self, page: Page) -> None:
        self._unregister(page.host_ptr)

    def wait(self, stream: int, address: int, value: int) -> None:
        self._check(self._wait(stream, address, value, WAIT_GEQ), "cuStreamWaitValue32")

    def write(self, stream: int, address: int, value: int) -> None:
        self._check(self._write(stream, address, value, 0), "cuStreamWriteValue32")

    def new_stream(self, device: torch.device, priority: int = -64) -> torch.cuda.ExternalStream:
        """A stream of its own (never one of torch's pooled streams, which other work shares), at the
        device's highest priority (the driver clamps `priority` into its range)."""
        handle = ctypes.c_void_p()
        self._check(
            self._stream_create(ctypes.byref(handle), STREAM_NON_BLOCKING, priority), "cuStreamCreate"
        )
        return torch.cuda.ExternalStream(int(handle.value or 0), device=device)

    def destroy_stream(self, stream: torch.cuda.ExternalStream) -> None:
        self._stream_destroy(stream.cuda_stream)


@functools.lru_cache(maxsize=1)
def mem_ops() -> MemOps | None:
    """None where the driver lacks what a doorbell needs (then no lease is armed)."""
    try:
        return MemOps(ctypes.PyDLL("libcuda.so.1"))
    except (OSError, AttributeError) as exc:
        log.info("KV doorbells off: %s", exc)
        return None


class PinnedPage:
    """A page pinned for this process's GPUs, with the device address of each word."""

    def __init__(self, page: Page, ops: MemOps) -> None:
        self.page, self._ops = page, ops
        self.base = ops.register(page)

    def address(self, word: int) -> int:
        return self.base + 4 * word

    def ids_pointer(self, word: int, n: int) -> Any:
        from kv_transfer.block_copy import DevicePointer

        return DevicePointer(self.address(word), torch.int32, (n,), (1,))

    def close(self) -> None:
        try:
            self._ops.unregister(self.page)
        finally:
            self.page.close()


class SlotTable:
    """The receiver's slots of one page: which are free and each one's generation. Thread-safe.

    A slot goes back free once its lease landed or its claimed transfer failed (its sender wrote its ids before
    KVBegin). One whose lease ended before any claim is quarantined for QUARANTINE_S: its sender may still be
    about to write ids and ring (a send that started as the lease was cancelled). A stale write after that is
    caught, not copied silently: the receiver checks the slot's ids against KVBegin's at the claim and again
    after the copies, and fails the transfer on a difference. A slot whose chain did not end is retired."""

    def __init__(self, slots: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._free = list(range(slots - 1, -1, -1))
        self._held: list[tuple[float, int]] = []  # (free again at, slot)
        self._generation = [0] * slots
        self.quarantined = 0  # slots ever quarantined
        self.retired = 0

    def take(self) -> tuple[int, int] | None:
        """(slot, generation) of a free slot, or None when none is free (the lease goes unarmed)."""
        with self._lock:
            if self._held:
                now = self._clock()
                self._free[:0] = [slot for at, slot in self._held if at <= now]  # taken after the others
                self._held = [(at, slot) for at, slot in self._held if at > now]
            while self._free:
                slot = self._free.pop()
                if self._generation[slot] < MAX_GENERATION:
                    self._generation[slot] += 1
                    return slot, self._generation[slot]
            return None

    def put(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)

    def quarantine(self, slot: int) -> None:
        with self._lock:
            self._held.append((self._clock() + QUARANTINE_S, slot))
            self.quarantined += 1

    def retire(self, slot: int) -> None:
        with self._lock:
            self.retired += 1

    @property
    def free(self) -> int:
        with self._lock:
            return len(self._free)


@dataclass(frozen=True)
class Armed:
    """One armed lease on the receiver."""

    peer_id: bytes  # the pair's key: the sender's instance id (what KVTarget.armed names)
    slot: int
    generation: int
    num_blocks: int
    page: PinnedPage
    slots: SlotTable
    stream: Any  # the slot's stream

    @property
    def landed(self) -> bool:
        words = self.page.page.words
        return words is not None and int(words[self.page.page.geometry.done(self.slot)]) == self.generation

    def holds(self, src_ids: tuple[int, ...]) -> bool:
        """Whether the slot's source ids are `src_ids` (what KVBegin says the sender wrote)."""
        page = self.page.page
        return page.read_ids(page.geometry.src(self.slot), self.num_blocks).tolist() == list(src_ids)


def wait_landed(armed: Armed, watch: Watch) -> None:
    """Return once the armed copies ended (the page's done word); raise on the watch (deadline, cancel)."""
    if armed.landed:
        return
    fine_timer()
    start = time.monotonic()
    while not armed.landed:
        waited = time.monotonic() - start
        if waited < SPIN_S:
            continue
        watch.check()
        time.sleep(POLL_S if waited < SLOW_AFTER_S else SLOW_POLL_S)


def release(armed: Armed) -> bool:
    """End an armed chain that may still wait: ring every layer of its generation from here, then wait until
    its copies ended. False if they did not within RELEASE_TIMEOUT_S (then its blocks must not be reused)."""
    page = armed.page.page
    if page.words is None:
        return False
    geometry = page.geometry
    if not armed.landed:
        page.words[geometry.bell(armed.slot)] = bell_value(armed.generation, ALL_LAYERS)
    deadline = time.monotonic() + RELEASE_TIMEOUT_S
    while not armed.landed:
        if time.monotonic() > deadline:
            log.error(
                "a released KV doorbell chain (slot %d) did not end within %.0f s",
                armed.slot,
                RELEASE_TIMEOUT_S,
            )
            return False
        time.sleep(POLL_S)
    return True


def queue_chain(
    ops: MemOps,
    page: PinnedPage,
    stream: Any,
    slot: int,
    generation: int,
    group_ends: Sequence[int],
    copy: Callable[[int, int], None],
) -> None:
    """On `stream`: for each layer group [previous end, end): wait for the bell, copy(begin, end); then done."""
    geometry = page.page.geometry
    bell, done = page.address(geometry.bell(slot)), page.address(geometry.done(slot))
    begin = 0
    for end in group_ends:
        ops.wait(stream.cuda_stream, bell, bell_value(generation, end))
        copy(begin, end)
        begin = end
    ops.write(stream.cuda_stream, done, generation)
