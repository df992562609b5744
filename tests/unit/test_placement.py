"""router.placement from plain values: the cost of each candidate, skipping, pairing, rotation, and bursts."""

from __future__ import annotations

from collections import Counter

import pytest

from model_runtime.roles import WorkerRole as Role
from router.placement import (
    LOCAL_CACHED,
    LOCAL_SHORT,
    LOCAL_SPILL,
    PREFILL_WORKER,
    LocalPrefill,
    Placement,
    Placer,
    PromptWork,
    WorkerLoad,
    can_serve,
    choose_decode,
    choose_prefill,
    colocated_cost,
    decode_cost,
    place,
    prefill_cost,
)

pytestmark = pytest.mark.unit


def decode(
    wid: str, free: int = 100, running: int = 0, ready: bool = True, fp: str = "L", total: int = 0
) -> WorkerLoad:
    return WorkerLoad(
        wid,
        Role.DECODE,
        ready,
        free_kv_blocks=free,
        running_requests=running,
        layout_fingerprint=fp,
        kv_blocks_total=total,
    )


def prefill(wid: str, queued: int = 0, ready: bool = True, fp: str = "L") -> WorkerLoad:
    return WorkerLoad(wid, Role.PREFILL, ready, queued_prefill_tokens=queued, layout_fingerprint=fp)


def colocated(
    wid: str, free: int = 100, running: int = 0, ready: bool = True, total: int = 0, queued: int = 0
) -> WorkerLoad:
    return WorkerLoad(
        wid,
        Role.COLOCATED,
        ready,
        free_kv_blocks=free,
        running_requests=running,
        queued_prefill_tokens=queued,
        kv_blocks_total=total,
        kv_block_size=16,
    )


def test_costs_count_work_in_prompt_tokens() -> None:
    work = PromptWork(1000, cached={"p0": 640, "c0": 2000})
    assert prefill_cost(prefill("p0", queued=300), work) == 300 + 360  # only the uncached tail is computed
    assert prefill_cost(prefill("p1", queued=300), work) == 300 + 1000
    # 2 running x 32 + 100 queued + 1024 x (25 of 100 blocks in use)
    assert decode_cost(decode("d0", free=75, running=2, total=100).charged(prefill_tokens=100), work) == 420
    assert colocated_cost(colocated("c0", free=100, total=100), work) == 0  # the whole prompt is cached there


def test_decode_with_least_work_wins_and_one_that_cannot_fit_the_prompt_comes_last() -> None:
    loads = [
        decode("d0", free=50, running=3),
        decode("d1", free=80, running=9),
        decode("d2", free=80, running=2),
    ]
    assert choose_decode(loads).worker_id == "d2"  # type: ignore[union-attr]
    # 64 blocks of 16 tokens: d2 and d1 cannot hold the prompt (at their last poll), d0 can.
    big = PromptWork(64 * 16)
    tight = [decode("d0", free=64, running=30), decode("d2", free=63)]
    assert choose_decode(tight, big).worker_id == "d0"  # type: ignore[union-attr]
    assert choose_decode([decode("d2", free=63)], big).worker_id == "d2"  # type: ignore[union-attr]


def test_a_prefix_hit_outweighs_a_short_queue_but_not_a_long_one() -> None:
    work = PromptWork(2048, cached={"p0": 2000})
    assert choose_prefill([prefill("p0", queued=500), prefill("p1")], "L", work).worker_id == "p0"  # type: ignore[union-attr]
    assert choose_prefill([prefill("p0", queued=5000), prefill("p1")], "L", work).worker_id == "p1"  # type: ignore[union-attr]


def test_not_ready_and_excluded_workers_are_skipped() -> None:
    loads = [decode("d0", free=500, ready=False), decode("d1", free=400), decode("d2", free=10)]
    assert choose_decode(loads).worker_id == "d1"  # type: ignore[union-attr]
    assert choose_decode(loads, exclude={"d1"}).worker_id == "d2"  # type: ignore[union-attr]
    assert choose_decode(loads, exclude={"d1", "d2"}) is None


def test_prefill_with_fewest_queued_tokens_and_matching_layout_wins() -> None:
    loads = [prefill("p0", queued=10), prefill("p1", queued=5, fp="other"), prefill("p2", queued=900)]
    assert choose_prefill(loads, "L").worker_id == "p0"  # type: ignore[union-attr]
    assert choose_prefill(loads, "other").worker_id == "p1"  # type: ignore[union-attr]
    assert choose_prefill(loads, "missing") is None


