"""The KV handoff between tensor-parallel workers of different sizes, over tcp on 127.0.0.1 (issue 18).

One process plays every rank: each prefill rank is a KVSender over the heads its cache holds, each decode rank a
KVReceiver over its own; decode rank 0 allocates the blocks and the other ranks hold leases over the same ids
(as deploy.rank_agents does between processes). Every prefill rank sends the pieces kv_transfer.sharded plans
for it. The reference is one whole-model cache: after the handoff each decode rank's blocks must hold exactly
its heads of the prompt's blocks, bit for bit, and nothing else may change.
"""

from __future__ import annotations

import secrets
import time

import pytest
import torch

from kv_transfer import FailureReason, HeadWindow, KVReceiver, KVSender
from kv_transfer.shard_plan import handoff_plan
from kv_transfer.sharded import pieces
from model_runtime.kv_layout import KVLayout, KVShard
from model_runtime.parallel.shard import kv_head_range
from tandem_api.tandem.v1 import kv_pb2
from tests.e2e.kv_tcp_peer import FIRST, NUM_BLOCKS, ShuffledFreeList, config, wait_results

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


class Borrowed:
    """A decode rank > 0 allocates nothing: its leases name rank 0's blocks, which rank 0 frees."""

    def __init__(self) -> None:
        self.freed: list[tuple[int, ...]] = []

    def allocate(self, n: int) -> list[int] | None:
        raise AssertionError("a follower rank never allocates")

    def free(self, ids) -> None:
        self.freed.append(tuple(ids))


def rank_layout(model_heads: int, size: int, rank: int, dtype: str = "float32") -> KVLayout:
    heads = kv_head_range(model_heads, size, rank)
    shard = KVShard(size, rank, heads.start, model_heads) if size > 1 else None
    return KVLayout(4, len(heads), 8, 4, NUM_BLOCKS, dtype, shard)


def model_cache(model_heads: int, dtype: str = "float32") -> torch.Tensor:
    gen = torch.Generator().manual_seed(model_heads)
    shape = KVLayout(4, model_heads, 8, 4, NUM_BLOCKS, dtype).cache_shape
    return torch.randn(shape, generator=gen).to(getattr(torch, dtype))


class DecodeRanks:
    """Decode ranks 0..size-1 with their receivers; rank 0 allocates, the others lease the same ids."""

    def __init__(self, model_heads: int, size: int, dtype: str = "float32") -> None:
        self.layouts = [rank_layout(model_heads, size, r, dtype) for r in range(size)]
        self.caches = [torch.zeros(lay.cache_shape, dtype=getattr(torch, dtype)) for lay in self.layouts]
        self.pool = ShuffledFreeList(NUM_BLOCKS, seed=size)
        self.borrowed = [Borrowed() for _ in range(size)]
        allocators = [self.pool, *self.borrowed[1:]]
        self.receivers = [
            KVReceiver(lay, cache, alloc, config())
            for lay, cache, alloc in zip(self.layouts, self.caches, allocators)
        ]

    def reserve(self, request_id: str, num_tokens: int) -> kv_pb2.KVTarget:
        lease = self.receivers[0].reserve(request_id, num_tokens)
        target = self.receivers[0].target(lease)
        for receiver in self.receivers[1:]:
            ids = list(lease.block_ids)
            other = receiver.reserve(request_id, num_tokens, allocate=lambda n, ids=ids: ids,
                                     handle=secrets.token_bytes(16))  # fmt: skip
            rank = receiver.target(other)
            target.rank_targets.add(
                port=rank.port, handle=rank.handle, receiver_id=rank.receiver_id,
                layout_fingerprint=rank.layout_fingerprint, format=rank.format,
            )  # fmt: skip
        self.block_ids = lease.block_ids
        return target

    def close(self) -> None:
        for receiver in self.receivers:
            receiver.close()


class PrefillRanks:
    def __init__(self, model: torch.Tensor, model_heads: int, size: int, dtype: str = "float32") -> None:
        self.layouts = [rank_layout(model_heads, size, r, dtype) for r in range(size)]
        heads = [kv_head_range(model_heads, size, r) for r in range(size)]
        self.caches = [model[:, :, :, :, h.start : h.stop].contiguous() for h in heads]
        self.released: list[tuple[int, ...]] = []
        self.senders = [
            KVSender(lay, cache, config(), on_release=lambda r: self.released.append(r.src_block_ids))
            for lay, cache in zip(self.layouts, self.caches)
        ]

    def send(self, target: kv_pb2.KVTarget, src_ids, num_tokens: int) -> list:
        handles = []
        for sender in self.senders:
            for rank_target, window in pieces(target, sender.layout):
                handles.append(sender.send(rank_target, src_ids, num_tokens, FIRST, heads=window))
        return [h.result(timeout=20) for h in handles]

    def close(self) -> None:
        for sender in self.senders:
            sender.close()


