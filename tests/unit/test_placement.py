"""router.placement from plain values: the decode/prefill/colocated choice, skipping, pairing and rotation."""

from __future__ import annotations

from collections import Counter

import pytest

from model_runtime.roles import WorkerRole as Role
from router.placement import Placement, WorkerLoad, can_serve, choose_decode, choose_prefill, place

pytestmark = pytest.mark.unit


def decode(wid: str, free: int = 100, running: int = 0, ready: bool = True, fp: str = "L") -> WorkerLoad:
    return WorkerLoad(
        wid, Role.DECODE, ready, free_kv_blocks=free, running_requests=running, layout_fingerprint=fp
    )


def prefill(wid: str, queued: int = 0, ready: bool = True, fp: str = "L") -> WorkerLoad:
    return WorkerLoad(wid, Role.PREFILL, ready, queued_prefill_tokens=queued, layout_fingerprint=fp)


def colocated(wid: str, free: int = 100, running: int = 0, ready: bool = True) -> WorkerLoad:
    return WorkerLoad(wid, Role.COLOCATED, ready, free_kv_blocks=free, running_requests=running)


def test_decode_with_most_free_blocks_wins_then_fewest_running() -> None:
    loads = [decode("d0", free=50), decode("d1", free=80, running=9), decode("d2", free=80, running=2)]
    chosen = choose_decode(loads)
    assert chosen is not None and chosen.worker_id == "d2"


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
    assert place([colocated("c0", free=5), colocated("c1", free=50)]) == Placement("c1", None)


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
    better = [decode("d0", free=10), decode("d1", free=99), decode("d2", free=10)]
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
