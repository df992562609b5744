"""nccl transport: one 2-rank CuPy NCCL communicator per (sender GPU, receiver GPU) pair.

Pair setup (once, or again after an abort): the sender (rank 0) draws a unique id and sends it in KVPairSetup;
the receiver (rank 1) acks, and both sides init the communicator in a helper thread joined with a timeout (a
blocked init cannot be aborted; if the peer never joins, the helper is abandoned and the pair fails).

Transfers to one receiver share one control connection (SenderTransport.exclusive), so both sides see the parts
in one order. Each part is cut into slices (kv_transfer.slicing) that both sides derive alike; each slice is one
NCCL send matched by one NCCL receive, posted in that order, with no reply per part. Everything is queued on
the GPU without host waits, through a ring of RING_SLOTS staging buffers per pair:

    sender    gather stream: [wait `ready`] [wait slot free] gather cache[l0:l1, :, src] -> slot
              send stream:   [wait gathered] ncclSend(slot) -> slot free again
    receiver  recv stream:   [wait slot free] ncclRecv(slot)
              scatter stream: [wait received] scatter slot -> cache[l0:l1, :, dst] -> slot free again

so gathering and scattering overlap the link. Both streams run at the device's highest priority, and every
event, NCCL call and block-id copy goes through kv_transfer.gpu_ops, which keeps the interpreter lock (a busy
engine loop made each release cost a wait). The receiver's host waits once, at KVDone, for the last scatter;
the sender's once, after KVAck, for its last send. Bytes travel as NCCL_UINT8 (CuPy's NCCL has no bfloat16;
bytes are bit-exact for any dtype). Waits poll events against the transfer's deadline and the control socket.
On expiry, abort, or a peer's KVAbort, the side aborts its communicator (NCCL kernels of an aborted communicator
exit), waits for its streams to drain so no write or read is pending, and drops the pair: the next transfer
builds a new one.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kv_transfer.block_copy import (
    DevicePointer,
    cache_pointer,
    copy_blocks,
    ids_pointer,
    staging_pointer,
    warm,
)
from kv_transfer.config import TransferConfig
from kv_transfer.contracts import FailureReason, TransferFailed
from kv_transfer.cuda_events import bind_device, require_cuda, wait_event
from kv_transfer.frames import FrameConnection, Watch, expect
from kv_transfer.gpu_ops import GpuOps, IdsPool, gpu_ops, transfer_stream
from kv_transfer.slicing import Slice, ring_bytes, slices
from kv_transfer.transport import (
    PartJob,
    PartSink,
    PartSource,
    ReceiverTransport,
    SenderTransport,
    part_frame,
    window_layout,
)
from model_runtime.kv_layout import KVLayout
from tandem_api.tandem.v1 import kv_pb2

SENDER_RANK, RECEIVER_RANK = 0, 1
RING_SLOTS = 3  # staging buffers per pair and side (slices in flight at once): 192 MiB of GPU memory


def _nccl() -> Any:
    try:
        from cupy.cuda import nccl  # type: ignore[import-not-found]
    except ImportError as exc:
        raise TransferFailed(
            FailureReason.PAIR_SETUP_FAILED, f"transport nccl needs CuPy with NCCL: {exc}"
        ) from None
    return nccl


def _uid_bytes(uid: Any) -> bytes:
    """CuPy >= 14 returns bytes, older releases a tuple of signed chars."""
    return bytes(uid) if isinstance(uid, bytes) else bytes(v & 0xFF for v in uid)


def _new_comm(uid: bytes, rank: int) -> Any:
    nccl = _nccl()
    try:
        return nccl.NcclCommunicator(2, uid, rank)
    except TypeError:  # an older CuPy wants the id as a tuple of signed chars
        return nccl.NcclCommunicator(2, tuple(b - 256 if b > 127 else b for b in uid), rank)


def _connect(comm: Any, rank: int, device: torch.device) -> None:
    """One 1-byte send/recv right after init: NCCL sets up a pair's p2p connection inside the first
    ncclSend/ncclRecv, which then blocks until the peer's matching call. Doing it here, in the abandonable init
    thread, keeps every later receive asynchronous so transfer deadlines can fire."""
    nccl = _nccl()
    stream = torch.cuda.Stream(device)
    probe = torch.zeros(1, dtype=torch.uint8, device=device)
    if rank == SENDER_RANK:
        comm.send(probe.data_ptr(), 1, nccl.NCCL_UINT8, RECEIVER_RANK, stream.cuda_stream)
    else:
        comm.recv(probe.data_ptr(), 1, nccl.NCCL_UINT8, SENDER_RANK, stream.cuda_stream)
    stream.synchronize()


def init_comm(
    uid: bytes, rank: int, device: torch.device, timeout_s: float, watch: Watch | None = None
) -> Any:
    """ncclCommInitRank blocks until the peer joins and cannot be interrupted: run it in a helper thread,
    waiting at most timeout_s and only while `watch` (the transfer's deadline and aborts) allows."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast can take a shared host's GPUs out of service
    outcome: dict[str, Any] = {}

    def work() -> None:
        try:
            bind_device(device)
            comm = _new_comm(uid, rank)
            _connect(comm, rank, device)
            outcome["comm"] = comm
        except Exception as exc:
            outcome["error"] = exc

    helper = threading.Thread(target=work, name="kv-nccl-init", daemon=True)
    helper.start()
    end = time.monotonic() + timeout_s
    while helper.is_alive() and time.monotonic() < end:
        helper.join(0.05)
        if watch is not None and helper.is_alive():
            watch.check()  # abandons the helper: a late init only leaks a communicator nobody uses
    if helper.is_alive():
        raise TransferFailed(
            FailureReason.PAIR_SETUP_FAILED,
            f"NCCL init (rank {rank}) did not finish within {timeout_s}s; is the peer alive?",
        )
    if "error" in outcome:
        raise TransferFailed(
            FailureReason.PAIR_SETUP_FAILED, f"NCCL init (rank {rank}) failed: {outcome['error']}"
        )
    return outcome["comm"]


@dataclass
class _Pair:
    """A communicator and its GPU plumbing. `first` (gather or recv) and `second` (send or scatter) are the two
    streams of the pipeline, at the device's highest priority. Ring slot k's work on `first` ends with
    first_done[k]; on `second` with second_done[k], after which slot k is free again. Every event, NCCL call and
    block-id copy goes through `ops` (kv_transfer.gpu_ops: without letting go of the interpreter lock)."""

    comm: Any
    first: torch.cuda.Stream
    second: torch.cuda.Stream
    ring: list[torch.Tensor]
    arange: torch.Tensor  # 0..num_blocks-1: the block ids of a staging buffer
    ops: GpuOps
    ids: IdsPool  # the request's block ids, on the stream that uses them (sender: first; receiver: second)
    first_done: list[Any]
    second_done: list[Any]
    slot: int = 0
    created_at: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def build(cls, comm: Any, cache: torch.Tensor, layout: KVLayout, rank: int) -> _Pair:
        device = cache.device
        size = ring_bytes(layout)
        ring = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(RING_SLOTS)]
        arange = torch.arange(layout.num_blocks, dtype=torch.long, device=device)
        first, second = transfer_stream(device), transfer_stream(device)
        ops = gpu_ops()
        ids = IdsPool(first if rank == SENDER_RANK else second, layout.num_blocks)
        torch.cuda.synchronize(device)  # the buffers exist before any side stream uses them
        slot = staging_pointer(ring[0].data_ptr(), cache.dtype, layout.staging_shape(1, (0, 1)))
        warm(cache, slot, arange, gather=rank == SENDER_RANK)  # no kernel loads once NCCL calls are pending
        events = [ops.new_event() for _ in range(2 * RING_SLOTS)]
        return cls(comm, first, second, ring, arange, ops, ids, events[:RING_SLOTS], events[RING_SLOTS:])

    def next_slot(self) -> int:
        k, self.slot = self.slot, (self.slot + 1) % RING_SLOTS
        return k

    def post_recv(self, nbytes: int) -> int:
        """Receive the next slice into a free ring slot on `first`; first_done[k] follows the receive."""
        k = self.next_slot()
        self.ops.wait(self.first, self.second_done[k])
        self.ops.nccl(False, self.comm, self.ring[k].data_ptr(), nbytes, SENDER_RANK, self.first)
        self.ops.record(self.first_done[k], self.first)
        return k

    def slice_views(
        self, k: int, cache: DevicePointer, ids: torch.Tensor, piece: Slice, layout: KVLayout
    ) -> tuple[DevicePointer, DevicePointer, DevicePointer, DevicePointer]:
        """(cache layers, staging in slot k, the cache's block ids, the staging's) of one slice, as kernel
        arguments built without torch ops: the per-slice work of a transfer thread stays off the GIL's queue."""
        n = piece.block_end - piece.block_begin
        staging = staging_pointer(self.ring[k].data_ptr(), cache.dtype, piece.shape(layout))
        return (
            cache.layers(piece.layer_begin, piece.layer_end),
            staging,
            ids_pointer(ids, piece.block_begin, piece.block_end),
            ids_pointer(self.arange, 0, n),
        )

    def abort(self) -> None:
        """Abort the communicator, then wait until nothing of ours is queued (aborted NCCL kernels exit; the
        gathers, scatters and copies are local and always finish)."""
        self.comm.abort()
        self.first.synchronize()
        self.second.synchronize()


