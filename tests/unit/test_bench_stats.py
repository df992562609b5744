"""`tandem bench` arithmetic on hand-computed values: percentiles, per-request TTFT/TPOT/ITL, goodput, report
counts, flag parsing, and the seeded gamma arrivals."""

from __future__ import annotations

import itertools
import math
import statistics
import sys

import pytest

from tandem_cli.bench.loadgen import Outcome, RequestRecord, RunResult
from tandem_cli.bench.plots import LatencySamples, plot_goodput_vs_rate, plot_latency_cdfs
from tandem_cli.bench.report import BenchSettings, build_report, count_outcomes, format_summary
from tandem_cli.bench.stats import (
    SLO,
    Timeline,
    goodput,
    parse_slo,
    percentile,
    request_metrics,
    summarize,
)
from tandem_cli.bench.sweep import capacity, equal_load
from tandem_cli.bench.workload import (
    BenchConfigError,
    LengthDist,
    arrival_offsets,
    build_requests,
    parse_dist,
    safe_id_range,
)

pytestmark = pytest.mark.unit


# --- percentiles: rank = (n - 1) * q / 100 on the sorted values, linear between neighbours ---------------


def test_percentile_hand_computed():
    values = [40.0, 10.0, 30.0, 20.0]  # sorted: 10 20 30 40
    assert percentile(values, 0) == 10.0
    assert percentile(values, 100) == 40.0
    assert percentile(values, 50) == pytest.approx(25.0)  # rank 1.5
    assert percentile(values, 90) == pytest.approx(37.0)  # rank 2.7: 30 + 0.7 * 10
    assert percentile(values, 99) == pytest.approx(39.7)  # rank 2.97
    assert percentile([5.0], 99) == 5.0


def test_percentile_of_eleven_values_lands_on_ranks():
    values = [float(v) for v in range(0, 110, 10)]  # 0..100, rank = q / 10
    assert percentile(values, 50) == pytest.approx(50.0)
    assert percentile(values, 90) == pytest.approx(90.0)
    assert percentile(values, 99) == pytest.approx(99.0)  # rank 9.9: 90 + 0.9 * 10


def test_percentile_rejects_empty_and_out_of_range():
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        percentile([1.0], 101)


def test_summary_mean_and_ordering():
    s = summarize([0.1, 0.2, 0.3, 0.4, 1.0])
    assert s.count == 5 and s.mean == pytest.approx(0.4) and s.max == 1.0
    assert s.p50 == pytest.approx(0.3)
    assert s.p90 == pytest.approx(0.76)  # rank 3.6: 0.4 + 0.6 * 0.6
    assert s.p50 <= s.p90 <= s.p99 <= s.max
    assert summarize([]).p99 is None


# --- per-request metrics from a timeline ----------------------------------------------------------------


def test_metrics_one_token_per_delta():
    # sent at 0; tokens at 0.5, 0.6, 0.8, 0.9; final message at 1.0
    m = request_metrics(Timeline(((0.5, 1), (0.6, 1), (0.8, 1), (0.9, 1)), end=1.0))
    assert m.ttft == 0.5
    assert m.itls == pytest.approx((0.1, 0.2, 0.1))
    assert m.tpot == pytest.approx((1.0 - 0.5) / 3)
    assert m.e2e == 1.0 and m.output_tokens == 4


def test_metrics_multi_token_deltas_count_as_gap_then_zeros():
    # first delta carries 2 tokens, the second 3: ITLs are [0] for the first delta's second token,
    # then the gap 0.4 and two zeros; n = 5 gives n - 1 = 4 ITLs summing to last - first arrival.
    m = request_metrics(Timeline(((0.2, 2), (0.6, 3)), end=0.7))
    assert m.output_tokens == 5
    assert m.itls == pytest.approx((0.0, 0.4, 0.0, 0.0))
    assert sum(m.itls) == pytest.approx(0.6 - 0.2)
    assert m.tpot == pytest.approx((0.7 - 0.2) / 4)


