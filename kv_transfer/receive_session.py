"""One control connection on the receiver, run on its own thread from accept to close.

    KVHello -> check layout, pick the transport the sender names -> KVHello      (refuse: KVError, close)
    then, until the sender closes or the connection idles out:
    [KVPairSetup -> transport builds the pair -> KVPairSetupAck]
    KVBegin -> claim the lease, check counts        (nothing is answered: the sender does not wait)
    KVPart* -> the transport's sink starts writing each layer group into the lease's blocks
    KVDone  -> every layer arrived and every write completed -> land (blocks now the caller's) -> KVAck, result

While a lease is claimed this thread is the only writer into its blocks, so it is also the one that frees
them when anything fails: after the sink confirmed no write is pending, never before (see kv_transfer.leases).
Any failure ends the connection too; only a transfer that landed leaves it open for the next.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kv_transfer.config import TransferConfig
from kv_transfer.contracts import FailureReason, Lease, TransferFailed, TransferResult
from kv_transfer.cuda_ipc import IpcReceiverTransport
from kv_transfer.descriptors import begin_window, check_begin, first_token_of
from kv_transfer.doorbell import Armed
from kv_transfer.frames import FrameConnection, Watch, error_frame, expect, frame_failure
from kv_transfer.leases import LeaseTable
from kv_transfer.pairing import check_hello, make_hello, pair_key
from kv_transfer.transport import PartJob, PartSink, ReceiverTransport, window_layout
from model_runtime.kv_layout import KVLayout
from tandem_api.tandem.v1 import kv_pb2

log = logging.getLogger(__name__)

# Failures the sender caused or already knows about: telling it again is pointless.
PEER_CAUSED = (FailureReason.CONNECTION_LOST, FailureReason.SENDER_ABORTED)
# Failures that are our decision to stop (KVAbort) rather than a refusal of what the sender sent (KVError).
OUR_ABORTS = (FailureReason.RECEIVER_ABORTED, FailureReason.LEASE_EXPIRED, FailureReason.SHUTDOWN)


@dataclass(frozen=True)
class ReceiverCore:
    """What every session of one KVReceiver shares."""

    layout: KVLayout
    config: TransferConfig
    table: LeaseTable
    transports: Mapping[str, ReceiverTransport]  # the ones held, by kind
    instance_id: bytes
    device_uuid: str
    deliver: Callable[[TransferResult], None]
    shutdown: Callable[[], TransferFailed | None]  # a SHUTDOWN failure once the receiver is closing
    refused: Callable[[str], None]  # count a refusal before any byte landed, by reason
    take_armed: Callable[[bytes], Armed | None] = lambda handle: None  # a claimed lease's doorbell chain


class ReceiveSession:
    def __init__(self, core: ReceiverCore, conn: FrameConnection) -> None:
        self.core = core
        self.conn = conn
        self.kind = ""  # the connection's transport, from the sender's hello
        self.transport: ReceiverTransport | None = None
        self.lease: Lease | None = None  # claimed and not landed: ours to fail
        self.sink: PartSink | None = None  # the claimed lease's writes, until they completed
        self.claimed_at = 0.0
        self.src_block_ids: tuple[int, ...] = ()
        self.heads: tuple[int, int] | None = None  # the claimed window of our cache's heads; None: all
        # The claimed transfer's copies, when they run behind a doorbell (kv_transfer.doorbell).
        self.armed_chain: Armed | None = None
        self.phases: dict[str, float] = {}
        self.watch = Watch(
            time.monotonic() + core.config.connect_timeout_s,
            FailureReason.DEADLINE_EXCEEDED,
            "handshake",
            cancelled=core.shutdown,
        )

    def run(self) -> None:
        try:
            peer_id = self._handshake()
            while self._next_transfer(peer_id):
                pass
        except TransferFailed as failure:
            self._fail(failure)
        except Exception as exc:  # a bug: fail this lease closed, keep the receiver alive, say what happened
            log.exception("KV receive session failed")
            self._fail(TransferFailed(FailureReason.INTERNAL, f"{type(exc).__name__}: {exc}"))
        finally:
            self.conn.close()

    # --- steps -----------------------------------------------------------------------------------------
    def _handshake(self) -> bytes:
        hello = expect(self.conn.read_frame(self.watch), "hello", FailureReason.PROTOCOL_ERROR).hello
        self.kind = check_hello(self.core.layout, tuple(self.core.transports), self.core.device_uuid, hello)
        self.transport = self.core.transports[self.kind]
        peer = pair_key(bytes(hello.instance_id), hello.lane if self.transport.exclusive else 0)
        ready = self.transport.pair_ready(peer)
        reply = make_hello(
            self.core.layout, self.core.instance_id, self.kind, self.core.device_uuid, pair_ready=ready
        )
        reply.hello.idle_timeout_ms = int(self.core.config.idle_timeout_s * 1000)
        self.conn.send_frame(reply, self.watch)
        return peer

    def _next_transfer(self, peer_id: bytes) -> bool:
        """Serve the next frames up to one landed transfer; False when the connection ended quietly (the sender
        closed it between transfers, it idled out, or the receiver is closing)."""
        idle = Watch(
            time.monotonic() + self.core.config.idle_timeout_s,
            FailureReason.DEADLINE_EXCEEDED,
            "idle connection",
            cancelled=self.core.shutdown,
        )
        while True:
            try:
                frame = self.conn.read_frame(idle)
            except TransferFailed as failure:
                if failure.reason in (FailureReason.CONNECTION_LOST, FailureReason.DEADLINE_EXCEEDED):
                    return False
                raise
            kind = frame.WhichOneof("body")
            if kind == "pair_setup":
                self._transport().setup_pair(peer_id, frame.pair_setup, self.conn, idle)
            elif kind == "begin":
                try:
                    self._claim(frame.begin, peer_id)
                except TransferFailed as refusal:
                    if self.lease is None:  # refused at the claim: a forged, spent or cancelled handle
                        self.core.refused(refusal.reason.name.lower())
                    if self.lease is not None or not self._drain(peer_id, frame.begin, refusal):
                        raise
                    return True
                self._serve(peer_id)
                return True
            else:
                raise frame_failure(frame, FailureReason.SENDER_ABORTED) or TransferFailed(
                    FailureReason.PROTOCOL_ERROR, f"expected a begin frame, got {kind}"
                )

    def _drain(self, peer_id: bytes, begin: kv_pb2.KVBegin, refusal: TransferFailed) -> bool:
        """The lease was refused (forged, cancelled, expired, already used) before any byte moved. The sender
        did not wait for a reply, so its parts are on their way: take them in without touching the cache and
        then refuse with KVError(drained), which keeps the connection and, on nccl, the communicator in step
        (a refusal would otherwise cost the pair a new communicator). False when the transport cannot drain or
        the counts are out of range: the caller closes the connection as for any failure."""
        layout = self.core.layout
        sink = self._transport().drain_sink(peer_id)
        if (
            sink is None
            or refusal.reason is FailureReason.SHUTDOWN
            or not 0 < begin.num_blocks <= layout.num_blocks
        ):
            return False
        self.sink = sink  # a failure from here abandons it (nccl: the pair is dropped)
        watch = Watch(
            time.monotonic() + self.core.config.connect_timeout_s,
            FailureReason.DEADLINE_EXCEEDED,
            "draining a refused transfer",
            cancelled=self.core.shutdown,
        )
        covered: set[int] = set()
        try:
            heads = begin_window(layout, begin)
        except TransferFailed:
            return False
        while (frame := self.conn.read_frame(watch)).WhichOneof("body") == "part":
            part = frame.part
            layers = range(part.layer_begin, part.layer_end)
            if not 0 <= part.layer_begin < part.layer_end <= layout.num_layers or covered.intersection(
                layers
            ):
                raise TransferFailed(
                    FailureReason.DESCRIPTOR_MISMATCH, "a refused transfer's parts are invalid"
                )
            covered.update(layers)
            sink.discard(part.layer_begin, part.layer_end, begin.num_blocks, heads)
        if frame.WhichOneof("body") != "done":
            raise frame_failure(frame, FailureReason.SENDER_ABORTED) or TransferFailed(
                FailureReason.PROTOCOL_ERROR, f"expected a part or done frame, got {frame.WhichOneof('body')}"
            )
        sink.finish(watch, self.conn)
        self.sink = None
        self.conn.send_frame(error_frame(refusal.reason, refusal.message, drained=True), watch)
        return True

    def _claim(self, begin: kv_pb2.KVBegin, peer_id: bytes) -> None:
        started = time.monotonic()
        self.heads = begin_window(self.core.layout, begin)
        if self.heads is not None and self.kind == "cuda_ipc":
            raise TransferFailed(
                FailureReason.TRANSPORT_MISMATCH,
                f"request {begin.request_id!r}: cuda_ipc moves whole caches, not a window of their heads",
            )
        lease = self.core.table.claim(bytes(begin.handle), begin.request_id, self.heads)
        self.lease, self.claimed_at = lease, time.monotonic()
        self.phases = {"claim": self.claimed_at - started}
        self.armed_chain = None
        armed = self.core.take_armed(lease.handle)
        if armed is not None:  # from here a failure releases the chain before the blocks are freed
            self.sink = self._ipc().bells.sink(armed)
        check_begin(begin, lease, self.kind, self._layout())
        self.src_block_ids = tuple(begin.src_block_ids)
        if armed is not None:
            self._check_armed(armed, begin, peer_id)
        table, handle = self.core.table, lease.handle
        self.watch = Watch(
            lease.expires_at,
            FailureReason.LEASE_EXPIRED,
            f"lease of {lease.request_id!r}",
            cancelled=lambda: table.cancellation(handle) or self.core.shutdown(),
        )

    def _check_armed(self, armed: Armed, begin: kv_pb2.KVBegin, peer_id: bytes) -> None:
        """Keep the armed chain when this sender rang it with the ids it names; else end it (the sender did not
        arm: the frames drive the copies)."""
        ipc = self._ipc()
        if (
            self.kind == "cuda_ipc"
            and armed.peer_id == peer_id
            and begin.armed_generation == armed.generation
        ):
            if not armed.holds(self.src_block_ids):
                raise TransferFailed(
                    FailureReason.DESCRIPTOR_MISMATCH,
                    f"request {begin.request_id!r}: the doorbell slot's block ids differ from KVBegin's",
                )
            ipc.check_source_ids(peer_id, self.src_block_ids)
            self.armed_chain = armed
            return
        if armed.peer_id == peer_id and self.kind == "cuda_ipc" and not begin.armed_generation:
            ipc.bells.stop_arming(peer_id)  # the sender it was armed for left it unused
        if not ipc.bells.release(
            armed, reusable=armed.peer_id == peer_id
        ):  # the sink stays: the blocks are kept
            raise TransferFailed(FailureReason.INTERNAL, "an armed KV copy did not end")
        self.sink = None

    def _serve(self, peer_id: bytes) -> None:
        """Take the parts up to KVDone. Besides `stream` (claim to KVDone read) the phases split this thread's
        time: `read` blocked reading frames, `post` queueing the parts' GPU work, and `stream_cpu` the CPU time
        the thread used (wall time well above it is time spent waiting, for the peer or for the GIL)."""
        covered: set[int] = set()
        if self.sink is None:  # not armed (an armed lease's sink was set at the claim)
            self.sink = self._transport().sink(peer_id)
        cpu_start = time.thread_time()
        while True:
            mark = time.monotonic()
            frame = self.conn.read_frame(self.watch)
            posted = time.monotonic()
            self._add_phase("read", posted - mark)
            kind = frame.WhichOneof("body")
            if kind == "part":
                self._receive_part(peer_id, frame.part, covered)
                self._add_phase("post", time.monotonic() - posted)
            elif kind == "done":
                self.phases["stream"] = posted - self.claimed_at
                self.phases["stream_cpu"] = time.thread_time() - cpu_start
                self._land(frame.done, covered)
                return
            else:
                raise frame_failure(frame, FailureReason.SENDER_ABORTED) or TransferFailed(
                    FailureReason.PROTOCOL_ERROR, f"unexpected {kind} frame after KVBegin"
                )

    def _layout(self) -> KVLayout:
        """The layout of what the claimed transfer moves: our cache, or the window of its heads."""
        return window_layout(self.core.layout, self.heads)

    def _ipc(self) -> IpcReceiverTransport:
        """The cuda_ipc transport, which armed the lease (whatever transport this connection is)."""
        ipc = self.core.transports.get("cuda_ipc")
        assert isinstance(ipc, IpcReceiverTransport), "only a receiver holding cuda_ipc arms leases"
        return ipc

    def _transport(self) -> ReceiverTransport:
        assert self.transport is not None, "set by the handshake"
        return self.transport

    def _add_phase(self, name: str, seconds: float) -> None:
        self.phases[name] = self.phases.get(name, 0.0) + seconds

    def _receive_part(self, peer_id: bytes, part: kv_pb2.KVPart, covered: set[int]) -> None:
        assert self.lease is not None
        layout, n = self._layout(), len(self.lease.block_ids)
        layers = range(part.layer_begin, part.layer_end)
        if not 0 <= part.layer_begin < part.layer_end <= layout.num_layers:
            raise TransferFailed(
                FailureReason.DESCRIPTOR_MISMATCH,
                f"part layers [{part.layer_begin}, {part.layer_end}) outside [0, {layout.num_layers})",
            )
        if covered.intersection(layers):
            raise TransferFailed(
                FailureReason.DESCRIPTOR_MISMATCH,
                f"part layers [{part.layer_begin}, {part.layer_end}) overlap an earlier part",
            )
        expected = layout.bytes_per_block_layer * n * len(layers)
        if part.num_bytes != expected:
            raise TransferFailed(
                FailureReason.DESCRIPTOR_MISMATCH,
                f"part num_bytes: expected {expected} for {n} blocks x {len(layers)} layers, "
                f"got {part.num_bytes}",
            )
        assert self.sink is not None
        self.sink.part(
            PartJob(
                conn=self.conn,
                watch=self.watch,
                peer_id=peer_id,
                request_id=self.lease.request_id,
                block_ids=self.lease.block_ids,
                layer_begin=part.layer_begin,
                layer_end=part.layer_end,
                num_bytes=expected,
                remote_block_ids=self.src_block_ids,
                heads=self.heads,
            )
        )
        covered.update(layers)

    def _land(self, done: kv_pb2.KVDone, covered: set[int]) -> None:
        assert self.lease is not None
        missing = self.core.layout.num_layers - len(covered)
        if missing:
            raise TransferFailed(
                FailureReason.DESCRIPTOR_MISMATCH, f"KVDone with {missing} layers not received"
            )
        first = first_token_of(done)
        assert self.sink is not None
        self.sink.finish(self.watch, self.conn)
        self.sink = None  # every write completed
        if self.armed_chain is not None and not self.armed_chain.holds(self.src_block_ids):
            raise TransferFailed(  # a stale sender of the slot's last lease wrote into it meanwhile
                FailureReason.DESCRIPTOR_MISMATCH, "the doorbell slot's block ids changed during the copies"
            )
        count = None if self.heads is None else self.heads[1]
        claimed = self.lease
        lease = self.core.table.land(claimed.handle, count)  # raises a cancellation that came first
        self.lease = None  # our heads landed: the blocks are the caller's, or the last claimant's to land
        if lease is None:  # other windows of the lease are still on their way: their claimant delivers
            self._ack(claimed, self._layout().bytes_per_block * len(claimed.block_ids))
            return
        seconds = time.monotonic() - self.claimed_at
        self.phases["land"] = seconds - self.phases.get("stream", 0.0)
        num_bytes = self.core.layout.bytes_per_block * len(lease.block_ids)
        # The decode side first (it admits the request from here), then the ack: the sender only frees its
        # blocks on it, and nothing waits for that.
        self.core.deliver(
            TransferResult(
                lease,
                True,
                first_token=first,
                num_bytes=num_bytes,
                seconds=seconds,
                phases=dict(self.phases),
                landed_at=self.claimed_at + seconds,
                armed=self.armed_chain is not None,
            )
        )
        self._ack(lease, self._layout().bytes_per_block * len(lease.block_ids))

    def _ack(self, lease: Lease, num_bytes: int) -> None:
        notice = Watch(
            time.monotonic() + self.core.config.connect_timeout_s, FailureReason.DEADLINE_EXCEEDED, "ack"
        )
        try:
            self.conn.send_frame(kv_pb2.KVFrame(ack=kv_pb2.KVAck(num_bytes=num_bytes)), notice)
        except (
            TransferFailed
        ) as exc:  # the KV landed: decode proceeds; the sender frees its blocks either way
            log.warning("request %r landed but the ack was not delivered: %s", lease.request_id, exc)

    # --- failure ---------------------------------------------------------------------------------------
    def _fail(self, failure: TransferFailed) -> None:
        if self.sink is not None:
            try:
                self.sink.abandon()  # returns once no write of the transfer is pending
            except TransferFailed as stuck:  # one may still be: the blocks must never be reused
                log.error(
                    "KV receive of a lease failed (%s), and %s: its blocks stay reserved", failure, stuck
                )
                self.lease = None
            self.sink = None
        if self.lease is not None:  # free only now: this thread has made its last write
            self.core.table.fail_claimed(self.lease.handle, failure)
            self.lease = None
        if failure.reason in PEER_CAUSED:
            return
        grace = min(1.0, self.core.config.connect_timeout_s)
        notice = Watch(time.monotonic() + grace, FailureReason.DEADLINE_EXCEEDED, "failure notice")
        if failure.reason in OUR_ABORTS:
            sent = self.conn.send_abort(failure, notice)
        else:
            try:
                self.conn.send_frame(error_frame(failure.reason, failure.message), notice)
                sent = True
            except TransferFailed:
                sent = False
        if sent:  # let the frame reach the sender before the socket goes: drain what it still sends
            self.conn.close(grace_s=grace)
