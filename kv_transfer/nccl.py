"""nccl transport: one 2-rank CuPy NCCL communicator per (sender GPU, receiver GPU) pair.

Pair setup (once, or again after an abort): the sender (rank 0) draws a unique id and sends it in KVPairSetup;
the receiver (rank 1) acks, and both sides init the communicator in a helper thread joined with a timeout (a
blocked init cannot be aborted; if the peer never joins, the helper is abandoned and the pair fails).

Per part, under the pair's lock on both sides so at most one part is in flight per communicator and the send
and receive post orders cannot diverge:

    sender                                        receiver
    KVPart ------------------------------------>  staging = empty(...); comm.recv(staging); event
           <------------------------------------  KVPartReady
    gather cache[l0:l1, :, src] into staging
    (on its own stream, after the `ready` event)
    comm.send(staging); event                      poll event; scatter staging into cache[l0:l1, :, dst]
    poll event                                     wait for the scatter; only then may the blocks be freed

Bytes travel as NCCL_UINT8 (CuPy's NCCL has no bfloat16; bytes are bit-exact for any dtype). Nothing ever
blocks on communication: events are polled against the transfer's deadline and the control socket. On expiry,
abort, or a peer's KVAbort, the side aborts its communicator and drops the pair (every transfer on it fails with
a clear reason; the next transfer builds a new one). Staging buffers of an aborted receive are kept alive
(quarantined) because the aborted kernel's last writes into them cannot be ruled out.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kv_transfer.config import TransferConfig
from kv_transfer.contracts import FailureReason, TransferFailed
from kv_transfer.cuda_events import bind_device, block_index, require_cuda, wait_event
from kv_transfer.frames import FrameConnection, Watch, expect
from kv_transfer.transport import PartJob, ReceiverTransport, SenderTransport, part_frame
from model_runtime.kv_layout import KVLayout
from tandem_api.tandem.v1 import kv_pb2

SENDER_RANK, RECEIVER_RANK = 0, 1


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
    comm: Any
    stream: torch.cuda.Stream
    created_at: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def abort(self) -> None:
        self.comm.abort()


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
    def __init__(self, layout: KVLayout, cache: torch.Tensor, config: TransferConfig) -> None:
        self._device = require_cuda(cache, "nccl")
        self._layout = layout
        self._cache = cache
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
            self._pairs.put(peer_id, _Pair(comm, torch.cuda.Stream(self._device)))

    def send_part(self, job: PartJob) -> None:
        nccl = _nccl()
        pair = _live_pair(self._pairs, job.peer_id)
        with pair.lock:
            job.conn.send_frame(part_frame(job), job.watch)
            expect(job.conn.read_frame(job.watch), "part_ready", FailureReason.RECEIVER_ABORTED)
            try:  # the receiver posted its receive: any failure from here leaves the communicator unusable
                with torch.cuda.stream(pair.stream):
                    if job.ready is not None:
                        pair.stream.wait_event(job.ready)
                    ids = block_index(job.block_ids, self._device)
                    staging = torch.index_select(self._cache[job.layer_begin : job.layer_end], 2, ids)
                    pair.comm.send(
                        staging.data_ptr(),
                        job.num_bytes,
                        nccl.NCCL_UINT8,
                        RECEIVER_RANK,
                        pair.stream.cuda_stream,
                    )
                    sent = torch.cuda.Event()
                    sent.record(pair.stream)
                wait_event(sent, job.watch, job.conn, FailureReason.RECEIVER_ABORTED)
            except Exception as exc:
                self._pairs.drop(job.peer_id, pair)
                raise _as_failure(exc) from None

    def close(self) -> None:
        self._pairs.close()


class NcclReceiverTransport(ReceiverTransport):
    def __init__(self, layout: KVLayout, cache: torch.Tensor, config: TransferConfig) -> None:
        self._device = require_cuda(cache, "nccl")
        self._layout = layout
        self._cache = cache
        self._config = config
        self._pairs = _Pairs()
        self._quarantine: list[torch.Tensor] = []

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
        self._pairs.put(peer_id, _Pair(comm, torch.cuda.Stream(self._device)))

    def receive_part(self, job: PartJob) -> None:
        nccl = _nccl()
        bind_device(self._device)
        pair = _live_pair(self._pairs, job.peer_id)
        shape = self._layout.staging_shape(len(job.block_ids), (job.layer_begin, job.layer_end))
        with pair.lock, torch.cuda.stream(pair.stream):
            staging = torch.empty(shape, dtype=self._cache.dtype, device=self._device)
            try:  # from here on a failure may leave a receive posted: the communicator must go
                # PartReady goes out before the receive is posted: the first send/recv on a pair sets up the
                # p2p connection inside the call, and ncclRecv then blocks until the peer's ncclSend arrives
                # (seen on NCCL 2.28). The sender posts its send only after PartReady, so the reverse order
                # deadlocks until both deadlines fire.
                job.conn.send_frame(kv_pb2.KVFrame(part_ready=kv_pb2.KVPartReady()), job.watch)
                pair.comm.recv(
                    staging.data_ptr(), job.num_bytes, nccl.NCCL_UINT8, SENDER_RANK, pair.stream.cuda_stream
                )
                received = torch.cuda.Event()
                received.record(pair.stream)
                wait_event(received, job.watch, job.conn, FailureReason.SENDER_ABORTED)
            except Exception as exc:
                self._quarantine.append(staging)  # the aborted receive may still touch it: never reuse
                self._pairs.drop(job.peer_id, pair)
                raise _as_failure(exc) from None
            ids = block_index(job.block_ids, self._device)
            self._cache[job.layer_begin : job.layer_end].index_copy_(2, ids, staging)
            scattered = torch.cuda.Event()
            scattered.record(pair.stream)
        scattered.synchronize()  # local work; the contract: no write pending when we return

    def close(self) -> None:
        self._pairs.close()
