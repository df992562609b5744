"""bench/disagg_vs_colocated.py's repeated points: every run is kept, a rate counts by the worse of its runs, a
rate cut short (fewer runs than --repeats) is left out, and warm-up rounds and repeats get prompts of their own."""

from __future__ import annotations

import json

import pytest

from bench.disagg_vs_colocated import WARM_UP_SEED_BLOCK, earlier_points, point_seconds, point_seed
from bench.dvc_args import SETTLE_SEED_BLOCK, parse_args
from bench.dvc_deployments import kv_delta
from bench.dvc_points import steps_line
from bench.dvc_summary import rate_points, repeat_spread, share_points
from tandem_cli.bench.sweep import capacity

pytestmark = pytest.mark.unit


def _point(rate: float, share: float, repeat: int = 0) -> dict:
    return {"settings": {"rate": rate}, "goodput": {"share": share}, "repeat": repeat}


def test_a_rate_counts_by_its_worse_run_and_an_incomplete_rate_is_left_out() -> None:
    run = {
        "repeats": 2,
        "points": [
            _point(1, 1.0), _point(1, 0.97, 1),
            _point(2, 0.95), _point(2, 0.85, 1),  # the second run misses the 90% target
            _point(3, 0.99),  # cut short by the budget: one run of two
        ],
    }  # fmt: skip
    assert share_points(rate_points(run)) == [(1, 0.97), (2, 0.85)]
    assert capacity(share_points(rate_points(run)), 0.9) == 1  # 2 req/s held in one run only: not a capacity
    assert repeat_spread(run) == pytest.approx(0.10)


def test_files_without_repeats_hold_one_run_a_rate() -> None:
    run = {"points": [_point(1, 1.0), _point(2, 0.5)]}
    assert share_points(rate_points(run)) == [(1, 1.0), (2, 0.5)] and repeat_spread(run) is None


def test_every_run_and_warm_up_round_gets_fresh_prompts() -> None:
    rates = (0.5, 1, 1.5, 2, 20, 99.5)
    seeds = [point_seed(0, r, k) for r in rates for k in (*range(WARM_UP_SEED_BLOCK), WARM_UP_SEED_BLOCK)]
    assert len(set(seeds)) == len(seeds)
    assert point_seed(3, 1.5, 0) == 300_150  # repeat 0: the seed earlier runs of the script used


def test_repeats_and_warm_up_defaults_by_mode() -> None:
    gpu = parse_args(["--deployments", "colocated"])
    assert (gpu.repeats, gpu.warm_up_s) == (2, 5.0)
    smoke = parse_args(["--smoke", "--out", "/tmp/unused"])
    assert (smoke.repeats, smoke.warm_up_s) == (1, 2.0)
    assert (gpu.settle_s, smoke.settle_s) == (40.0, 6.0)
    for bad in (
        ["--repeats", "0"],
        ["--repeats", str(SETTLE_SEED_BLOCK)],
        ["--rates", "1,100"],
        ["--settle-s", "-1"],
    ):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_rates_for_one_workload_override_the_plain_list_for_that_workload_only() -> None:
    args = parse_args(["--rates", "1,2", "--rates", "prefill-heavy=4,8.5"])
    assert args.rates == {"*": (1.0, 2.0), "prefill-heavy": (4.0, 8.5)}
    assert parse_args([]).rates == {}
    for bad in (
        ["--rates", "prefil-heavy=4"],  # unknown workload
        ["--rates", "mixed=1", "--rates", "mixed=2"],  # twice
        ["--rates", "mixed=1,x"],
        ["--rates", "mixed=0"],
    ):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_a_points_handoff_means_survive_a_worker_that_left_or_joined_during_it() -> None:
    """Run 6 of the 4-GPU sweep printed decode.admit -139 ms: the autoscaler replaced a decode worker during the
    point and the summed counters went down. Differences are taken per worker now."""
    before = {
        "p0": {"transfers": 10.0, "seconds": 1.0, "bytes": 100.0},
        "d0": {"decode.admit.sum": 5.0, "decode.admit.count": 10.0},  # leaves during the point
        "d1": {"decode.admit.sum": 1.0, "decode.admit.count": 4.0},
    }
    after = {
        "p0": {"transfers": 14.0, "seconds": 1.8, "bytes": 140.0},
        "d1": {"decode.admit.sum": 1.2, "decode.admit.count": 6.0},
        "d2": {"decode.admit.sum": 0.2, "decode.admit.count": 2.0},  # joined: counts from zero
    }
    kv = kv_delta(before, after)
    assert kv is not None
    assert (
        kv["transfers"] == 4 and kv["mean_s"] == pytest.approx(0.2) and kv["mean_bytes"] == pytest.approx(10)
    )
    assert kv["phases_mean_s"] == {"decode.admit": pytest.approx(0.1)}  # (0.2 + 0.2) / (2 + 2)
    restarted = {**after, "d1": {"decode.admit.sum": 0.1, "decode.admit.count": 1.0}}  # went down: left out
    assert kv_delta(before, restarted)["phases_mean_s"] == {"decode.admit": pytest.approx(0.1)}
    assert kv_delta(None, after) is None and kv_delta({}, {}) is None