def test_metrics_single_token_and_empty_deltas():
    one = request_metrics(Timeline(((0.0, 0), (0.3, 1)), end=0.35))  # an empty delta is not the first token
    assert one.ttft == 0.3 and one.tpot is None and one.itls == ()
    none = request_metrics(Timeline((), end=2.0))
    assert none.ttft is None and none.output_tokens == 0 and none.e2e == 2.0


# --- goodput ---------------------------------------------------------------------------------------------


def _m(ttft: float, tpot_s: float, n: int = 11):
    """Metrics of an n-token request whose tokens arrive every tpot_s after the first."""
    deltas = tuple((ttft + i * tpot_s, 1) for i in range(n))
    return request_metrics(Timeline(deltas, end=ttft + (n - 1) * tpot_s))


def test_goodput_counts_requests_meeting_all_slos_over_all_sent():
    slo = SLO(ttft=0.5, tpot=0.05)
    succeeded = [
        _m(0.2, 0.01),  # meets both
        _m(0.5, 0.05),  # exactly at both limits: meets (<=)
        _m(0.6, 0.01),  # TTFT too slow
        _m(0.1, 0.08),  # TPOT too slow
    ]
    g = goodput(slo, succeeded, sent=5, duration_s=4.0)  # one more request was sent and failed
    assert (g.met, g.sent) == (2, 5)
    assert g.share == pytest.approx(0.4)
    assert g.requests_per_s == pytest.approx(0.5)


def test_slo_single_token_request_has_no_tpot_and_e2e_target():
    one_token = request_metrics(Timeline(((0.1, 1),), end=3.0))
    assert SLO(ttft=0.5, tpot=0.01).met_by(one_token)
    assert not SLO(e2e=2.0).met_by(one_token)
    assert not SLO(ttft=1.0).met_by(request_metrics(Timeline((), end=0.1)))


def test_parse_slo_and_its_errors():
    assert parse_slo("ttft=0.5,tpot=0.05") == SLO(ttft=0.5, tpot=0.05)
    assert parse_slo(" e2e=10 ") == SLO(e2e=10.0)
    for bad, message in [
        ("ttft", "NAME=SECONDS"),
        ("itl=0.1", "NAME=SECONDS"),
        ("ttft=fast", "ttft must be a number"),
        ("ttft=-1", "> 0"),
        ("ttft=1,ttft=2", "twice"),
        ("", "at least one"),
    ]:
        with pytest.raises(BenchConfigError, match=message) as info:
            parse_slo(bad)
        assert str(info.value).startswith("--slo:")


# --- report counts ---------------------------------------------------------------------------------------


def _record(index: int, outcome: Outcome, code: str | None = None, tokens: int = 3) -> RequestRecord:
    deltas = tuple((0.1 * (i + 1), 1) for i in range(tokens))
    return RequestRecord(index, 4, tokens, index * 0.5, Timeline(deltas, 0.1 * tokens + 0.05), outcome, code)


def _settings(**overrides) -> BenchSettings:
    base = dict(
        server="x:1", num_requests=5, rate=2.0, concurrency=None, burstiness=1.0,
        input_len=LengthDist("fixed", 4), output_len=LengthDist("fixed", 3), trace=None, seed=0,
        duration_s=None, drain_s=30.0, timeout_s=None, slo=SLO(ttft=0.15),
    )  # fmt: skip
    return BenchSettings(**{**base, **overrides})


