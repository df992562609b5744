"""The benchmark report: counts, latency summaries, throughput and goodput, as a frozen dataclass and as JSON.

Counts always reconcile: sent = succeeded + failed + cancelled; build_report refuses records that do not.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import subprocess
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tandem_cli.bench.loadgen import Outcome, RequestRecord, RunResult
from tandem_cli.bench.stats import (
    SLO,
    Goodput,
    RequestMetrics,
    Summary,
    goodput,
    request_metrics,
    summarize,
)
from tandem_cli.bench.transports import PROTOCOLS
from tandem_cli.bench.workload import BenchConfigError, LengthDist


@dataclass(frozen=True)
class BenchSettings:
    """What was run, recorded next to the results so a number can be traced to its configuration."""

    server: str
    num_requests: int
    rate: float | None  # requests/s (open loop); None in closed loop; inf means all at once
    concurrency: int | None  # closed loop
    burstiness: float
    input_len: LengthDist  # ignored with a trace
    output_len: LengthDist
    trace: str | None  # JSONL path
    seed: int
    duration_s: float | None
    drain_s: float
    timeout_s: float | None
    slo: SLO
    protocol: str = "grpc"  # or "openai": the router's OpenAI-compatible HTTP API
    shared_prefix: int = 0  # tokens every prompt starts with (a shared system prompt), before input_len
    processes: int = 1  # client processes sending shares of the load (tandem_cli.bench.processes)
    # Seconds of the same load sent first and not counted (tandem_cli.bench.cli.warm_up_settings); 0: none
    warm_up_s: float = 0.0

    def __post_init__(self) -> None:
        if (self.rate is None) == (self.concurrency is None):
            raise BenchConfigError("give exactly one of --rate and --concurrency")
        if self.rate is not None and not self.rate > 0:
            raise BenchConfigError(f"--rate: must be > 0, got {self.rate}")
        if self.concurrency is not None and self.concurrency < 1:
            raise BenchConfigError(f"--concurrency: must be >= 1, got {self.concurrency}")
        if self.num_requests < 1:
            raise BenchConfigError(f"--num-requests: must be >= 1, got {self.num_requests}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise BenchConfigError(f"--burstiness: must be a finite number > 0, got {self.burstiness}")
        for flag, value in (("--duration", self.duration_s), ("--timeout", self.timeout_s)):
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise BenchConfigError(f"{flag}: must be a finite number of seconds > 0, got {value}")
        if self.protocol not in PROTOCOLS:
            raise BenchConfigError(
                f"--protocol: must be one of {', '.join(PROTOCOLS)}, got {self.protocol!r}"
            )
        if self.shared_prefix < 0:
            raise BenchConfigError(f"--shared-prefix: must be >= 0 tokens, got {self.shared_prefix}")
        if self.processes < 1:
            raise BenchConfigError(f"--processes: must be >= 1, got {self.processes}")
        if not (self.drain_s >= 0 and math.isfinite(self.drain_s)):
            raise BenchConfigError(f"--drain: must be a finite number of seconds >= 0, got {self.drain_s}")
        if not (self.warm_up_s >= 0 and math.isfinite(self.warm_up_s)):
            raise BenchConfigError(
                f"--warm-up: must be a finite number of seconds >= 0, got {self.warm_up_s}"
            )
        if self.warm_up_s and self.trace:
            raise BenchConfigError(
                "--warm-up: not with --trace (the warm-up would send the trace's own prompts, and the measured "
                "run would find them in the prefix cache)"
            )


@dataclass(frozen=True)
class Counts:
    sent: int
    succeeded: int
    failed: int
    cancelled: int
    failed_by_code: dict[str, int]  # gRPC status name -> requests


@dataclass(frozen=True)
class RequestRow:
    """One request in the JSON, so distributions can be re-plotted or re-cut without rerunning."""

    index: int
    outcome: str
    error_code: str | None
    input_len: int
    output_tokens: int
    sent_at: float
    ttft: float | None
    tpot: float | None
    e2e: float
    first_itl: float | None = None  # first token -> second token: the KV handoff shows here in disaggregation
    cached_tokens: int | None = (
        None  # prompt tokens served from the prefix cache; None if the server did not say
    )


@dataclass(frozen=True)
class PrefixCacheUse:
    """Prompt tokens of the succeeded requests whose server reported its prefix-cache use, and how many of them
    the cache served (usage.cached_prompt_tokens)."""

    prompt_tokens: int
    cached_tokens: int

    @property
    def share(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True)
class FullBatch:
    """A closed-loop run's output tokens/s while every slot was busy: from the moment the first `concurrency`
    requests (sent together) all had their first token to the last send, after which the run stops refilling
    and its batch drains. The run's own rate also counts that ramp and drain, which a job of hours does not
    have. Every token that arrived in the window counts, whatever its request's outcome."""

    from_s: float  # seconds since the run started
    to_s: float
    output_tokens: int
    output_tokens_per_s: float


