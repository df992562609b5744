"""kv_transfer protocol pieces in isolation: pairing checks, the lease table's ownership rules, config validation,
argument checks and the cuda_ipc copy geometry (frames and the connection: test_kv_wire.py). Milliseconds."""

from __future__ import annotations

import threading

import pytest
import torch

from kv_transfer import FailureReason, FirstToken, KVSender, NoRoom, TransferConfig, TransferFailed
from kv_transfer.cuda_ipc import block_runs, byte_strides
from kv_transfer.frames import error_frame, frame_failure
from kv_transfer.leases import LeaseTable
from kv_transfer.pairing import check_format, check_hello, format_message, make_hello
from kv_transfer.send_handle import SendHandle
from model_runtime.config import ConfigError
from model_runtime.kv_layout import KVLayout
from tandem_api.tandem.v1 import kv_pb2
from tests.fake_clock import ManualClock
from tests.kv_failures import reason_of

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


def make_table(num_blocks: int = 16):
    alloc, clock, failed = FreeList(num_blocks), ManualClock(), []
    table = LeaseTable(
        LAYOUT, alloc, lambda lease, failure, _: failed.append((lease, failure.reason)), clock=clock
    )
    return table, alloc, clock, failed


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


def test_before_free_runs_before_a_failed_lease_s_blocks_return_and_can_keep_them():
    alloc, clock, asked = FreeList(16), ManualClock(), []

    def before_free(lease) -> bool:  # a receiver ending an armed chain: False when it did not end
        asked.append((lease.request_id, len(alloc.free_ids)))
        return lease.request_id != "stuck"

    table = LeaseTable(LAYOUT, alloc, lambda *a: None, clock=clock, before_free=before_free)
    ok = table.reserve("ok", 8, ttl_s=5)
    stuck = table.reserve("stuck", 8, ttl_s=5)
    held = len(alloc.free_ids)
    table.cancel("ok", TransferFailed(FailureReason.RECEIVER_ABORTED, "x"))
    assert asked == [("ok", held)] and len(alloc.free_ids) == held + len(
        ok.block_ids
    )  # asked first, then freed
    clock.now += 6
    table.expire()
    assert asked[-1][0] == "stuck" and not set(stuck.block_ids) & set(alloc.free_ids)  # kept out for good
    assert not table.active(stuck.handle)


def test_an_armed_handle_rings_each_group_s_end_and_a_failed_ring_aborts_instead_of_raising():
    rung: list[tuple[int, object]] = []
    handle = SendHandle(kv_pb2.KVTarget(request_id="r"), (1,), 4, num_layers=4, timeout_s=10)
    handle.arm((3, 7), lambda end, ready: rung.append((end, ready)))
    handle.send_layers(0, 1, "event-a")
    handle.send_layers(1, 4)
    assert rung == [(1, "event-a"), (4, None)] and handle.cancellation() is None

    def broken(end: int, ready: object) -> None:
        raise RuntimeError("cuStreamWriteValue32: CUDA_ERROR_ILLEGAL_ADDRESS")

    handle = SendHandle(kv_pb2.KVTarget(request_id="r"), (1,), 4, num_layers=4, timeout_s=10)
    handle.arm((3, 7), broken)
    handle.send_layers(0, 4)  # the caller (a prefill step) never sees it
    failure = handle.cancellation()
    assert failure is not None and failure.reason is FailureReason.SENDER_ABORTED
    assert "CUDA_ERROR_ILLEGAL_ADDRESS" in failure.message


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