def test_report_counts_reconcile_and_latencies_cover_succeeded_only():
    records = (
        _record(0, Outcome.SUCCEEDED),
        _record(1, Outcome.SUCCEEDED),
        _record(2, Outcome.FAILED, "UNAVAILABLE", tokens=0),
        _record(3, Outcome.FAILED, "DEADLINE_EXCEEDED", tokens=1),
        _record(4, Outcome.CANCELLED, tokens=2),
    )
    report = build_report(_settings(), "m", RunResult(records, duration_s=4.0))
    c = report.counts
    assert (c.sent, c.succeeded, c.failed, c.cancelled) == (5, 2, 2, 1)
    assert c.failed_by_code == {"DEADLINE_EXCEEDED": 1, "UNAVAILABLE": 1}
    assert report.output_token_throughput == pytest.approx(6 / 4.0)
    assert report.request_throughput == pytest.approx(0.5)
    assert report.ttft.count == 2 and report.itl.count == 4
    assert (
        report.goodput is not None and report.goodput.met == 2 and report.goodput.share == pytest.approx(0.4)
    )
    assert '"sent": 5' in report.to_json()


def test_failure_without_status_code_is_counted_as_unknown():
    counts = count_outcomes([_record(0, Outcome.FAILED), _record(1, Outcome.CANCELLED)])
    assert counts.failed_by_code == {"UNKNOWN": 1}
    assert counts.sent == counts.succeeded + counts.failed + counts.cancelled == 2


def test_a_closed_loop_reports_its_rate_while_every_slot_was_busy():
    """Two in flight, both sent at 0: full from 1.0 s (the later first token) to the last send at 3.0 s. Only the
    tokens that arrived in that window count, whatever the request's outcome; the run's own rate also counts
    the ramp and the drain."""

    def record(index: int, sent: float, deltas: tuple[tuple[float, int], ...], outcome=Outcome.SUCCEEDED):
        return RequestRecord(index, 4, 8, sent, Timeline(deltas, deltas[-1][0] if deltas else 0.5), outcome)

    records = (
        record(0, 0.0, ((0.5, 1), (1.5, 2), (2.5, 1), (3.5, 1))),  # 3 of its 5 tokens in [1, 3]
        record(1, 0.0, ((1.0, 1), (2.0, 1), (4.0, 1))),  # 2 of 3: its first token opens the window
        record(2, 3.0, ((0.2, 1), (0.4, 1)), Outcome.CANCELLED),  # sent last, its tokens after 3.0 s
        record(3, 2.0, ((0.5, 2), (1.5, 1)), Outcome.CANCELLED),  # 2 at 2.5 s inside, 1 at 3.5 s outside
    )
    report = build_report(_settings(rate=None, concurrency=2), "m", RunResult(records, duration_s=4.0))
    full = report.full_batch
    assert full is not None and (full.from_s, full.to_s) == (1.0, 3.0)
    assert full.output_tokens == 3 + 2 + 2 and full.output_tokens_per_s == pytest.approx(7 / 2.0)
    assert "while every slot was busy (1.0-3.0 s): 3.5 output tok/s" in format_summary(report)
    assert build_report(_settings(), "m", RunResult(records, duration_s=4.0)).full_batch is None  # open loop
    short = build_report(_settings(rate=None, concurrency=2), "m", RunResult(records[:2], duration_s=4.0))
    assert short.full_batch is None  # the last send (0 s) came before the batch was full
    no_token = (records[0], record(1, 0.0, (), Outcome.FAILED), records[2])
    failed = build_report(_settings(rate=None, concurrency=2), "m", RunResult(no_token, duration_s=4.0))
    assert failed.full_batch is None  # one of the first two never got a token


def test_settings_reject_bad_flags_by_name():
    with pytest.raises(BenchConfigError, match="exactly one of --rate and --concurrency"):
        _settings(concurrency=2)
    with pytest.raises(BenchConfigError, match="--rate: must be > 0"):
        _settings(rate=0.0)
    with pytest.raises(BenchConfigError, match="--num-requests"):
        _settings(num_requests=0)
    with pytest.raises(BenchConfigError, match="--duration"):
        _settings(duration_s=-1.0)
    with pytest.raises(BenchConfigError, match="--burstiness"):
        _settings(burstiness=0.0)


# --- DIST parsing ----------------------------------------------------------------------------------------