def test_place_pairs_decode_with_a_layout_compatible_prefill() -> None:
    # d0 is the better decode worker but no prefill worker shares its layout: the pair is d1 + p0.
    loads = [decode("d0", free=900, fp="X"), decode("d1", free=10), prefill("p0")]
    assert place(loads) == Placement("d1", "p0")
    assert not place(loads).local_prefill  # type: ignore[union-attr]


def test_place_falls_back_to_colocated_only_without_a_pair() -> None:
    loads = [colocated("c0"), decode("d0"), prefill("p0")]
    assert place(loads) == Placement("d0", "p0")
    assert place(loads, exclude={"p0"}) == Placement("c0")
    assert place([colocated("c0", running=3), colocated("c1", running=1)]) == Placement("c1", None)


def test_nothing_ready_means_no_placement_and_not_serving() -> None:
    assert place([]) is None
    assert not can_serve([decode("d0"), prefill("p0", ready=False)])
    assert not can_serve([decode("d0")])  # a decode worker alone cannot compute prompts
    assert not can_serve([colocated("c0", ready=False)])
    assert can_serve([decode("d0"), prefill("p0")]) and can_serve([colocated("c0")])


def test_turn_rotates_among_equally_good_workers_only() -> None:
    equal = [decode("d0"), decode("d1"), decode("d2")]
    picks = {choose_decode(equal, turn=t).worker_id for t in range(3)}  # type: ignore[union-attr]
    assert picks == {"d0", "d1", "d2"}
    better = [decode("d0", running=1), decode("d1"), decode("d2", running=1)]
    assert {choose_decode(better, turn=t).worker_id for t in range(6)} == {"d1"}  # type: ignore[union-attr]


def test_charges_shift_load_until_the_next_poll() -> None:
    load = decode("d0", free=10, running=1).charged(running=2, kv_blocks=4)
    assert (load.free_kv_blocks, load.running_requests) == (6, 3)
    assert decode("d0", free=3).charged(kv_blocks=9).free_kv_blocks == 0
    assert prefill("p0", queued=5).charged(prefill_tokens=100).queued_prefill_tokens == 105


def test_two_plus_two_workers_all_serve_traffic() -> None:
    """Sequential placements with the router's own charges applied spread over all four workers."""
    running: Counter[str] = Counter()
    queued: Counter[str] = Counter()
    used: Counter[str] = Counter()
    for turn in range(8):
        loads = [decode(d).charged(running=running[d], kv_blocks=used[d]) for d in ("d0", "d1")]
        loads += [prefill(p).charged(prefill_tokens=queued[p]) for p in ("p0", "p1")]
        chosen = place(loads, turn=turn)
        assert chosen is not None and chosen.prefill is not None
        running[chosen.decode] += 1
        used[chosen.decode] += 2
        queued[chosen.prefill] += 100
    assert set(running) == {"d0", "d1"} and set(queued) == {"p0", "p1"}
    assert running["d0"] == running["d1"] == 4 and queued["p0"] == queued["p1"] == 400


def test_idle_cluster_with_equal_loads_rotates_every_worker() -> None:
    """No charges (each request finished before the next): the turn alone spreads traffic."""
    loads = [decode("d0"), decode("d1"), prefill("p0"), prefill("p1")]
    placements = [place(loads, turn=t) for t in range(4)]
    assert {p.decode for p in placements if p} == {"d0", "d1"}
    assert {p.prefill for p in placements if p} == {"p0", "p1"}


def _burst(loads: list[WorkerLoad], prompts: list[int]) -> tuple[Counter[str], Counter[str]]:
    """Place `prompts` one after another as the router does between two polls: each placement charges its
    worker (a running sequence, its blocks, its prompt tokens). Returns (requests, prompt tokens) per worker."""
    count: Counter[str] = Counter()
    tokens: Counter[str] = Counter()
    by_id = {w.worker_id: w for w in loads}
    for turn, n in enumerate(prompts):
        chosen = place(list(by_id.values()), PromptWork(n), turn=turn)
        assert chosen is not None
        worker = chosen.prefill or chosen.decode
        load = by_id[worker]
        by_id[worker] = load.charged(running=1, kv_blocks=load.blocks_for(n), prefill_tokens=n)
        count[worker] += 1
        tokens[worker] += n
    return count, tokens