@dataclass(frozen=True)
class BenchReport:
    settings: BenchSettings
    model: str  # the served model's id (ListModels)
    counts: Counts
    duration_s: float
    request_throughput: float  # succeeded requests / s
    output_token_throughput: float  # output tokens of succeeded requests / s
    input_token_throughput: float  # prompt tokens of succeeded requests / s
    ttft: Summary
    tpot: Summary
    itl: Summary
    e2e: Summary
    goodput: Goodput | None  # None without --slo
    commit: str | None
    host: str
    finished_at: str  # UTC, ISO 8601
    requests: tuple[RequestRow, ...]
    prefix_cache: PrefixCacheUse | None = None  # None when no succeeded request reported it
    # Closed loop (--concurrency) with a window of at least MIN_FULL_BATCH_S; None otherwise
    full_batch: FullBatch | None = None

    def to_json(self) -> str:
        return json.dumps(_jsonable(dataclasses.asdict(self)), indent=2)


def _jsonable(value: object) -> object:
    """inf/nan are not JSON: write them as strings (an infinite --rate means "all at once")."""
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return str(value)
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def count_outcomes(records: Sequence[RequestRecord]) -> Counts:
    by_outcome = Counter(r.outcome for r in records)
    codes = Counter(r.error_code or "UNKNOWN" for r in records if r.outcome is Outcome.FAILED)
    counts = Counts(
        sent=len(records),
        succeeded=by_outcome[Outcome.SUCCEEDED],
        failed=by_outcome[Outcome.FAILED],
        cancelled=by_outcome[Outcome.CANCELLED],
        failed_by_code=dict(sorted(codes.items())),
    )
    if counts.sent != counts.succeeded + counts.failed + counts.cancelled or counts.failed != sum(
        codes.values()
    ):
        raise RuntimeError(f"bench counts do not reconcile: {counts}")
    return counts


EXPORT_COMMIT = Path(__file__).with_name("export_commit.txt")  # `git archive` writes the commit into it


def git_commit(repo: Path | None = None) -> str | None:
    """HEAD of the checkout this code runs from, with "-dirty" when tracked files changed; for a `git archive`
    export (no checkout of its own, perhaps inside another one) the commit the archive was made from, from
    EXPORT_COMMIT (export-subst in .gitattributes); None when neither says. TANDEM_COMMIT, when set, wins over
    both: a copy of the tree whose `.git` is not the one it was copied from (a GPU machine's copy of a working tree)
    would otherwise report that `.git`'s HEAD."""
    stamped = os.environ.get("TANDEM_COMMIT", "").strip()
    if stamped and repo is None:
        return stamped
    where = (repo or Path(__file__).resolve().parents[2]).resolve()

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=where, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()

    try:
        own = Path(git("rev-parse", "--show-toplevel")).resolve() == where
        if own:
            dirty = git("status", "--porcelain", "--untracked-files=no")
            head = git("rev-parse", "HEAD")
            return f"{head}-dirty" if dirty else head
    except (OSError, subprocess.SubprocessError):
        pass
    exported = EXPORT_COMMIT.read_text().strip() if EXPORT_COMMIT.exists() and repo is None else ""
    return exported if len(exported) == 40 and all(c in "0123456789abcdef" for c in exported) else None


def _row(record: RequestRecord, metrics: RequestMetrics) -> RequestRow:
    return RequestRow(
        index=record.index,
        outcome=record.outcome.value,
        error_code=record.error_code,
        input_len=record.input_len,
        output_tokens=metrics.output_tokens,
        sent_at=record.sent_at,
        ttft=metrics.ttft,
        tpot=metrics.tpot,
        e2e=metrics.e2e,
        first_itl=metrics.itls[0] if metrics.itls else None,
        cached_tokens=record.cached_tokens,
    )


