"""The prefix index from both ends: what a worker reports of its prefix cache, what the router estimates from
it, and the engine's real count of reused prompt tokens (usage.cached_prompt_tokens, the worker metric)."""

from __future__ import annotations

from pathlib import Path

import pytest

from model_runtime.block_pool import BlockPool
from model_runtime.config import SchedulerConfig
from model_runtime.request import Request, SamplingParams
from model_runtime.scheduler import Scheduler
from router.prefix import PromptHashes, cached_prefix_tokens
from tandem_api.tandem.v1 import admin_pb2
from tests.polling import wait_until
from tests.unit.metrics_support import running_worker, value
from worker_host.rpc import worker_info

pytestmark = pytest.mark.unit

BS = 4


def test_the_router_estimate_counts_the_blocks_the_engine_would_reuse() -> None:
    pool = BlockPool(16, BS)
    system = list(range(100, 112))  # three full blocks
    pool.free(_commit(pool, system))
    held = set(pool.cached_hashes(100))

    def estimate(prompt: list[int]) -> int:
        return cached_prefix_tokens(PromptHashes(prompt).matchable(BS), held, BS)

    assert estimate([*system, 7, 8]) == 12 == BS * len(pool.match_prefix([*system, 7]))
    # The whole prompt cached: its last block is computed again (one token must run to sample from).
    assert estimate(system) == 8
    assert estimate([*system[:5], 0, *system[6:], 9]) == 4  # differs inside block 1: block 0 only
    assert estimate([0, *system]) == 0
    assert estimate([1, 2]) == 0  # shorter than a block


def test_a_worker_reports_its_prefix_cache_and_counts_the_tokens_it_really_reused(tmp_path: Path) -> None:
    with running_worker(tmp_path, "colocated") as w:
        loop = w.loop
        system = list(range(100, 113))  # 13 tokens: three full blocks
        first = w.generate(system, max_tokens=2)
        assert first[-1].num_cached_tokens == 0
        info = wait_until(lambda: _info(loop, known=0), what="a prefix report")
        held = set(info.cached_block_hashes)
        follow_up = [*system[:12], 7, 8, 9]
        assert cached_prefix_tokens(PromptHashes(follow_up).matchable(BS), held, BS) == 12
        assert len(held) <= loop.engine.pool.num_cached

        second = w.generate(follow_up, max_tokens=2)
        assert second[-1].num_cached_tokens == 12  # the engine's own match: what usage reports
        assert value(w.metrics.registry, "tandem_prefix_cache_hit_tokens_total") == 12
        assert loop.counters.cached_prompt_tokens_total == 12

        # A poller that holds the current version gets no hashes; one that does not gets them all.
        current = wait_until(lambda: _info(loop, known=info.prefix_cache_version), what="a newer report")
        again = worker_info(loop, **_ids(), known_prefix_version=current.prefix_cache_version)
        assert again.prefix_cache_version == current.prefix_cache_version and not again.cached_block_hashes
        assert again.cached_prompt_tokens_total == 12


def _ids() -> dict:
    return {
        "worker_id": "colocated-0",
        "role": admin_pb2.WORKER_ROLE_COLOCATED,
        "address": "",
        "draining": False,
        "active_leases": 0,
    }


def _info(loop, known: int) -> admin_pb2.WorkerInfo | None:
    """The worker's status once its prefix report is newer than `known` (and up to date), else None."""
    info = worker_info(loop, **_ids(), known_prefix_version=known)
    fresh = info.prefix_cache_version not in (0, known)
    return info if fresh and info.prefix_cache_version == loop.engine.pool.cache_version else None


def _commit(pool: BlockPool, tokens: list[int]) -> list[int]:
    ids = pool.allocate(len(tokens) // BS)
    pool.commit_full_blocks(ids, tokens, len(tokens))
    return ids


def test_a_queued_prompt_counts_only_its_uncached_tokens_as_prefill_work() -> None:
    """The placement signal (queued prefill tokens) of a prompt still waiting for admission: a prompt whose
    blocks are in the prefix cache is a few tokens of work, not its whole length."""
    pool = BlockPool(32, BS)
    system = list(range(100, 116))  # four full blocks
    pool.free(_commit(pool, system))
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), pool, BS, max_model_len=128)
    sched.add(Request("hit", [*system, 1, 2], SamplingParams(max_tokens=2)))
    sched.add(Request("miss", [9, *system, 1], SamplingParams(max_tokens=2)))
    assert sched.uncomputed_prompt_tokens() == (18 - 16) + 18
    sched.advance(sched.schedule())
    assert sched.get("hit").num_cached_tokens == 16  # type: ignore[union-attr]
    assert sched.uncomputed_prompt_tokens() == 0
