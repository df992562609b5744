"""bench/disagg_vs_colocated.py's headline (issue 20): the best disaggregated deployment against the best
colocated one on as many GPUs, at the sweep's SLO and the interactive one; their p99 ITL at equal load; each
mode's growth from N to 2N GPUs; capacities at the edge of a sweep reported as bounds, never as measurements."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.dvc_args import parse_args
from bench.dvc_headline import doubling, headline, headline_table, judge
from bench.dvc_runs import load_runs
from bench.dvc_summary import goal_checks, summarize, summarize_workload
from bench.dvc_tables import capacity_table
from tandem_cli.bench import SLO

pytestmark = pytest.mark.unit

RELAXED = SLO(ttft=1.0, tpot=0.05)
FAST, SLOW = (
    (0.1, 0.01, 2.0),
    (0.8, 0.04, 9.0),
)  # a request inside the interactive set, one inside relaxed only


def _point(rate: float, share: float, fast_share: float, itl_p99: float = 0.05) -> dict:
    """A point of 100 requests: `share` met the relaxed SLO, `fast_share` of all the interactive one too."""
    fast = round(100 * fast_share)
    met = round(100 * share)
    samples = [FAST] * fast + [SLOW] * (met - fast) + [(3.0, 0.2, 30.0)] * (100 - met)
    lat = {"p50": 0.1, "p90": 0.5, "p99": 0.9}
    return {"settings": {"rate": rate}, "goodput": {"share": share}, "counts": {"sent": 100},
            "slo_samples": samples, "output_token_throughput": 1000.0 * rate, "ttft": lat, "tpot": lat,
            "itl": {"p99": itl_p99}}  # fmt: skip


def _run(gpus: int, *points: dict) -> dict:
    return {"gpus": gpus, "card": "test", "repeats": 1, "points": list(points), "workload_spec": {}}


def _summarize(runs: dict, tmp_path: Path) -> dict:
    return summarize_workload("prefill-heavy", runs, RELAXED, tmp_path)


def test_each_mode_is_judged_by_its_best_deployment_per_slo_set_and_gpu_count(tmp_path: Path) -> None:
    runs = {
        # 4 GPUs, disaggregated: 3p1d holds 12 req/s at the relaxed SLO but only 4 interactive; 2p2d 8 and 8.
        "disagg-3p1d": _run(4, _point(4, 1.0, 1.0), _point(8, 1.0, 0.5), _point(12, 0.95, 0.2), _point(16, 0.3, 0)),
        "disagg-2p2d": _run(4, _point(4, 1.0, 1.0), _point(8, 0.97, 0.95, 0.02), _point(12, 0.5, 0.3)),
        "colocated-4": _run(4, _point(4, 1.0, 0.99), _point(8, 1.0, 0.6, 0.08), _point(12, 0.8, 0.1)),
        # an ablation that happens to score higher is not a candidate
        "colocated-4-nocache": _run(4, _point(4, 1.0, 1.0), _point(8, 1.0, 1.0), _point(12, 1.0, 1.0),
                                    _point(16, 0.1, 0.1)),
    }  # fmt: skip
    out = _summarize(runs, tmp_path)
    four = out["headline"]["4"]
    assert four["slo"]["best"]["disagg"]["deployment"] == "disagg-3p1d"
    assert four["slo"]["best"]["colocated"]["deployment"] == "colocated-4"
    assert four["slo"]["disagg_over_colocated"] == {"ratio": pytest.approx(12 / 8), "bound": None}
    assert four["interactive"]["best"]["disagg"]["deployment"] == "disagg-2p2d"
    assert four["interactive"]["disagg_over_colocated"] == {"ratio": pytest.approx(8 / 4), "bound": None}
    # ITL at the highest rate both relaxed bests sustained (8 req/s: colocated-4 misses at 12)
    assert four["equal_load"]["rate"] == 8
    assert four["equal_load"]["colocated_over_disagg"] == pytest.approx(0.08 / 0.05)


def test_a_capacity_at_the_top_of_its_sweep_or_below_its_bottom_is_a_bound(tmp_path: Path) -> None:
    runs = {
        "disagg-2p2d": _run(4, _point(16, 1.0, 0.5), _point(20, 0.99, 0.3)),  # never missed: >= 20
        "colocated-4": _run(4, _point(16, 1.0, 0.95), _point(20, 0.5, 0.2)),
        "colocated": _run(2, _point(8, 0.95, 0.1), _point(16, 0.91, 0.0)),  # interactive missed at 8 already
    }
    out = _summarize(runs, tmp_path)
    four, two = out["headline"]["4"], out["headline"]["2"]
    assert four["slo"]["best"]["disagg"]["bound"] == "at least"
    assert four["slo"]["disagg_over_colocated"] == {"ratio": pytest.approx(20 / 16), "bound": "at least"}
    assert four["interactive"]["best"]["disagg"]["bound"] == "below"
    assert four["interactive"]["disagg_over_colocated"] == {
        "ratio": pytest.approx(16 / 16),
        "bound": "at most",
    }
    assert two["interactive"]["best"]["colocated"]["bound"] == "below"
    assert (
        two["slo"]["best"]["colocated"]["bound"] == "at least" and two["slo"]["disagg_over_colocated"] is None
    )
    grow = doubling(out["headline"])
    # colocated 2 -> 4: 16 (the top of the 2-GPU sweep: at least) -> 16: the true ratio is at most 1
    assert grow["colocated/2->4/slo"] == {
        "ratio": 1.0,
        "bound": "at most",
        "from": "colocated",
        "to": "colocated-4",
    }
    # interactive: below 8 -> 16: at least 2x
    assert grow["colocated/2->4/interactive"]["ratio"] == 2.0
    assert grow["colocated/2->4/interactive"]["bound"] == "at least"
    assert "disagg/2->4/slo" not in grow  # no 2-GPU disaggregated run
    # the per-deployment check (colocated-4 over its 2-GPU base) reads the same bound
    assert goal_checks([out])["doubling_goal_met"] == {"colocated-4": False}
    table = capacity_table([out])
    assert "| prefill-heavy | disagg-2p2d | 4 | >= 20 | 5.00 |" in table
    assert "| prefill-heavy | colocated | 2 | >= 16 | 8.00 | - | below lowest rate: 0.0 |" in table


def test_a_goal_judged_on_a_bound_says_unknown_when_the_bound_points_away_from_it() -> None:
    assert judge({"ratio": 2.1, "bound": None}, 2.0) is True
    assert judge({"ratio": 1.9, "bound": None}, 2.0) is False
    assert judge({"ratio": 2.1, "bound": "at least"}, 2.0) is True
    assert judge({"ratio": 1.9, "bound": "at least"}, 2.0) == "unknown"
    assert judge({"ratio": 1.9, "bound": "at most"}, 2.0) is False
    assert judge({"ratio": 2.1, "bound": "at most"}, 2.0) == "unknown"
    assert judge({"ratio": 2.1, "bound": "unknown"}, 2.0) == "unknown"


def test_no_comparison_without_both_modes_on_as_many_gpus() -> None:
    pinned = {"capacity_bound": None, "capacity_bound_interactive": None}  # each capacity pinned by a miss
    out = {"colocated-4": {"gpus": 4, "capacity_rps": 8.0, "capacity_rps_interactive": 4.0, **pinned},
           "disagg": {"gpus": 2, "capacity_rps": 4.0, "capacity_rps_interactive": 2.0, **pinned}}  # fmt: skip
    points = {"colocated-4": [_point(4, 1.0, 1.0), _point(8, 1.0, 1.0), _point(12, 0.1, 0.0)],
              "disagg": [_point(2, 1.0, 1.0), _point(4, 1.0, 1.0), _point(6, 0.1, 0.0)]}  # fmt: skip
    head = headline(out, points)
    assert head["4"]["slo"]["disagg_over_colocated"] is None and head["4"]["equal_load"] is None
    assert head["2"]["slo"]["disagg_over_colocated"] is None


def test_runs_from_several_directories_make_one_summary_and_a_deployment_in_two_is_refused(
    tmp_path: Path,
) -> None:
    four, two = tmp_path / "four", tmp_path / "two"
    four.mkdir()
    two.mkdir()
    files = {
        four / "colocated-4_prefill-heavy.json": _run(4, _point(16, 1.0, 0.95), _point(24, 0.95, 0.5),
                                                     _point(32, 0.5, 0.1)),
        four / "disagg-2p2d_prefill-heavy.json": _run(4, _point(16, 1.0, 0.8), _point(24, 0.4, 0.1)),
        two / "colocated_prefill-heavy.json": _run(2, _point(8, 1.0, 0.92), _point(12, 0.96, 0.5),
                                                  _point(16, 0.2, 0.0)),
    }  # fmt: skip
    for path, run in files.items():
        run.update(deployment=path.name.split("_")[0], workload="prefill-heavy", commit="x", slo={})
        path.write_text(json.dumps(run))
    out = tmp_path / "summary"
    out.mkdir()
    summarize(RELAXED, out, (four, two))
    summary = json.loads((out / "summary.json").read_text())
    row = summary["workloads"][0]
    assert set(row["headline"]) == {"2", "4"}
    assert row["mode_doubling"]["colocated/2->4/slo"]["ratio"] == pytest.approx(24 / 12)
    goals = summary["goals"]["headline"]
    assert goals["prefill-heavy/colocated/2->4/slo"] is True  # 12 -> 24 req/s, both pinned by a miss
    assert goals["prefill-heavy/interactive_goodput"] is False  # disagg 0 (< 16) against colocated 16
    table = (out / "summary.md").read_text()
    assert (
        "| prefill-heavy | 4 | slo | 4.00 (disagg-2p2d, 16 req/s) | 6.00 (colocated-4, 24 req/s) | 0.67x |"
        in table
    )
    (two / "colocated-4_prefill-heavy.json").write_text(
        json.dumps(files[four / "colocated-4_prefill-heavy.json"])
    )
    with pytest.raises(ValueError, match="colocated-4 prefill-heavy is in both"):
        load_runs("prefill-heavy", [four, two])


def test_a_sweep_split_over_two_calls_is_merged_and_runs_that_differ_are_refused(tmp_path: Path) -> None:
    """The 2-GPU half of issue 20 ran 4-12 req/s in one device call and 14-20 in the next, same commit and card:
    one sweep, whose capacity only the merged points show (100% up to 16, 40% at 18)."""
    low, high = tmp_path / "low", tmp_path / "high"
    low.mkdir()
    high.mkdir()

    def write(directory: Path, port: int, commit: str, *points: dict) -> None:
        run = _run(2, *points)
        run.update(
            commit=commit, slo={}, config={"mode": "colocated", "router": {"port": port, "max_queue": 9}}
        )
        (directory / "colocated_prefill-heavy.json").write_text(json.dumps(run))

    write(low, 50051, "c1", _point(4, 1.0, 1.0), _point(12, 1.0, 0.95))
    write(high, 50099, "c1", _point(16, 0.95, 0.5), _point(14, 1.0, 0.9), _point(18, 0.4, 0.0))
    merged = load_runs("prefill-heavy", [low, high])["colocated"]
    assert [p["settings"]["rate"] for p in merged["points"]] == [4, 12, 14, 16, 18]
    row = _summarize({"colocated": merged}, tmp_path)
    assert row["colocated"]["capacity_rps"] == 16.0
    assert row["colocated"]["capacity_rps_interactive"] == 14.0

    write(high, 50099, "c2", _point(16, 0.95, 0.5))  # another commit: not the same sweep
    with pytest.raises(ValueError, match=r"is in both .* \(different commit\)"):
        load_runs("prefill-heavy", [low, high])
    write(high, 50099, "c1", _point(12, 0.5, 0.0))  # a rate both ran: which one counts is not for us to pick
    with pytest.raises(ValueError, match=r"both ran \[12\] req/s"):
        load_runs("prefill-heavy", [low, high])


def test_include_is_for_summaries_only_and_must_exist(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--include", str(tmp_path)])
    with pytest.raises(SystemExit):
        parse_args(["--summarize-only", "--include", str(tmp_path / "missing")])
    assert parse_args(["--summarize-only", "--include", str(tmp_path)]).include == [tmp_path]


def test_a_capacity_whose_first_miss_ran_with_a_saturated_router_is_flagged(tmp_path: Path) -> None:
    """colocated-4's decode-heavy miss at 48 req/s ran with the serve process at 1.34 cores: that capacity may be
    the router's, and the table says so."""
    router_bound = _point(48, 0.54, 0.5)
    router_bound["cpu"] = {"serve_process_cores": 1.34, "bench_client_cores": 0.8}
    gpu_bound = _point(48, 0.42, 0.4)
    gpu_bound["cpu"] = {"serve_process_cores": 0.6}
    runs = {
        "colocated-4": _run(4, _point(16, 1.0, 1.0), _point(32, 1.0, 1.0), router_bound),
        "disagg-1p3d": _run(4, _point(16, 1.0, 1.0), _point(32, 1.0, 0.5), gpu_bound),
    }
    four = _summarize(runs, tmp_path)["headline"]["4"]
    assert four["slo"]["best"]["colocated"]["cpu_saturated_at_first_miss"] is True
    assert four["slo"]["best"]["disagg"]["cpu_saturated_at_first_miss"] is False
    table = headline_table([{"workload": "decode-heavy", "headline": {"4": four}}])
    assert "8.00 (colocated-4, 32 req/s, router or client saturated at the next rate)" in table
    assert "8.00 (disagg-1p3d, 32 req/s) |" in table
