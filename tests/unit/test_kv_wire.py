"""kv_transfer's wire and host path in isolation: frames, the connection's chunks, batching (deferred writes,
read-ahead) and deadlines on a socketpair, the order in which cuda_ipc's sender writes its part frames, and the
waits of a transfer thread (CopyClock's predictions, wait_event's sleeps). No GPU; milliseconds."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from kv_transfer import FailureReason, TransferFailed
from kv_transfer.cuda_events import CopyClock, wait_event
from kv_transfer.frames import (
    MAGIC,
    MAX_FRAME_BYTES,
    FrameConnection,
    Watch,
    decode_frame,
    decode_frame_length,
    encode_frame,
    error_frame,
    expect,
    failure_from_proto,
    failure_to_proto,
)
from tandem_api.tandem.v1 import kv_pb2
from tests.kv_failures import reason_of

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


# --- frames ----------------------------------------------------------------------------------------------
def test_frame_round_trip_preserves_every_field():
    begin = kv_pb2.KVBegin(
        handle=b"h" * 16,
        request_id="r1",
        num_blocks=3,
        num_tokens=9,
        num_bytes=123456,
        src_block_ids=[5, 2, 9],
    )
    data = encode_frame(kv_pb2.KVFrame(begin=begin))
    assert data[:4] == MAGIC
    assert decode_frame_length(data[:8]) == len(data) - 8
    assert decode_frame(data[8:]).begin == begin


def test_frame_header_rejects_bad_magic_and_oversize():
    assert reason_of(lambda: decode_frame_length(b"HTTP\x00\x00\x00\x10")) is FailureReason.PROTOCOL_ERROR
    oversize = MAGIC + (MAX_FRAME_BYTES + 1).to_bytes(4, "big")
    assert reason_of(lambda: decode_frame_length(oversize)) is FailureReason.PROTOCOL_ERROR


def test_frame_payload_garbage_and_empty_body_are_protocol_errors():
    assert reason_of(lambda: decode_frame(b"\xff\xff\xff")) is FailureReason.PROTOCOL_ERROR
    assert reason_of(lambda: decode_frame(b"")) is FailureReason.PROTOCOL_ERROR


def test_failure_enum_mirrors_proto_names_and_values():
    names = kv_pb2.KVFailure.keys()
    proto_names = {n.removeprefix("KV_FAILURE_") for n in names} - {"UNSPECIFIED"}
    assert proto_names == {r.name for r in FailureReason}
    for reason in FailureReason:
        assert failure_to_proto(reason) == reason.value
        assert failure_from_proto(failure_to_proto(reason)) is reason
    assert failure_from_proto(999) is FailureReason.PROTOCOL_ERROR


def test_expect_raises_the_peers_reason():
    frame = error_frame(FailureReason.HANDLE_REUSED, "used")
    assert (
        reason_of(lambda: expect(frame, "ack", FailureReason.PROTOCOL_ERROR)) is FailureReason.HANDLE_REUSED
    )
    hello = kv_pb2.KVFrame(hello=kv_pb2.KVHello())
    assert (
        reason_of(lambda: expect(hello, "ack", FailureReason.PROTOCOL_ERROR)) is FailureReason.PROTOCOL_ERROR
    )


def test_connection_chunks_and_abort_inside_a_part():
    a, b = socket.socketpair()
    left, right = FrameConnection(a, 0.01), FrameConnection(b, 0.01)
    watch = Watch(time.monotonic() + 5, FailureReason.DEADLINE_EXCEEDED, "test")
    left.start_data(10)
    left.send_chunk(memoryview(b"0123"), watch)
    assert left.send_abort(TransferFailed(FailureReason.SENDER_ABORTED, "stop"), watch)
    buf = bytearray(4)
    assert right.read_chunk_length(watch) == 4
    right.recv_into(memoryview(buf), watch)
    assert bytes(buf) == b"0123"
    assert right.read_chunk_length(watch) == 0  # end of data: an abort frame follows
    assert right.read_frame(watch).abort.reason == failure_to_proto(FailureReason.SENDER_ABORTED)
    left.close()
    assert reason_of(lambda: right.read_frame(watch)) is FailureReason.CONNECTION_LOST
    right.close()


def test_deferred_frames_go_out_in_order_with_the_next_write_and_reads_take_them_from_one_buffer():
    a, b = socket.socketpair()
    left, right = FrameConnection(a, 0.01), FrameConnection(b, 0.01)
    watch = Watch(time.monotonic() + 5, FailureReason.DEADLINE_EXCEEDED, "test")
    left.defer_frame(kv_pb2.KVFrame(begin=kv_pb2.KVBegin(request_id="r", num_blocks=2)))
    left.defer_frame(kv_pb2.KVFrame(part=kv_pb2.KVPart(layer_begin=0, layer_end=4)))
    assert not right.frame_waiting()  # deferred: nothing written yet
    left.send_frame(kv_pb2.KVFrame(done=kv_pb2.KVDone(first_token=kv_pb2.KVFirstToken(token_id=7))), watch)
    left.start_data(3)
    left.send_chunk(memoryview(b"xyz"), watch)
    left.flush(watch)  # nothing deferred: a no-op
    assert right.read_frame(watch).begin.request_id == "r"
    # The first read took everything the socket held: the rest is served from the buffer.
    assert right._rend - right._rstart > 0 and right.frame_waiting()
    assert right.read_frame(watch).part.layer_end == 4
    assert right.read_frame(watch).done.first_token.token_id == 7
    assert right.read_chunk_length(watch) == 3
    data = bytearray(3)
    right.recv_into(memoryview(data), watch)
    assert bytes(data) == b"xyz" and not right.frame_waiting()
    left.defer_frame(kv_pb2.KVFrame(ack=kv_pb2.KVAck(num_bytes=5)))
    left.flush(watch)
    assert right.read_frame(watch).ack.num_bytes == 5
    left.close()
    right.close()


def test_a_frame_larger_than_the_read_buffer_arrives_whole():
    a, b = socket.socketpair()
    left, right = FrameConnection(a, 0.01), FrameConnection(b, 0.01)
    watch = Watch(time.monotonic() + 5, FailureReason.DEADLINE_EXCEEDED, "test")
    ids = list(range(1, 40_000))  # about 120 KB of varints: two reads' worth
    sender = threading.Thread(
        target=lambda: [
            left.send_frame(kv_pb2.KVFrame(begin=kv_pb2.KVBegin(src_block_ids=ids)), watch),
            left.send_frame(kv_pb2.KVFrame(ack=kv_pb2.KVAck(num_bytes=1)), watch),
        ]
    )
    sender.start()
    assert list(right.read_frame(watch).begin.src_block_ids) == ids
    assert right.read_frame(watch).ack.num_bytes == 1
    sender.join(5)
    left.close()
    right.close()


class _Pending:
    """A stand-in for a prefill layer group's CUDA event (the transport under test is the code around it): not
    complete until synchronize(), which records what the peer could already read at that moment."""

    def __init__(self, peer: FrameConnection) -> None:
        self.peer, self.done, self.peer_had_data = peer, False, None

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.peer_had_data = self.peer.frame_waiting()
        self.done = True


def test_cuda_ipc_sends_the_frames_it_deferred_before_it_blocks_on_the_next_layer_group():
    """cuda_ipc defers a part's frame to the next write, but never past a wait for the next group's KV: the
    receiver must be able to copy the groups already written while the prompt's later layers compute."""
    from kv_transfer.cuda_ipc import IpcSenderTransport
    from kv_transfer.transport import PartJob

    a, b = socket.socketpair()
    sender, receiver = FrameConnection(a, 0.01), FrameConnection(b, 0.01)
    watch = Watch(time.monotonic() + 5, FailureReason.DEADLINE_EXCEEDED, "test")

    def job(begin: int, end: int, ready) -> PartJob:
        return PartJob(sender, watch, b"peer", "r", (1, 2), begin, end, 10 * (end - begin), ready=ready)

    send_part = IpcSenderTransport.send_part  # uses none of the transport's CUDA state
    send_part(None, job(0, 2, None))  # type: ignore[arg-type]  # ready: deferred
    assert not receiver.frame_waiting()
    second = _Pending(receiver)
    send_part(None, job(2, 3, second))  # type: ignore[arg-type]
    assert second.peer_had_data is True  # the first part went out before the wait
    assert receiver.read_frame(watch).part.layer_end == 2
    assert not receiver.frame_waiting()  # the second is deferred to the next write
    done = _Pending(receiver)
    done.done = True  # already complete: no wait, so nothing is flushed
    send_part(None, job(3, 4, done))  # type: ignore[arg-type]
    assert done.peer_had_data is None and not receiver.frame_waiting()
    sender.flush(watch)
    assert [receiver.read_frame(watch).part.layer_end for _ in range(2)] == [3, 4]
    sender.close()
    receiver.close()