def test_a_burst_of_prompts_spreads_by_work_not_by_count() -> None:
    """One 4k-token prompt, then sixteen of 200 tokens, on two colocated replicas: the short ones all go to
    the other replica (16 x 200 tokens + 16 running sequences is still less work than the long prompt), where
    spreading by count would queue eight of them behind it."""
    count, tokens = _burst([colocated("c0", free=4096), colocated("c1", free=4096)], [4000] + [200] * 16)
    assert count == Counter({"c0": 1, "c1": 16}) and tokens == Counter({"c0": 4000, "c1": 3200})
    # The next long prompt goes behind the short ones, not behind the other long prompt.
    count, _ = _burst([colocated("c0", free=4096), colocated("c1", free=4096)], [4000] + [200] * 16 + [4000])
    assert count["c0"] == 1


def test_a_replica_that_just_freed_its_blocks_does_not_take_the_whole_burst() -> None:
    """c0 has just finished everything (all 1024 blocks free); c1 and c2 are busy but not full. Free memory
    alone would send all eight 2k-token prompts to c0; queued work moves most of them elsewhere."""
    loads = [
        colocated("c0", free=1024, total=1024),
        colocated("c1", free=700, running=6, total=1024),
        colocated("c2", free=600, running=8, total=1024),
    ]
    count, tokens = _burst(loads, [2048] * 8)
    assert count["c0"] < 8 and count["c1"] + count["c2"] >= 4, count
    assert max(tokens.values()) - min(tokens.values()) <= 2 * 2048, tokens


def test_prefill_burst_follows_queued_tokens_including_the_polled_queue() -> None:
    """p1 reported 6k queued tokens at its last poll: a burst goes to p0 until p0's queue catches up."""
    loads = [decode("d0", free=10_000), prefill("p0"), prefill("p1", queued=6000)]
    count, _ = _burst(loads, [1000] * 8)
    assert count["p0"] == 7 and count["p1"] == 1, count  # p0 reaches 6000 after six, then they alternate


def test_local_prefill_takes_short_or_mostly_cached_prompts_when_the_decode_worker_has_headroom() -> None:
    placer = Placer(local_prefill=LocalPrefill(max_uncached_tokens=64, max_queued_tokens=1000))
    loads = [decode("d0", free=500), prefill("p0")]
    short = placer.place(loads, PromptWork(40))
    assert short == Placement("d0", None) and short.reason == LOCAL_SHORT  # type: ignore[union-attr]
    cached = placer.place(loads, PromptWork(2000, cached={"d0": 1984}))
    assert cached == Placement("d0", None) and cached.reason == LOCAL_CACHED  # type: ignore[union-attr]
    # Cached on the prefill worker, not on the decode worker: the prefill worker computes it.
    assert placer.place(loads, PromptWork(2000, cached={"p0": 1984})) == Placement("d0", "p0")
    # No headroom: prompt tokens already queued on the decode worker, or no free blocks for the prompt.
    busy = [decode("d0", free=500).charged(prefill_tokens=980), prefill("p0")]
    assert placer.place(busy, PromptWork(40)) == Placement("d0", "p0")
    assert placer.place([decode("d0", free=2), prefill("p0")], PromptWork(40)) == Placement("d0", "p0")
    # Off by default.
    default = place(loads, PromptWork(40))
    assert default == Placement("d0", "p0") and default.reason == PREFILL_WORKER  # type: ignore[union-attr]


def test_a_prompt_spills_onto_its_decode_worker_while_the_prefill_queues_are_long() -> None:
    """4x H200: 2 prefill + 2 decode missed TTFT at 24 req/s while decode had room. With spill_queued_tokens,
    a prompt whose best prefill worker already has that many tokens queued runs on its decode worker, as long as
    the decode worker's own queue stays within the same bound."""
    placer = Placer(local_prefill=LocalPrefill(spill_queued_tokens=8192))
    work = PromptWork(3000)
    idle = [decode("d0", free=10_000), prefill("p0", queued=4000), prefill("p1", queued=5000)]
    assert placer.place(idle, work) == Placement("d0", "p0")  # the best prefill queue is short: remote
    long = [decode("d0", free=10_000), prefill("p0", queued=8192), prefill("p1", queued=9000)]
    spilled = placer.place(long, work)
    assert spilled == Placement("d0", None) and spilled.reason == LOCAL_SPILL  # type: ignore[union-attr]
    # The decode worker's own queue would pass the bound with this prompt: remote after all.
    busy = [decode("d0", free=10_000).charged(prefill_tokens=6000), prefill("p0", queued=9000)]
    assert placer.place(busy, work) == Placement("d0", "p0")
    # No blocks for the prompt on the decode worker: remote.
    assert placer.place([decode("d0", free=10), prefill("p0", queued=9000)], work) == Placement("d0", "p0")
    # Off by default.
    assert place(long, work) == Placement("d0", "p0")
