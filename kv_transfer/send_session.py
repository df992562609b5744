"""One transfer on the sender, run on a transfer thread from taking a channel to the receiver's ack.

    channel (reused, or: connect -> KVHello both ways -> [pair setup])
    -> KVBegin -> for each layer group the caller queues: KVPart + transport data -> KVDone  (no reply awaited)
    -> KVAck

Frames that are ready together go out together: KVBegin is deferred to the first part's write, and a
transport may defer its part frames (cuda_ipc does) to the next write; whatever is deferred goes out before
the session waits for the caller's next layer group.

It never raises: every outcome becomes a SendResult, with the time spent in each phase. A local stop (abort,
deadline, shutdown) is announced to the receiver with KVAbort when the stream allows; whatever the receiver says
while we stream (KVError, KVAbort) ends the transfer with the receiver's reason.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kv_transfer.channels import Channel, ChannelPool
from kv_transfer.config import TransferConfig
from kv_transfer.contracts import FailureReason, FirstToken, SendResult, TransferFailed
from kv_transfer.frames import FrameConnection, Watch, expect, frame_failure
from kv_transfer.pairing import check_target
from kv_transfer.send_handle import DoneRequest, PartRequest, SendHandle
from kv_transfer.transport import PartJob, PartSource, SenderTransport, window_layout
from model_runtime.kv_layout import KVLayout
from tandem_api.tandem.v1 import kv_pb2

log = logging.getLogger(__name__)

LOCAL_STOPS = (FailureReason.SENDER_ABORTED, FailureReason.DEADLINE_EXCEEDED, FailureReason.SHUTDOWN)


@dataclass(frozen=True)
class SenderCore:
    """What every transfer of one KVSender shares."""

    layout: KVLayout
    config: TransferConfig
    transports: Mapping[str, SenderTransport]  # the ones held, by kind
    channels: ChannelPool
    shutdown: Callable[[], TransferFailed | None]
    chunk_hook: Callable[[str, int], None] | None


class SendSession:
    def __init__(self, core: SenderCore, handle: SendHandle) -> None:
        self.core = core
        self.handle = handle
        self.channel: Channel | None = None
        self.source: PartSource | None = None
        self.armed: tuple[int, int] | None = None  # (slot, generation) of the receiver's doorbell we ring
        self.phases: dict[str, float] = {}
        self._mark = handle.started_at
        heads = handle.heads
        self.source_heads = None if heads is None else (heads.source_begin, heads.count)
        # What moves: our whole cache, or a window of its heads (and then only those heads' bytes).
        self.layout = window_layout(core.layout, self.source_heads)
        if self.source_heads == (0, core.layout.num_kv_heads):
            self.source_heads = None
        self.watch = Watch(
            handle.deadline,
            FailureReason.DEADLINE_EXCEEDED,
            f"send of {handle.request_id!r}",
            cancelled=lambda: handle.cancellation() or core.shutdown(),
        )

    def run(self) -> SendResult:
        self._phase("queue")
        in_step = False  # the receiver acked, or refused and drained: the channel and the pair stay usable
        try:
            self._run()
            in_step = True
            num_bytes = self.layout.bytes_per_block * len(self.handle.src_block_ids)
            return self._result(True, None, "", num_bytes)
        except TransferFailed as failure:
            failure = self._explain(failure)
            in_step = failure.drained
            return self._result(False, failure.reason, failure.message)
        except Exception as exc:  # a bug: fail this transfer, keep the sender alive, say what happened
            log.exception("KV send of %r failed", self.handle.request_id)
            return self._result(False, FailureReason.INTERNAL, f"{type(exc).__name__}: {exc}")
        finally:
            in_step = self._settle(in_step)
            if self.channel is not None:
                self.core.channels.release(self.channel, reusable=in_step)

    def _settle(self, in_step: bool) -> bool:
        """No read of our blocks may be pending once they are released: after an ack or a drained refusal the
        sends completed (wait for them), after anything else the source aborts what is in flight."""
        if self.source is None:
            return in_step
        if in_step:
            try:
                self.source.finish(Watch(time.monotonic() + 5.0, FailureReason.DEADLINE_EXCEEDED, "sends"))
                return True
            except TransferFailed:
                pass
        self.source.abandon()
        return False

    def _run(self) -> None:
        target = self.handle.target
        kind = check_target(self.core.layout, tuple(self.core.transports), target)
        heads = self.handle.heads
        if (
            kind == "cuda_ipc"
            and heads is not None
            and (self.source_heads is not None or heads.count != target.format.num_kv_heads)
        ):
            raise TransferFailed(
                FailureReason.TRANSPORT_MISMATCH,
                "cuda_ipc moves whole caches, not a window of their heads (tensor-parallel workers of "
                "different sizes): use nccl or tcp",
            )
        n = len(self.handle.src_block_ids)
        if target.num_tokens != self.handle.num_tokens or target.num_blocks != n:
            raise TransferFailed(
                FailureReason.DESCRIPTOR_MISMATCH,
                f"target wants {target.num_tokens} tokens in {target.num_blocks} blocks, "
                f"send has {self.handle.num_tokens} tokens in {n} blocks",
            )
        self.watch.check()
        self.channel = self.core.channels.acquire(target, kind, self.watch, self.handle.started_at)
        self._phase("connect" if self.channel.transfers == 0 else "channel")
        conn = self.channel.conn
        begin = self._begin(kind)
        if kind == "cuda_ipc" and self.handle.armed is not None:  # the caller's thread rings the doorbell
            self.armed = self.handle.armed
            begin.armed_generation = self.armed[1]
        conn.defer_frame(kv_pb2.KVFrame(begin=begin))  # goes out with the first part's frame
        self.source = self.core.transports[kind].source(self.channel.peer_id)
        finished_at = self._stream(conn, self.channel.peer_id, self.source)
        expect(conn.read_frame(self.watch), "ack", FailureReason.RECEIVER_ABORTED)
        self._phase("ack")
        self.phases["tail"] = time.monotonic() - finished_at

    def _begin(self, kind: str) -> kv_pb2.KVBegin:
        _core, handle = self.core, self.handle
        begin = kv_pb2.KVBegin(
            handle=handle.target.handle,
            request_id=handle.target.request_id,
            num_blocks=len(handle.src_block_ids),
            num_tokens=handle.num_tokens,
            num_bytes=self.layout.bytes_per_block * len(handle.src_block_ids),
        )
        if handle.heads is not None:
            begin.head_begin, begin.num_heads = handle.heads.target_begin, handle.heads.count
        if kind == "cuda_ipc":
            begin.src_block_ids.extend(handle.src_block_ids)
        return begin

    def _stream(self, conn: FrameConnection, peer_id: bytes, source: PartSource) -> float:
        """Ship the caller's parts, then KVDone; returns when the caller called finish() (time.monotonic())."""
        core, handle = self.core, self.handle
        progress = None
        if core.chunk_hook is not None:
            hook, request_id = core.chunk_hook, handle.request_id
            progress = lambda sent: hook(request_id, sent)  # noqa: E731
        while True:
            item = self._next_item(conn)
            if isinstance(item, PartRequest):
                num_bytes = self.layout.bytes_per_block_layer * len(handle.src_block_ids) * item.num_layers
                source.part(
                    PartJob(
                        conn=conn,
                        watch=self.watch,
                        peer_id=peer_id,
                        request_id=handle.request_id,
                        block_ids=handle.src_block_ids,
                        layer_begin=item.layer_begin,
                        layer_end=item.layer_end,
                        num_bytes=num_bytes,
                        ready=item.ready,
                        progress=progress,
                        heads=self.source_heads,
                        armed=self.armed,
                    )
                )
                self._phase("stream")
                continue
            conn.send_frame(
                kv_pb2.KVFrame(done=kv_pb2.KVDone(first_token=token_message(item.first_token))), self.watch
            )
            self._phase("stream")
            return item.queued_at

    def _next_item(self, conn: FrameConnection) -> PartRequest | DoneRequest:
        """The caller's next layer group (or the end), while watching our deadline and the receiver."""
        item = self.handle.next_request(0.0)
        if item is None:
            conn.flush(self.watch)  # nothing else to add: deferred frames go out before we wait
            while True:
                item = self.handle.next_request(self.core.config.poll_interval_s)
                if item is not None:
                    break
                self.watch.check()
                if conn.frame_waiting():
                    frame = conn.read_frame(self.watch)
                    raise frame_failure(frame, FailureReason.RECEIVER_ABORTED) or TransferFailed(
                        FailureReason.PROTOCOL_ERROR, f"unexpected {frame.WhichOneof('body')} frame"
                    )
        self._phase("layers")
        return item

    def _phase(self, name: str) -> None:
        now = time.monotonic()
        self.phases[name] = self.phases.get(name, 0.0) + now - self._mark
        self._mark = now

    # --- outcome ---------------------------------------------------------------------------------------
    def _explain(self, failure: TransferFailed) -> TransferFailed:
        """Tell the receiver why we stop, or find out why it stopped us."""
        if self.channel is None:
            return failure
        conn = self.channel.conn
        notice = Watch(
            time.monotonic() + min(1.0, self.core.config.connect_timeout_s),
            FailureReason.DEADLINE_EXCEEDED,
            "abort notice",
        )
        if failure.reason in LOCAL_STOPS:
            conn.send_abort(failure, notice)
        elif failure.reason is FailureReason.CONNECTION_LOST and conn.frame_waiting():
            try:  # the receiver may have said why before it closed
                return frame_failure(conn.read_frame(notice), failure.reason) or failure
            except TransferFailed:
                pass
        return failure

    def _result(self, ok: bool, reason: FailureReason | None, message: str, num_bytes: int = 0) -> SendResult:
        return SendResult(
            self.handle.request_id,
            self.handle.src_block_ids,
            ok,
            reason,
            message,
            num_bytes,
            time.monotonic() - self.handle.started_at,
            dict(self.phases),
        )


def token_message(token: FirstToken) -> kv_pb2.KVFirstToken:
    message = kv_pb2.KVFirstToken(token_id=token.token_id)
    if token.logprob is not None:
        message.logprob = token.logprob
    for token_id, logprob in token.top_logprobs:
        message.top_logprobs.add(token_id=token_id, logprob=logprob)
    return message