def build_report(
    settings: BenchSettings, model: str, run: RunResult, commit: str | None = None
) -> BenchReport:
    """Latency statistics cover succeeded requests only; goodput's share counts every request sent."""
    counts = count_outcomes(run.records)
    metrics = [request_metrics(r.timeline) for r in run.records]
    ok = [(r, m) for r, m in zip(run.records, metrics, strict=True) if r.outcome is Outcome.SUCCEEDED]
    ok_metrics = [m for _, m in ok]
    seconds = run.duration_s
    per_s = (lambda n: n / seconds) if seconds > 0 else (lambda n: 0.0)
    return BenchReport(
        settings=settings,
        model=model,
        counts=counts,
        duration_s=seconds,
        request_throughput=per_s(len(ok)),
        output_token_throughput=per_s(sum(m.output_tokens for m in ok_metrics)),
        input_token_throughput=per_s(sum(r.input_len for r, _ in ok)),
        ttft=summarize([m.ttft for m in ok_metrics if m.ttft is not None]),
        tpot=summarize([m.tpot for m in ok_metrics if m.tpot is not None]),
        itl=summarize([itl for m in ok_metrics for itl in m.itls]),
        e2e=summarize([m.e2e for m in ok_metrics]),
        goodput=None if settings.slo.is_empty() else goodput(settings.slo, ok_metrics, counts.sent, seconds),
        commit=commit,
        host=platform.node(),
        finished_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        requests=tuple(_row(r, m) for r, m in zip(run.records, metrics, strict=True)),
        prefix_cache=prefix_cache_use([r for r, _ in ok]),
        full_batch=full_batch(run.records, settings.concurrency) if settings.concurrency else None,
    )


MIN_FULL_BATCH_S = 1.0  # a shorter window says little: no full-batch rate


def full_batch(records: Sequence[RequestRecord], concurrency: int) -> FullBatch | None:
    """FullBatch of a closed-loop run's records, from each token delta's arrival time; None when the first
    `concurrency` requests did not all get a token, or the window is shorter than MIN_FULL_BATCH_S."""
    first = sorted(records, key=lambda r: r.sent_at)[:concurrency]
    firsts = [next((r.sent_at + t for t, k in r.timeline.deltas if k > 0), None) for r in first]
    if len(first) < concurrency or any(t is None for t in firsts):
        return None
    start = max(t for t in firsts if t is not None)
    end = max(r.sent_at for r in records)
    if end - start < MIN_FULL_BATCH_S:
        return None
    tokens = sum(k for r in records for t, k in r.timeline.deltas if k > 0 and start <= r.sent_at + t <= end)
    return FullBatch(start, end, tokens, tokens / (end - start))


def prefix_cache_use(records: Sequence[RequestRecord]) -> PrefixCacheUse | None:
    reported = [r for r in records if r.cached_tokens is not None]
    if not reported:
        return None
    return PrefixCacheUse(sum(r.input_len for r in reported), sum(r.cached_tokens or 0 for r in reported))


def format_summary(report: BenchReport) -> str:
    """The human-readable table printed after a run."""
    c = report.counts
    lines = [
        f"requests: sent {c.sent}, succeeded {c.succeeded}, failed {c.failed}"
        + (f" {c.failed_by_code}" if c.failed_by_code else "")
        + f", cancelled {c.cancelled}  in {report.duration_s:.2f} s",
        f"throughput: {report.request_throughput:.2f} req/s, {report.output_token_throughput:.1f} output tok/s",
        f"{'(ms)':<6}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for name in ("ttft", "tpot", "itl", "e2e"):
        s: Summary = getattr(report, name)
        cells = [s.mean, s.p50, s.p90, s.p99]
        lines.append(f"{name:<6}" + "".join(f"{'-' if v is None else f'{v * 1e3:.1f}':>10}" for v in cells))
    if report.prefix_cache is not None and (
        report.settings.shared_prefix or report.prefix_cache.cached_tokens
    ):
        p = report.prefix_cache
        lines.append(
            f"prefix cache: {p.cached_tokens}/{p.prompt_tokens} = {p.share:.1%} of prompt tokens served from it"
        )
    if report.full_batch is not None:
        f = report.full_batch
        lines.append(
            f"while every slot was busy ({f.from_s:.1f}-{f.to_s:.1f} s): {f.output_tokens_per_s:.1f} output tok/s"
        )
    if report.goodput is not None:
        g = report.goodput
        lines.append(
            f"goodput ({g.slo.describe()}): {g.met}/{g.sent} = {g.share:.1%} of requests, {g.requests_per_s:.2f} req/s"
        )
    return "\n".join(lines)