@pytest.mark.parametrize(
    ("model_heads", "prefill_tp", "decode_tp"),
    [(4, 2, 1), (4, 1, 2), (4, 2, 4), (4, 4, 2), (2, 4, 1), (2, 1, 4), (4, 2, 2)],
)
def test_every_decode_rank_gets_exactly_its_heads(model_heads, prefill_tp, decode_tp):
    num_tokens = 13  # 4 blocks, the last one partly filled
    model = model_cache(model_heads)
    decode = DecodeRanks(model_heads, decode_tp)
    prefill = PrefillRanks(model, model_heads, prefill_tp)
    try:
        target = decode.reserve("req-1", num_tokens)
        src_ids = [5, 9, 2, 30]
        results = prefill.send(target, src_ids, num_tokens)
        landed = [wait_results(r) for r in decode.receivers]
    finally:
        prefill.close()
        decode.close()
    assert all(r.ok for r in results), results
    assert len(results) == len(handoff_plan(prefill_tp, decode_tp, model_heads))
    assert sorted(prefill.released) == sorted([tuple(src_ids)] * len(results))
    others = [b for b in range(1, NUM_BLOCKS) if b not in decode.block_ids]
    for rank, ((result,), cache) in enumerate(zip(landed, decode.caches)):
        heads = kv_head_range(model_heads, decode_tp, rank)
        assert result.ok and result.first_token == FIRST and result.lease.block_ids == decode.block_ids
        assert result.num_bytes == decode.layouts[rank].bytes_per_block * len(src_ids)
        want = model[:, :, src_ids][:, :, :, :, heads.start : heads.stop]
        assert torch.equal(cache[:, :, list(decode.block_ids)], want), f"decode rank {rank}"
        assert not cache[:, :, others].any()  # nothing outside the lease was written
    assert len(decode.pool.free_ids) == decode.pool.total - len(decode.block_ids)  # landed: the caller's
    assert all(not b.freed for b in decode.borrowed)


def test_a_failed_piece_fails_the_lease_once_after_every_writer_stopped():
    """decode TP=1 <- prefill TP=2: one rank's piece arrives, the other's sender aborts; the lease fails,
    its blocks go back once (half landed or not), and the piece that landed is not reported as a landing."""
    model = model_cache(4)
    decode = DecodeRanks(4, 1)
    prefill = PrefillRanks(model, 4, 2)
    try:
        target = decode.reserve("req-2", 9)
        (piece0,) = pieces(target, prefill.layouts[0])
        (piece1,) = pieces(target, prefill.layouts[1])
        ok = prefill.senders[0].send(piece0[0], [3, 4, 6], 9, FIRST, heads=piece0[1]).result(timeout=20)
        assert ok.ok
        assert decode.receivers[0].poll() == []  # half the heads: no landing yet
        handle = prefill.senders[1].open(piece1[0], [3, 4, 6], 9, heads=piece1[1])
        handle.abort("the prefill rank gave up")
        failed = handle.result(timeout=20)
        # Aborted before it claimed, the piece left the lease half landed: the decode side gives up on it (as
        # the decode call does when the router cancels it). Aborted after, the lease failed already.
        decode.receivers[0].abort("req-2", "the prefill side failed")
        (result,) = wait_results(decode.receivers[0])
    finally:
        prefill.close()
        decode.close()
    assert not failed.ok and failed.failure is FailureReason.SENDER_ABORTED
    assert not result.ok
    assert decode.pool.all_free  # freed exactly once (the pool refuses a double free)


def test_overlapping_windows_and_a_second_whole_claim_are_refused():
    model = model_cache(4)
    decode = DecodeRanks(4, 1)
    prefill = PrefillRanks(model, 4, 1)
    try:
        target = decode.reserve("req-3", 5)
        first = prefill.senders[0].send(target, [7, 8], 5, FIRST, heads=HeadWindow(0, 0, 3))
        assert first.result(timeout=20).ok
        again = prefill.senders[0].send(target, [7, 8], 5, FIRST, heads=HeadWindow(2, 2, 2))
        refused = again.result(timeout=20)
        rest = prefill.senders[0].send(target, [7, 8], 5, FIRST, heads=HeadWindow(3, 3, 1))
        assert rest.result(timeout=20).ok
        (result,) = wait_results(decode.receivers[0])
    finally:
        prefill.close()
        decode.close()
    assert not refused.ok and refused.failure is FailureReason.HANDLE_BUSY, refused
    assert result.ok  # heads 0-2 and 3 cover the lease; the overlapping claim wrote nothing
    assert torch.equal(decode.caches[0][:, :, list(decode.block_ids)], model[:, :, [7, 8]])


def test_a_window_of_an_fp8_cache_is_refused_naming_the_dtype():
    layout = rank_layout(4, 1, 0, "float8_e4m3fn")
    cache = torch.zeros(layout.cache_shape, dtype=torch.float8_e4m3fn)
    with KVSender(layout, cache, config()) as sender, pytest.raises(ValueError, match="FP8"):
        sender.open(kv_pb2.KVTarget(), [1], 3, heads=HeadWindow(0, 0, 2))


def test_workers_of_different_sizes_pair_but_not_across_models():
    """The format check compares the whole model's layout, not each rank's heads."""
    model = model_cache(4)
    decode = DecodeRanks(2, 1)  # a model with 2 KV heads
    prefill = PrefillRanks(model, 4, 2)  # ... and one with 4
    try:
        target = decode.reserve("req-4", 5)
        with pytest.raises(Exception, match="model KV heads"):
            pieces(target, prefill.layouts[0])
        started = time.monotonic()
        result = prefill.senders[0].send(target, [1, 2], 5, FIRST, heads=HeadWindow(0, 0, 2)).result(20)
    finally:
        prefill.close()
        decode.close()
    assert not result.ok and result.failure is FailureReason.LAYOUT_MISMATCH
    assert "num_kv_heads" in result.message and time.monotonic() - started < 10