def test_copy_clock_predicts_from_the_fastest_timed_copy_and_queues_copies_behind_each_other():
    clock = CopyClock()
    assert clock.expect(2**30) == 0.0  # nothing learned: no prediction
    clock.learn(2**20, 1e-6)  # below MIN_TIMED_BYTES: launch-bound, not a rate
    assert clock.rate == 0.0
    clock.learn(2**28, 2e-3)
    clock.learn(2**28, 1e-3)  # the fastest rate counts
    clock.learn(2**28, 4e-3)
    assert clock.rate == pytest.approx(2**28 / 1e-3)
    before = time.monotonic()
    first = clock.expect(2**28)
    after = time.monotonic()
    second = clock.expect(2**28)  # queued behind the first on the same stream
    assert before + 1e-3 <= first <= after + 1e-3  # starts now, lasts its bytes at the fastest rate
    assert second == pytest.approx(first + 1e-3)


class _DoneAt:
    """A stand-in for a CUDA event that completes at a given time (wait_event is under test, not CUDA)."""

    def __init__(self, at: float) -> None:
        self.at = at
        self.queries: list[float] = []

    def query(self) -> bool:
        now = time.monotonic()
        self.queries.append(now)
        return now >= self.at


def test_a_wait_with_a_predicted_end_sleeps_until_then_and_ends_soon_after():
    watch = Watch(time.monotonic() + 5, FailureReason.DEADLINE_EXCEEDED, "test")
    end = time.monotonic() + 0.02
    event = _DoneAt(end)
    wait_event(event, watch, None, FailureReason.SENDER_ABORTED, expect_at=end)
    assert time.monotonic() >= end
    early = [t for t in event.queries if t < end - 0.002]
    assert len(early) <= 1  # at most the first look; then it slept until just before the prediction
    event = _DoneAt(time.monotonic() + 0.02)  # no prediction: spins, then polls with growing sleeps meanwhile
    wait_event(event, watch, None, FailureReason.SENDER_ABORTED)
    assert len(event.queries) > 3
    stalled = _DoneAt(time.monotonic() + 60)
    short = Watch(time.monotonic() + 0.05, FailureReason.DEADLINE_EXCEEDED, "test")
    assert (
        reason_of(
            lambda: wait_event(stalled, short, None, FailureReason.SENDER_ABORTED, expect_at=stalled.at)
        )
        is FailureReason.DEADLINE_EXCEEDED
    )  # a prediction far off never outlasts the deadline


def test_blocked_read_ends_at_the_deadline():
    a, b = socket.socketpair()
    conn = FrameConnection(a, 0.01)
    start = time.monotonic()
    watch = Watch(start + 0.1, FailureReason.LEASE_EXPIRED, "test")
    assert reason_of(lambda: conn.read_frame(watch)) is FailureReason.LEASE_EXPIRED
    assert time.monotonic() - start < 1.0
    conn.close()
    b.close()
