"""The rank agents of tensor-parallel workers (worker_host.rank_agents) in one process, over tcp on 127.0.0.1
and a Unix socket in a temporary directory: rank 0's AgentHub, the other ranks' FollowerAgents, and rank 0's
ShardedReceiver / ShardedSender, without Ray or an engine. What `tandem serve` relies on: a request lands only
when every rank has its heads; a rank that fails or goes away fails the request; the blocks go back to rank
0's pool exactly once, after every rank stopped; a prefill rank sends only after the step that computed it.
"""

from __future__ import annotations

import queue
import time

import pytest
import torch

from kv_transfer import FailureReason, SendResult, TransferResult
from model_runtime.parallel.shard import kv_head_range
from tests.e2e.kv_tcp_peer import FIRST, NUM_BLOCKS, ShuffledFreeList, config
from tests.e2e.test_kv_sharded_handoff import model_cache, rank_layout
from worker_host.rank_agents import AgentHub, FollowerAgent, ShardedReceiver, ShardedSender, StepClock

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]
HEADS = 4


class Decode:
    """A decode worker of two ranks: rank 0's receiver and pool here, rank 1's agent beside it."""

    def __init__(self, directory: str) -> None:
        self.layouts = [rank_layout(HEADS, 2, r) for r in range(2)]
        self.caches = [torch.zeros(lay.cache_shape) for lay in self.layouts]
        self.pool = ShuffledFreeList(NUM_BLOCKS, seed=5)
        self.hub = AgentHub(directory, 1)
        self.agent = FollowerAgent(
            "decode", 1, self.layouts[1], self.caches[1], config(), directory, StepClock(torch.device("cpu"))
        )
        self.agent.start()
        self.results: queue.Queue[TransferResult] = queue.Queue()
        self.receiver = ShardedReceiver(
            self.layouts[0], self.caches[0], self.pool, config(), self.hub, on_result=self.results.put
        )

    def close(self) -> None:
        self.receiver.close()
        self.agent.close()
        self.hub.close()


class Prefill:
    """A prefill worker of two ranks: rank 0's sender here, rank 1's agent with a step clock the test ticks."""

    def __init__(self, directory: str, model: torch.Tensor) -> None:
        self.layouts = [rank_layout(HEADS, 2, r) for r in range(2)]
        heads = [kv_head_range(HEADS, 2, r) for r in range(2)]
        self.caches = [model[:, :, :, :, h.start : h.stop].contiguous() for h in heads]
        self.hub = AgentHub(directory, 1)
        self.clock = StepClock(torch.device("cpu"))
        self.agent = FollowerAgent(
            "prefill", 1, self.layouts[1], self.caches[1], config(), directory, self.clock
        )
        self.agent.start()
        self.published = 0
        self.released: list[SendResult] = []
        self.sender = ShardedSender(
            self.layouts[0], self.caches[0], config(), self.hub, lambda: self.published,
            on_release=self.released.append,
        )  # fmt: skip

    def close(self) -> None:
        self.sender.close()
        self.agent.close()
        self.hub.close()


@pytest.fixture
def pair(tmp_path):
    model = model_cache(HEADS)
    (tmp_path / "d").mkdir()
    (tmp_path / "p").mkdir()
    decode, prefill = Decode(str(tmp_path / "d")), Prefill(str(tmp_path / "p"), model)
    yield decode, prefill, model
    prefill.close()
    decode.close()


def test_a_request_lands_once_every_rank_has_its_heads_and_only_after_the_step(pair):
    decode, prefill, model = pair
    lease = decode.receiver.reserve("req-1", 10)
    target = decode.receiver.target(lease)
    assert len(target.rank_targets) == 1 and target.format.tp_size == 2
    src = [4, 8, 15]
    prefill.published = 1  # the prompt ran in step 1, which rank 1 has not run yet
    handle = prefill.sender.send(target, src, 10, FIRST)
    time.sleep(0.5)
    assert not handle.done()  # rank 0's piece is sent, rank 1 waits for its step
    assert decode.results.empty()  # rank 0's heads alone do not land the request
    prefill.clock.tick()
    sent = handle.result(timeout=20)
    result = decode.results.get(timeout=20)
    assert sent.ok and sent.num_bytes == sum(lay.bytes_per_block for lay in decode.layouts) * len(src)
    assert result.ok and result.first_token == FIRST and result.lease.block_ids == lease.block_ids
    # The decode worker counts every rank's bytes, as the prefill side does: the request's whole KV.
    assert result.num_bytes == sent.num_bytes and decode.receiver.stats().bytes_ok == sent.num_bytes
    for rank, cache in enumerate(decode.caches):
        heads = kv_head_range(HEADS, 2, rank)
        want = model[:, :, src][:, :, :, :, heads.start : heads.stop]
        assert torch.equal(cache[:, :, list(lease.block_ids)], want)
    assert [r.src_block_ids for r in prefill.released] == [tuple(src)]  # released once, after both ranks
    assert len(decode.pool.free_ids) == decode.pool.total - len(lease.block_ids)  # the caller's now


def test_a_failed_rank_fails_the_request_and_the_blocks_go_back_once(pair):
    decode = pair[0]
    decode.receiver.reserve("req-2", 10)
    decode.agent.receiver.abort("req-2", "rank 1 gave up")  # rank 1's lease ends first
    result = decode.results.get(timeout=20)
    assert not result.ok and "rank 1" in result.message
    assert result.failure is FailureReason.RECEIVER_ABORTED
    # Freed once, by rank 0, after both ranks ended (the pool refuses a double free).
    assert decode.pool.all_free


def test_a_rank_that_goes_away_fails_what_waits_on_it(pair):
    decode, prefill, _ = pair
    target = decode.receiver.target(decode.receiver.reserve("req-3", 6))
    prefill.published = 5
    handle = prefill.sender.send(target, [1, 2], 6, FIRST)
    prefill.agent.close()  # rank 1 of the prefill worker dies before its step ran
    sent = handle.result(timeout=20)
    assert not sent.ok and "rank 1" in sent.message
    assert [r.ok for r in prefill.released] == [False]
    decode.receiver.abort(
        "req-3", "the prefill side failed"
    )  # what the decode call does when the router gives up
    assert not decode.results.get(timeout=20).ok
    assert decode.pool.all_free


def test_a_rank_that_cannot_hold_its_lease_fails_the_reservation_and_frees_the_blocks(pair):
    decode = pair[0]
    assert decode.agent.receiver is not None
    decode.agent.receiver.reserve("req-4", 5, allocate=lambda n: list(range(1, n + 1)))  # rank 1 holds req-4
    with pytest.raises(RuntimeError, match="tensor-parallel rank 1 could not hold the KV lease: ValueError"):
        decode.receiver.reserve("req-4", 5)
    assert not decode.results.get(timeout=20).ok  # the join still ends, once, with the failure
    assert decode.pool.all_free
    decode.agent.receiver.abort("req-4")


def test_rank_0_stops_waiting_for_agents_once_a_rank_is_gone(tmp_path):
    """A rank that died before its agent connected (deploy.ranks reports its run() ended) ends the wait at once,
    naming the ranks that never reported, instead of holding the worker's start-up for the whole timeout."""
    hub = AgentHub(str(tmp_path), 2)
    hub.ranks_alive = lambda: False
    started = time.monotonic()
    try:
        with pytest.raises(
            RuntimeError, match=r"tensor-parallel ranks \[1, 2\]: their KV agents did not report: "
        ):
            hub.wait_ready(timeout_s=60)
    finally:
        hub.close()
    assert time.monotonic() - started < 5