def test_parse_dist_forms():
    assert parse_dist("256", "--input-len") == LengthDist("fixed", 256)
    assert parse_dist("uniform:2048:4096", "--input-len") == LengthDist("uniform", 2048, 4096)
    assert parse_dist("normal:512:64", "--output-len") == LengthDist("normal", 512.0, 64.0)
    assert parse_dist("uniform:2:9", "--x").describe() == "uniform:2:9"


@pytest.mark.parametrize(
    "text, message",
    [
        ("0", "must be >= 1"),
        ("abc", "must be an integer"),
        ("1.5", "must be an integer"),
        ("poisson:3:4", "unknown distribution"),
        ("uniform:5", "takes two numbers"),
        ("uniform:9:2", "LOW <= HIGH"),
        ("uniform:0:2", "LOW <= HIGH"),
        ("uniform:a:2", "uniform LOW must be an integer"),
        ("normal:512:-1", "STDDEV >= 0"),
        ("normal:nan:1", "finite"),
    ],
)
def test_parse_dist_rejects_bad_values_naming_the_flag(text, message):
    with pytest.raises(BenchConfigError, match=message) as info:
        parse_dist(text, "--output-len")
    assert str(info.value).startswith("--output-len:")


def test_samples_stay_in_range_and_prompts_avoid_special_ids():
    specs = build_requests(
        200, parse_dist("uniform:3:7", "--input-len"), parse_dist("normal:5:3", "--output-len"), 1000, seed=1
    )
    low, high = safe_id_range(1000)
    assert (low, high) == (100, 900)
    assert {len(s.prompt_token_ids) for s in specs} == set(range(3, 8))
    assert all(1 <= s.output_len <= 17 for s in specs)  # normal clamped to [1, mean + 4 stddev]
    assert all(low <= i < high for s in specs for i in s.prompt_token_ids)
    again = build_requests(
        200, parse_dist("uniform:3:7", "--input-len"), parse_dist("normal:5:3", "--output-len"), 1000, seed=1
    )
    assert again == specs


def test_a_shared_prefix_starts_every_prompt_and_does_not_depend_on_the_seed():
    dist = parse_dist("uniform:3:7", "--input-len")
    out = parse_dist("4", "--output-len")
    a = build_requests(50, dist, out, 1000, seed=1, shared_prefix=32)
    b = build_requests(50, dist, out, 1000, seed=2, shared_prefix=32)
    prefix = a[0].prompt_token_ids[:32]
    assert len(set(prefix)) > 1  # random ids, not one repeated token
    assert all(s.prompt_token_ids[:32] == prefix for s in a + b)
    assert {len(s.prompt_token_ids) for s in a} == set(range(35, 40))  # prefix + the drawn input_len
    plain = build_requests(50, dist, out, 1000, seed=1)
    assert [s.prompt_token_ids[32:] for s in a] == [s.prompt_token_ids for s in plain]  # same own tokens


# --- arrivals --------------------------------------------------------------------------------------------


def _gaps(offsets: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(offsets)]


def test_gamma_arrivals_are_seeded_and_average_one_over_rate():
    a = arrival_offsets(4000, rate=5.0, burstiness=1.0, seed=7)
    assert a == arrival_offsets(4000, rate=5.0, burstiness=1.0, seed=7)
    assert a != arrival_offsets(4000, rate=5.0, burstiness=1.0, seed=8)
    gaps = _gaps(a)
    assert a[0] == 0.0 and min(gaps) >= 0
    # mean 0.2 s; the standard error over 3999 exponential gaps is 0.2 / sqrt(3999) = 0.0032
    assert statistics.fmean(gaps) == pytest.approx(0.2, abs=0.015)
    # Poisson (shape 1): the coefficient of variation of the gaps is 1
    assert statistics.stdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, abs=0.1)


