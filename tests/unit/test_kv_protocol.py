"""kv_transfer protocol pieces in isolation: frames, pairing checks, the lease table's ownership rules, config
validation, argument checks and the cuda_ipc copy geometry. No threads beyond a socketpair; milliseconds."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from kv_transfer import FailureReason, FirstToken, KVSender, NoRoom, TransferConfig, TransferFailed
from kv_transfer.cuda_events import CopyClock, wait_event
from kv_transfer.cuda_ipc import block_runs, byte_strides
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
    frame_failure,
)
from kv_transfer.leases import LeaseTable
from kv_transfer.pairing import check_format, check_hello, format_message, make_hello
from kv_transfer.send_handle import SendHandle
from model_runtime.config import ConfigError
from model_runtime.kv_layout import KVLayout
from tandem_api.tandem.v1 import kv_pb2

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=16, dtype="float32")


class FreeList:
    def __init__(self, num_blocks: int) -> None:
        self.free_ids = list(range(1, num_blocks))
        self.lock = threading.Lock()

    def allocate(self, n: int) -> list[int] | None:
        with self.lock:
            if len(self.free_ids) < n:
                return None
            out, self.free_ids = self.free_ids[:n], self.free_ids[n:]
            return out

    def free(self, ids) -> None:
        with self.lock:
            assert not set(ids) & set(self.free_ids), "double free"
            self.free_ids.extend(ids)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_table(num_blocks: int = 16):
    alloc, clock, failed = FreeList(num_blocks), Clock(), []
    table = LeaseTable(
        LAYOUT, alloc, lambda lease, failure, _: failed.append((lease, failure.reason)), clock=clock
    )
    return table, alloc, clock, failed


def reason_of(fn) -> FailureReason:
    with pytest.raises(TransferFailed) as info:
        fn()
    return info.value.reason


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


# --- pairing ---------------------------------------------------------------------------------------------
def test_layout_mismatch_names_the_differing_field():
    other = KVLayout(num_layers=4, num_kv_heads=4, head_dim=8, block_size=4, num_blocks=99, dtype="float32")
    with pytest.raises(TransferFailed) as info:
        check_format(LAYOUT, format_message(other), other.fingerprint())
    assert info.value.reason is FailureReason.LAYOUT_MISMATCH
    assert "num_kv_heads: ours=2 theirs=4" in info.value.message
    assert "num_blocks" not in info.value.message  # cache sizes may differ between the two sides


def test_fingerprint_disagreement_with_equal_fields_is_refused():
    with pytest.raises(TransferFailed, match="fingerprints differ"):
        check_format(LAYOUT, format_message(LAYOUT), "0" * 32)


def test_hello_checks_transport_and_refuses_nccl_on_one_gpu():
    hello = make_hello(LAYOUT, b"i" * 16, "tcp", "").hello
    check_hello(LAYOUT, ("tcp",), "", hello)
    assert reason_of(lambda: check_hello(LAYOUT, ("nccl",), "", hello)) is FailureReason.TRANSPORT_MISMATCH
    gpu_hello = make_hello(LAYOUT, b"i" * 16, "nccl", "GPU-1").hello
    with pytest.raises(TransferFailed, match="two different GPUs"):
        check_hello(LAYOUT, ("nccl",), "GPU-1", gpu_hello)
    check_hello(LAYOUT, ("nccl",), "GPU-2", gpu_hello)


def test_a_side_holding_several_transports_takes_the_one_the_hello_names():
    ipc_hello = make_hello(LAYOUT, b"i" * 16, "cuda_ipc", "GPU-1").hello
    assert check_hello(LAYOUT, ("nccl", "cuda_ipc", "tcp"), "GPU-1", ipc_hello) == "cuda_ipc"
    nccl_hello = make_hello(LAYOUT, b"i" * 16, "nccl", "GPU-1").hello
    assert check_hello(LAYOUT, ("cuda_ipc", "nccl"), "GPU-2", nccl_hello) == "nccl"
    with pytest.raises(TransferFailed, match="ours=nccl,tcp theirs=cuda_ipc"):
        check_hello(LAYOUT, ("nccl", "tcp"), "GPU-2", ipc_hello)


# --- lease table -----------------------------------------------------------------------------------------
def test_forged_handle_is_unknown_and_touches_nothing():
    table, alloc, _, failed = make_table()
    lease = table.reserve("r1", 9, ttl_s=10)
    assert reason_of(lambda: table.claim(b"\x00" * 16, "r1")) is FailureReason.UNKNOWN_HANDLE
    assert table.claim(lease.handle, "r1") == lease  # the real lease is unaffected
    assert failed == [] and len(alloc.free_ids) == 15 - 3


def test_handle_is_bound_to_its_request_and_single_use():
    table, alloc, _, _ = make_table()
    lease = table.reserve("r1", 4, ttl_s=10)
    assert reason_of(lambda: table.claim(lease.handle, "r2")) is FailureReason.HANDLE_MISMATCH
    table.claim(lease.handle, "r1")
    assert reason_of(lambda: table.claim(lease.handle, "r1")) is FailureReason.HANDLE_BUSY
    assert table.land(lease.handle) == lease
    assert reason_of(lambda: table.claim(lease.handle, "r1")) is FailureReason.HANDLE_REUSED
    assert len(alloc.free_ids) == 14  # landed blocks belong to the caller: never freed by the table


def test_expired_handle_fails_and_frees_once():
    table, alloc, clock, failed = make_table()
    lease = table.reserve("r1", 4, ttl_s=1.0)
    clock.now += 1.5
    assert reason_of(lambda: table.claim(lease.handle, "r1")) is FailureReason.LEASE_EXPIRED
    assert failed == [(lease, FailureReason.LEASE_EXPIRED)] and len(alloc.free_ids) == 15
    assert reason_of(lambda: table.claim(lease.handle, "r1")) is FailureReason.LEASE_EXPIRED


def test_a_renewed_lease_outlives_its_first_term_until_a_sender_claims_it():
    table, _, clock, failed = make_table()
    lease = table.reserve("r1", 4, ttl_s=1.0)
    for _ in range(5):  # the holder keeps waiting well past the first TTL
        clock.now += 0.8
        assert table.renew("r1")
        table.expire()
    assert failed == [] and len(table) == 1
    claimed = table.claim(lease.handle, "r1")
    assert claimed.expires_at == pytest.approx(clock.now + 1.0)
    assert not table.renew("r1"), "a claimed lease is no longer renewed: a stalled transfer must end"
    clock.now += 1.5
    table.expire()
    assert table.cancellation(lease.handle).reason is FailureReason.LEASE_EXPIRED


def test_an_expired_or_cancelled_lease_is_not_brought_back_by_renew():
    table, alloc, clock, failed = make_table()
    table.reserve("late", 4, ttl_s=1.0)
    clock.now += 1.5
    assert not table.renew("late")  # past its term, even before the reaper ran
    table.expire()
    assert [reason for _, reason in failed] == [FailureReason.LEASE_EXPIRED] and len(alloc.free_ids) == 15
    table.reserve("gone", 4, ttl_s=1.0)
    table.cancel("gone", TransferFailed(FailureReason.RECEIVER_ABORTED, "cancelled"))
    assert not table.renew("gone") and not table.renew("never-reserved")


def test_reaper_frees_unclaimed_leases_but_only_flags_claimed_ones():
    table, alloc, clock, failed = make_table()
    idle = table.reserve("idle", 4, ttl_s=1.0)
    busy = table.reserve("busy", 8, ttl_s=1.0)
    table.claim(busy.handle, "busy")
    clock.now += 2.0
    table.expire()
    assert failed == [(idle, FailureReason.LEASE_EXPIRED)]
    assert set(busy.block_ids).isdisjoint(alloc.free_ids)  # its receiving thread may still write: not freed
    assert table.cancellation(busy.handle).reason is FailureReason.LEASE_EXPIRED
    assert reason_of(lambda: table.land(busy.handle)) is FailureReason.LEASE_EXPIRED
    table.fail_claimed(busy.handle, TransferFailed(FailureReason.LEASE_EXPIRED, "expired"))
    assert len(alloc.free_ids) == 15 and len(table) == 0


def test_receiver_abort_is_reported_to_a_late_sender():
    table, _, _, failed = make_table()
    lease = table.reserve("r1", 4, ttl_s=10)
    assert table.cancel("r1", TransferFailed(FailureReason.RECEIVER_ABORTED, "cancelled"))
    assert failed == [(lease, FailureReason.RECEIVER_ABORTED)]
    assert reason_of(lambda: table.claim(lease.handle, "r1")) is FailureReason.RECEIVER_ABORTED
    assert not table.cancel("r1", TransferFailed(FailureReason.RECEIVER_ABORTED, "again"))


def test_reserve_no_room_duplicates_and_bad_allocations():
    table, _, _, _ = make_table(num_blocks=4)
    table.reserve("r1", 8, ttl_s=10)
    with pytest.raises(NoRoom):
        table.reserve("r2", 8, ttl_s=10)
    with pytest.raises(ValueError, match="already holds a lease"):
        table.reserve("r1", 1, ttl_s=10)
    with pytest.raises(ValueError, match="num_tokens"):
        table.reserve("r3", 0, ttl_s=10)

    class Broken(FreeList):
        def allocate(self, n):
            return [0] * n  # the null block: must never be handed to a peer

    broken = Broken(16)
    bad = LeaseTable(LAYOUT, broken, lambda *a: None)
    with pytest.raises(RuntimeError, match="allocator"):
        bad.reserve("r1", 4, ttl_s=10)


def test_a_reservation_may_bring_its_own_allocate_whose_errors_make_no_lease():
    """The decode worker checks the request and takes its blocks in one call onto its engine thread."""
    table, alloc, _, _ = make_table(num_blocks=8)
    asked = []

    def own(n: int) -> list[int] | None:
        asked.append(n)
        return alloc.allocate(n)

    lease = table.reserve("r1", 5, ttl_s=10, allocate=own)
    assert asked == [2] and len(lease.block_ids) == 2 and len(alloc.free_ids) == 5

    def rejects(n: int) -> list[int] | None:
        raise ValueError("prompt_token_ids: 99 is outside the vocabulary [0, 50)")

    with pytest.raises(ValueError, match="outside the vocabulary"):
        table.reserve("r2", 4, ttl_s=10, allocate=rejects)
    with pytest.raises(NoRoom):
        table.reserve("r3", 4, ttl_s=10, allocate=lambda n: None)
    assert len(table) == 1 and len(alloc.free_ids) == 5
    assert table.cancel("r1", TransferFailed(FailureReason.RECEIVER_ABORTED, "done"))  # through free()
    assert len(alloc.free_ids) == 7


# --- config and arguments --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("kind", "rdma"),
        ("port", 70000),
        ("lease_ttl_s", 0),
        ("connect_timeout_s", float("nan")),
        ("poll_interval_s", 5.0),
        ("chunk_bytes", 1),
        ("max_connections", 0),
    ],
)
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ConfigError, match=rf"transfer\.{field}"):
        TransferConfig(**{field: value})


def test_config_wildcard_host_needs_an_advertised_address():
    with pytest.raises(ConfigError, match=r"transfer\.advertise_host"):
        TransferConfig(host="0.0.0.0")
    assert TransferConfig(host="0.0.0.0", advertise_host="10.0.0.5").public_host == "10.0.0.5"


def test_send_range_and_count_checks_keep_ownership_with_the_caller():
    cache = torch.zeros(LAYOUT.cache_shape)
    released = []
    with KVSender(LAYOUT, cache, on_release=released.append) as sender:
        target = kv_pb2.KVTarget()
        with pytest.raises(ValueError, match=r"out of range \[1, 16\)"):
            sender.send(target, [3, 16], 8, FirstToken(1))
        with pytest.raises(ValueError, match=r"out of range \[1, 16\)"):
            sender.send(target, [0], 4, FirstToken(1))
        with pytest.raises(ValueError, match="fill 2 blocks"):
            sender.send(target, [3], 8, FirstToken(1))
        with pytest.raises(ValueError, match="duplicates"):
            sender.send(target, [3, 3], 8, FirstToken(1))
    assert released == []  # nothing was taken over


def test_layer_groups_must_tile_the_layers():
    handle = SendHandle(kv_pb2.KVTarget(request_id="r"), (1,), 4, num_layers=4, timeout_s=10)
    handle.send_layers(0, 2)
    with pytest.raises(ValueError, match="overlaps"):
        handle.send_layers(1, 3)
    with pytest.raises(ValueError, match="non-empty range"):
        handle.send_layers(3, 5)
    with pytest.raises(ValueError, match="never queued"):
        handle.finish(FirstToken(1))
    handle.send_layers(2, 4)
    handle.finish(FirstToken(1))
    with pytest.raises(ValueError, match="after finish"):
        handle.send_layers(0, 1)


# --- cuda_ipc geometry (pure arithmetic, checked against torch indexing) ---------------------------------
def test_block_runs_coalesce_only_joint_steps():
    assert block_runs((4, 5, 6, 9), (1, 2, 3, 4)) == [(4, 1, 3), (9, 4, 1)]
    assert block_runs((4, 5), (2, 1)) == [(4, 2, 1), (5, 1, 1)]


def test_byte_strides_match_the_block_addresses_torch_uses():
    cache = torch.arange(LAYOUT.total_bytes // 4, dtype=torch.float32).reshape(LAYOUT.cache_shape)
    strides = byte_strides(LAYOUT)
    assert strides[0] == 2 * strides[1]  # the 2-D copy walks (layer, K|V) planes with one pitch
    for layer, kv, block in [(0, 0, 1), (2, 1, 7), (3, 1, 15)]:
        offset = (layer * strides[0] + kv * strides[1] + block * strides[2]) // 4
        assert cache[layer, kv, block].flatten()[0].item() == offset
        assert strides[2] == cache[layer, kv, block].numel() * 4


def test_a_drained_refusal_says_so_and_a_plain_one_does_not():
    drained = frame_failure(
        error_frame(FailureReason.UNKNOWN_HANDLE, "forged", drained=True), FailureReason.INTERNAL
    )
    plain = frame_failure(error_frame(FailureReason.UNKNOWN_HANDLE, "forged"), FailureReason.INTERNAL)
    assert drained is not None and drained.drained and drained.reason is FailureReason.UNKNOWN_HANDLE
    assert plain is not None and not plain.drained