def test_a_point_reports_each_roles_steps_and_each_workers_share() -> None:
    """The closed-loop line: steps/s, sequences a step and prompt tokens/s per role from the workers' /metrics
    sums, then each worker's own sequences a step; a worker that restarted in the point is left out of both."""

    def sums(steps: float, seqs: float, prompt: float, step_s: float) -> dict[str, float]:
        return {"colocated.steps": steps, "colocated.batch_seqs": seqs, "colocated.prefill_tokens": prompt,
                "colocated.step.sum": step_s, "colocated.step.count": steps,
                "colocated.first_token_waiting.sum": 0.0, "colocated.first_token_waiting.count": 0.0}  # fmt: skip

    before = {
        "a": sums(100, 4_000, 10_000, 2.0),
        "b": sums(50, 1_000, 5_000, 1.0),
        "c": sums(80, 800, 0, 1.0),
    }
    after = {
        "a": sums(300, 12_000, 40_000, 6.0),
        "b": sums(150, 2_000, 25_000, 3.0),
        "c": sums(10, 100, 0, 0.2),
    }
    kv = kv_delta(before, after)
    assert kv is not None
    assert kv["steps"]["colocated"] == {"steps": 300, "batch_seqs": 9_000, "prefill_tokens": 50_000,
                                        "launch_waits": 0.0, "launch_misses": 0.0, "kernel_builds": 0.0}  # fmt: skip
    assert kv["steps_by_worker"] == {
        "a": {"role": "colocated", "steps": 200, "batch_seqs": 8_000, "prefill_tokens": 30_000},
        "b": {"role": "colocated", "steps": 100, "batch_seqs": 1_000, "prefill_tokens": 20_000},
    }
    line = steps_line({"kv_transfer": kv, "duration_s": 10.0})
    assert "colocated: 30 steps/s of 30.0 sequences, 5,000 prompt tokens/s, 20.0 ms a step" in line
    assert "per worker: 40.0 / 10.0 sequences a step, 30k / 20k prompt tokens" in line
    assert steps_line({"kv_transfer": None, "duration_s": 10.0}) == ""
    assert "built" not in line
    after["a"]["colocated.kernel_builds"], before["a"]["colocated.kernel_builds"] = 3.0, 1.0
    built = kv_delta(before, after)
    assert built is not None and built["steps"]["colocated"]["kernel_builds"] == 2.0
    assert "2 Triton kernels built during it" in steps_line({"kv_transfer": built, "duration_s": 10.0})


def test_a_closed_loop_run_lasts_batch_duration_and_the_rate_points_keep_duration() -> None:
    args = parse_args(["--duration", "8", "--batch-duration", "60", "--min-requests", "20"])
    assert point_seconds(0.0, args) == 60.0  # the batch case
    assert point_seconds(16.0, args) == 8.0
    assert point_seconds(1.0, args) == 20.0  # stretched to --min-requests
    assert point_seconds(0.0, parse_args(["--duration", "8"])) == 8.0  # default: --duration
    with pytest.raises(SystemExit):
        parse_args(["--batch-duration", "0"])


def test_batch_concurrency_must_be_a_positive_count() -> None:
    assert parse_args(["--batch-concurrency", "50"]).batch_concurrency == 50
    assert parse_args([]).batch_concurrency is None  # the workload's own 200
    with pytest.raises(SystemExit):
        parse_args(["--batch-concurrency", "0"])


def test_a_later_round_adds_its_runs_to_its_own_earlier_rounds_only(tmp_path) -> None:
    """--rounds N: the deployments run N times in turn; each round's runs join the file the first round of the
    same invocation wrote, and a rate then needs the runs of every round so far to count."""
    path = tmp_path / "colocated-1_batch.json"
    assert earlier_points(path, repeats=2, invocation="this") == {}  # no earlier round reached this workload
    points = [{"settings": {"rate": 0.0}, "repeat": r, "round": 0} for r in range(2)]
    path.write_text(json.dumps({"invocation": "this", "repeats": 2, "points": points}))
    assert earlier_points(path, repeats=2, invocation="this") == {"points": points, "rounds": 2, "repeats": 4}
    assert earlier_points(path, repeats=2, invocation="another run") == {}  # a stale file is not added to
    path.write_text(json.dumps({"invocation": "this", "repeats": 4, "rounds": 2, "points": points * 2}))
    assert earlier_points(path, repeats=2, invocation="this")["repeats"] == 6
    run = {"repeats": 4, "points": [_point(1, 1.0), _point(1, 0.95, 1), _point(1, 0.97), _point(1, 0.92, 1),
                                    _point(2, 1.0), _point(2, 1.0, 1)]}  # fmt: skip
    assert share_points(rate_points(run)) == [(1, 0.92)]  # 2 req/s ran in one round of two: left out
    assert parse_args(["--rounds", "3"]).rounds == 3 and parse_args([]).rounds == 1
    with pytest.raises(SystemExit):
        parse_args(["--rounds", "0"])