def test_burstiness_changes_spread_not_mean():
    bursty = _gaps(arrival_offsets(4000, 5.0, 0.25, 3))
    regular = _gaps(arrival_offsets(4000, 5.0, 4.0, 3))
    for gaps in (bursty, regular):
        assert statistics.fmean(gaps) == pytest.approx(0.2, abs=0.03)
    # coefficient of variation of a gamma with shape k is 1 / sqrt(k): 2 for k = 0.25, 0.5 for k = 4
    assert statistics.stdev(bursty) / statistics.fmean(bursty) == pytest.approx(2.0, rel=0.2)
    assert statistics.stdev(regular) / statistics.fmean(regular) == pytest.approx(0.5, rel=0.1)


def test_infinite_rate_sends_all_at_once_and_bad_rates_are_rejected():
    assert arrival_offsets(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]
    with pytest.raises(BenchConfigError, match="--rate"):
        arrival_offsets(3, 0.0, 1.0, 0)
    with pytest.raises(BenchConfigError, match="--burstiness"):
        arrival_offsets(3, 1.0, -1.0, 0)


# --- sweeps and plots ------------------------------------------------------------------------------------


def test_capacity_is_the_last_rate_before_the_first_miss():
    points = [(4.0, 0.95), (1.0, 1.0), (2.0, 0.92), (8.0, 0.4), (6.0, 0.91), (5.0, 0.85)]
    assert capacity(points, 0.9) == 4.0  # 5.0 misses; the lucky 6.0 after it does not count
    assert capacity([(1.0, 0.5)], 0.9) == 0.0
    assert capacity([(1.0, 0.9)], 0.9) == 1.0  # the target is inclusive


def test_equal_load_picks_the_highest_rate_both_sustain():
    disagg = [(1.0, 1.0), (2.0, 1.0), (3.0, 0.95), (4.0, 0.5)]
    colocated = [(1.0, 1.0), (2.0, 0.93), (3.0, 0.6)]
    assert equal_load(disagg, colocated, 0.9) == 2.0
    assert (
        equal_load([(1.0, 0.2), (2.0, 0.1)], [(2.0, 0.5), (1.0, 0.3)], 0.9) == 1.0
    )  # none sustained: lowest
    assert equal_load([(1.0, 1.0)], [(2.0, 1.0)], 0.9) is None


def test_plots_write_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    samples = LatencySamples(ttft=(0.1, 0.2, 0.4), tpot=(0.01, 0.02), e2e=(1.0, 1.5, 2.0))
    cdf = plot_latency_cdfs({"a": samples, "b": samples}, tmp_path / "cdf.png", slo=SLO(ttft=0.5))
    sweep = plot_goodput_vs_rate({"a": [(1.0, 100.0), (2.0, 80.0)]}, tmp_path / "sub" / "goodput.png")
    for path in (cdf, sweep):
        assert path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plots_are_skipped_with_a_warning_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    with pytest.warns(UserWarning, match="matplotlib is not installed"):
        assert plot_goodput_vs_rate({"a": [(1.0, 1.0)]}, tmp_path / "g.png") is None
    assert not (tmp_path / "g.png").exists()


def test_the_disagg_benchmark_warns_when_its_drain_cut_requests_short():
    """bench/dvc_points.drain_warning: cancelled requests count as SLO misses; a run whose drain is shorter than
    its outputs take must say so (run 32 read 36-87% cancellations as a capacity limit)."""
    from bench.dvc_points import drain_warning

    whole = build_report(
        _settings(), "m", RunResult((_record(0, Outcome.SUCCEEDED), _record(1, Outcome.SUCCEEDED)), 2.0)
    )
    assert drain_warning(whole, 8.0) == ""
    cut = build_report(
        _settings(),
        "m",
        RunResult(
            (
                _record(0, Outcome.SUCCEEDED, tokens=5),
                _record(1, Outcome.CANCELLED),
                _record(2, Outcome.CANCELLED),
            ),
            2.0,
        ),
    )
    line = drain_warning(cut, 8.0)
    assert line.startswith("2 of 3 requests were still running 8 s after the last one was sent")
    assert (
        f"the slowest finished request took {cut.requests[0].e2e:.1f} s" in line and "raise --drain" in line
    )
