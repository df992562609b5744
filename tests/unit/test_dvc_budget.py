"""bench/disagg_vs_colocated.py's time budget: the whole drain is reserved until a point shows what its tail
takes, then the longest tail seen (with a margin, never more than the whole reserve); a deployment starts only
when its start-up and a first point fit."""

from __future__ import annotations

import pytest

from bench.dvc_budget import FIRST_START_S, FIRST_TAIL_S, TAIL_MARGIN, TAIL_PAD_S, Budget
from tests.fake_clock import ManualClock

pytestmark = pytest.mark.unit


def test_the_whole_drain_is_reserved_until_a_point_has_run_then_its_tail() -> None:
    clock = ManualClock(1000.0)
    budget = Budget(deadline=clock.now + 60, drain_s=20, clock=clock)
    assert budget.reserve_s() == 20 + FIRST_TAIL_S
    assert budget.fits(8) and not budget.fits(11)  # 8 + 50 <= 60 < 11 + 50
    timer = budget.timed()
    clock.now += 11  # a point of 8 s arrivals that took 11 s in all: a 3 s tail
    budget.record_point(8, timer.elapsed())
    assert budget.longest_tail_s == pytest.approx(3)
    assert budget.reserve_s() == pytest.approx(3 * TAIL_MARGIN + TAIL_PAD_S)
    assert budget.fits(8)  # 1011 + 8 + 8.75 <= 1060: a point the old rule (58 s) refused
    budget.record_point(8, 8 + 40)  # a long tail later: the longest counts, capped at the whole reserve
    assert budget.reserve_s() == 20 + FIRST_TAIL_S
    assert not budget.fits(8)


def test_a_deployment_starts_only_when_its_start_up_and_a_first_point_fit() -> None:
    clock = ManualClock(1000.0)
    budget = Budget(deadline=clock.now + FIRST_START_S + 2 + 50, drain_s=20, clock=clock)
    assert budget.fits_deployment(2)  # 60 s start-up (none timed yet) + 2 s + 50 s reserve
    assert not budget.fits_deployment(3)
    budget.record_start(20.0)  # a start that took 20 s: 25 s reserved for the next one
    assert budget.fits_deployment(30)
    budget.record_start(10.0)  # the longest start counts
    assert budget.longest_start_s == 20.0
    clock.now += 40
    assert not budget.fits_deployment(2)  # 1040 + 25 + 2 + 50 > 1112


def test_a_closed_loop_warm_up_runs_only_when_asked_for_and_when_it_fits() -> None:
    """bench/disagg_vs_colocated.closed_warm_up: 3 x --warm-up-s of the workload's own loop; none with
    --warm-up-s 0, and none when that time (plus the drain reserve) no longer fits: the server is not touched."""
    from bench.disagg_vs_colocated import closed_warm_up
    from bench.dvc_args import parse_args
    from bench.dvc_workloads import WORKLOADS

    clock = ManualClock(1000.0)
    untouched = object()  # any call on it would fail: neither case may reach the server
    batch = WORKLOADS["batch"]
    no_warm_up = parse_args(["--warm-up-s", "0", "--drain", "20"])
    assert closed_warm_up(untouched, "x/batch", batch, no_warm_up, Budget(clock.now + 600, 20, clock)) == []
    short = parse_args(["--warm-up-s", "5", "--drain", "20"])  # 15 s + 20 + FIRST_TAIL_S reserve > 30 s left
    assert closed_warm_up(untouched, "x/batch", batch, short, Budget(clock.now + 30, 20, clock)) == []