class _Pairs:
    """Per-peer communicators; aborting drops a pair so the next transfer builds a fresh one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pairs: dict[bytes, _Pair] = {}
        self._setup_locks: dict[bytes, threading.Lock] = {}

    def get(self, peer_id: bytes) -> _Pair | None:
        with self._lock:
            return self._pairs.get(peer_id)

    def setup_lock(self, peer_id: bytes) -> threading.Lock:
        with self._lock:
            return self._setup_locks.setdefault(peer_id, threading.Lock())

    def put(self, peer_id: bytes, pair: _Pair) -> _Pair | None:
        with self._lock:
            old = self._pairs.get(peer_id)
            self._pairs[peer_id] = pair
        return old

    def drop(self, peer_id: bytes, pair: _Pair) -> None:
        """Abort `pair` and forget it, unless a newer pair already replaced it."""
        with self._lock:
            if self._pairs.get(peer_id) is pair:
                del self._pairs[peer_id]
        pair.abort()

    def close(self) -> None:
        with self._lock:
            pairs, self._pairs = list(self._pairs.values()), {}
        for pair in pairs:
            pair.abort()


def _window(cache: DevicePointer, heads: tuple[int, int] | None) -> DevicePointer:
    """The cache, or the window of its heads that a job moves."""
    return cache if heads is None else cache.heads(*heads)


def _as_failure(exc: Exception) -> TransferFailed:
    if isinstance(exc, TransferFailed):
        return exc
    return TransferFailed(FailureReason.TRANSPORT_ERROR, f"NCCL: {type(exc).__name__}: {exc}")


def _live_pair(pairs: _Pairs, peer_id: bytes) -> _Pair:
    pair = pairs.get(peer_id)
    if pair is None:
        raise TransferFailed(
            FailureReason.PAIR_SETUP_FAILED, "no NCCL communicator with this peer (aborted?)"
        )
    return pair


class NcclSenderTransport(SenderTransport):
    exclusive = True

    def __init__(self, layout: KVLayout, cache: torch.Tensor, config: TransferConfig) -> None:
        self._device = require_cuda(cache, "nccl")
        self._layout = layout
        self._cache = cache
        self._cache_ptr = cache_pointer(cache)
        self._config = config
        self._pairs = _Pairs()

    def ensure_pair(
        self, peer_id: bytes, peer_ready: bool, conn: FrameConnection, watch: Watch, since: float
    ) -> None:
        bind_device(self._device)
        with self._pairs.setup_lock(peer_id):
            pair = self._pairs.get(peer_id)
            if pair is not None and (peer_ready or pair.created_at >= since):
                return
            if pair is not None:  # the receiver lost its side (it aborted): ours is stale
                self._pairs.drop(peer_id, pair)
            uid = _uid_bytes(_nccl().get_unique_id())
            setup = kv_pb2.KVPairSetup(nccl=kv_pb2.KVNcclSetup(unique_id=uid))
            conn.send_frame(kv_pb2.KVFrame(pair_setup=setup), watch)
            expect(conn.read_frame(watch), "pair_setup_ack", FailureReason.PAIR_SETUP_FAILED)
            comm = init_comm(uid, SENDER_RANK, self._device, self._config.pair_setup_timeout_s, watch)
            self._pairs.put(peer_id, _Pair.build(comm, self._cache, self._layout, SENDER_RANK))

    def source(self, peer_id: bytes) -> PartSource:
        return _NcclSource(self, peer_id)

    def close(self) -> None:
        self._pairs.close()


class _NcclSource(PartSource):
    def __init__(self, transport: NcclSenderTransport, peer_id: bytes) -> None:
        self._t = transport
        self._peer_id = peer_id
        self._pair: _Pair | None = None
        self._ids: torch.Tensor | None = None  # the transfer's block ids on the device (pair.first)
        self._last: Any = None  # the event after this transfer's last send

    def part(self, job: PartJob) -> None:
        t = self._t
        pair = self._pair = self._pair or _live_pair(t._pairs, self._peer_id)
        job.conn.send_frame(part_frame(job), job.watch)
        try:  # from here the receiver posts receives for these slices: any failure must drop the pair
            bind_device(t._device)
            with pair.lock, torch.cuda.stream(pair.first):
                ops = pair.ops
                if job.ready is not None:
                    ops.wait(pair.first, job.ready)
                if self._ids is None:  # once per transfer: its parts share the block list
                    self._ids = ops.ids(pair.ids, job.block_ids)
                layout, cache_ptr = job.layout(t._layout), _window(t._cache_ptr, job.heads)
                for piece in slices(layout, job.layer_begin, job.layer_end, len(job.block_ids)):
                    k, nbytes = pair.next_slot(), piece.num_bytes(layout)
                    ops.wait(pair.first, pair.second_done[k])
                    cache, staging, cache_ids, staging_ids = pair.slice_views(
                        k, cache_ptr, self._ids, piece, layout
                    )
                    copy_blocks(cache, staging, cache_ids, staging_ids, ops, pair.first)
                    ops.record(pair.first_done[k], pair.first)
                    ops.wait(pair.second, pair.first_done[k])
                    ops.nccl(True, pair.comm, pair.ring[k].data_ptr(), nbytes, RECEIVER_RANK, pair.second)
                    ops.record(pair.second_done[k], pair.second)
                    self._last = pair.second_done[k]
        except Exception as exc:
            raise _as_failure(exc) from None

    def finish(self, watch: Watch) -> None:
        if self._last is not None:  # the receiver acked, so the sends completed: this returns at once
            wait_event(self._last, watch, None, FailureReason.RECEIVER_ABORTED)

    def abandon(self) -> None:
        if self._pair is not None:
            self._t._pairs.drop(self._peer_id, self._pair)


class NcclReceiverTransport(ReceiverTransport):
    exclusive = True

    def __init__(self, layout: KVLayout, cache: torch.Tensor, config: TransferConfig) -> None:
        self._device = require_cuda(cache, "nccl")
        self._layout = layout
        self._cache = cache
        self._cache_ptr = cache_pointer(cache)
        self._config = config
        self._pairs = _Pairs()

    def pair_ready(self, peer_id: bytes) -> bool:
        return self._pairs.get(peer_id) is not None

    def setup_pair(
        self, peer_id: bytes, setup: kv_pb2.KVPairSetup, conn: FrameConnection, watch: Watch
    ) -> None:
        if setup.WhichOneof("kind") != "nccl":
            raise TransferFailed(FailureReason.TRANSPORT_MISMATCH, "expected an nccl pair setup")
        bind_device(self._device)
        old = self._pairs.get(peer_id)
        if old is not None:
            self._pairs.drop(peer_id, old)
        conn.send_frame(kv_pb2.KVFrame(pair_setup_ack=kv_pb2.KVPairSetupAck()), watch)
        comm = init_comm(
            bytes(setup.nccl.unique_id), RECEIVER_RANK, self._device, self._config.pair_setup_timeout_s, watch
        )
        self._pairs.put(peer_id, _Pair.build(comm, self._cache, self._layout, RECEIVER_RANK))

    def sink(self, peer_id: bytes) -> PartSink:
        return _NcclSink(self, peer_id)

    def drain_sink(self, peer_id: bytes) -> PartSink | None:
        return _NcclSink(self, peer_id) if self._pairs.get(peer_id) is not None else None

    def close(self) -> None:
        self._pairs.close()


class _NcclSink(PartSink):
    def __init__(self, transport: NcclReceiverTransport, peer_id: bytes) -> None:
        self._t = transport
        self._peer_id = peer_id
        self._pair: _Pair | None = None
        self._ids: torch.Tensor | None = None  # the transfer's block ids on the device (pair.second)
        self._last: Any = None  # the event after this transfer's last scatter

    def part(self, job: PartJob) -> None:
        t = self._t
        pair = self._pair = self._pair or _live_pair(t._pairs, self._peer_id)
        try:  # a failure from here may leave a receive posted: the pair must go (abandon)
            bind_device(t._device)
            with pair.lock, torch.cuda.stream(pair.second):
                ops = pair.ops
                if self._ids is None:  # once per transfer: its parts share the block list
                    self._ids = ops.ids(pair.ids, job.block_ids)
                layout, cache_ptr = job.layout(t._layout), _window(t._cache_ptr, job.heads)
                for piece in slices(layout, job.layer_begin, job.layer_end, len(job.block_ids)):
                    k = pair.post_recv(piece.num_bytes(layout))
                    ops.wait(pair.second, pair.first_done[k])
                    cache, staging, cache_ids, staging_ids = pair.slice_views(
                        k, cache_ptr, self._ids, piece, layout
                    )
                    copy_blocks(staging, cache, staging_ids, cache_ids, ops, pair.second)
                    ops.record(pair.second_done[k], pair.second)
                    self._last = pair.second_done[k]
        except Exception as exc:
            raise _as_failure(exc) from None

    def discard(
        self, layer_begin: int, layer_end: int, num_blocks: int, heads: tuple[int, int] | None = None
    ) -> None:
        """Post the receives a refused transfer's sends expect, into the ring, with no scatter: the
        communicator stays in step and the cache is not touched."""
        t = self._t
        pair = self._pair = self._pair or _live_pair(t._pairs, self._peer_id)
        layout = window_layout(t._layout, heads)
        try:
            bind_device(t._device)
            with pair.lock:
                for piece in slices(layout, layer_begin, layer_end, num_blocks):
                    self._last = pair.first_done[pair.post_recv(piece.num_bytes(layout))]
        except Exception as exc:
            raise _as_failure(exc) from None

    def finish(self, watch: Watch, conn: FrameConnection) -> None:
        if self._last is not None:
            wait_event(self._last, watch, conn, FailureReason.SENDER_ABORTED)

    def abandon(self) -> None:
        if self._pair is not None:  # abort, then wait for the streams: no write pending on return
            self._t._pairs.drop(self._peer_id, self._pair)
