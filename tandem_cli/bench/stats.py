"""Latency arithmetic for the load generator: per-request metrics from a stream's timeline, percentiles,
summaries and goodput under SLOs. Pure functions on plain numbers (no numpy), so they are easy to check by hand.

Definitions (all in seconds, on the client's monotonic clock, from the moment the request was sent):

    sent          first delta (k1 tokens)     delta (k2 tokens)   ...   final message
     |-------------------|--------------------------|----------------------|
     0                  TTFT                        t2                     e2e

- TTFT: arrival of the first delta that carries tokens.
- ITL (per token): a delta carrying k tokens counts as k tokens arriving together: the first of them gets the
  gap since the previous delta, the other k - 1 get 0. The first delta's tokens get k1 - 1 zeros (its first
  token is the TTFT, not an ITL). So a request with n output tokens gives exactly n - 1 ITL values and they
  sum to (last token arrival - first token arrival).
- TPOT (per request): (e2e - TTFT) / (n - 1); undefined (None) for n <= 1.
- e2e: arrival of the final message.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from tandem_cli.bench.workload import BenchConfigError

SLO_METRICS = ("ttft", "tpot", "e2e")


@dataclass(frozen=True)
class Timeline:
    """When one request's token deltas arrived: (seconds since sent, tokens in that delta), and the end."""

    deltas: tuple[tuple[float, int], ...]
    end: float  # arrival of the final message (or of the failure)

    @property
    def output_tokens(self) -> int:
        return sum(k for _, k in self.deltas)


@dataclass(frozen=True)
class RequestMetrics:
    ttft: float | None
    tpot: float | None
    e2e: float
    itls: tuple[float, ...]
    output_tokens: int


def request_metrics(timeline: Timeline) -> RequestMetrics:
    """TTFT, TPOT, ITLs and e2e of one request (definitions in the module doc)."""
    token_deltas = [(t, k) for t, k in timeline.deltas if k > 0]
    n = sum(k for _, k in token_deltas)
    if not token_deltas:
        return RequestMetrics(None, None, timeline.end, (), 0)
    ttft = token_deltas[0][0]
    itls: list[float] = [0.0] * (token_deltas[0][1] - 1)
    for (prev, _), (t, k) in itertools.pairwise(token_deltas):
        itls.append(t - prev)
        itls.extend([0.0] * (k - 1))
    tpot = (timeline.end - ttft) / (n - 1) if n > 1 else None
    return RequestMetrics(ttft, tpot, timeline.end, tuple(itls), n)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100): numpy.percentile's default, linear interpolation between the
    closest ranks (rank = (n - 1) * q / 100 on the sorted values)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    import numpy  # here, not at module level: `tandem` starts without numpy unless it computes statistics

    return float(numpy.percentile(values, q))


@dataclass(frozen=True)
class Summary:
    """count values; the statistics are None when there are none."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None


def summarize(values: Sequence[float]) -> Summary:
    if not values:
        return Summary(0, None, None, None, None, None)
    return Summary(
        count=len(values),
        mean=math.fsum(values) / len(values),
        p50=percentile(values, 50),
        p90=percentile(values, 90),
        p99=percentile(values, 99),
        max=max(values),
    )


@dataclass(frozen=True)
class SLO:
    """Per-request latency targets in seconds; None means no target on that metric."""

    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None

    def is_empty(self) -> bool:
        return self.ttft is None and self.tpot is None and self.e2e is None

    def met_by(self, metrics: RequestMetrics) -> bool:
        return self.meets(metrics.ttft, metrics.tpot, metrics.e2e)

    def meets(self, ttft: float | None, tpot: float | None, e2e: float) -> bool:
        """True when every given target is met. A request with one output token has no TPOT and meets any
        TPOT target; a request with no token at all meets no TTFT target."""
        if self.ttft is not None and (ttft is None or ttft > self.ttft):
            return False
        if self.tpot is not None and tpot is not None and tpot > self.tpot:
            return False
        return self.e2e is None or e2e <= self.e2e

    def describe(self) -> str:
        parts = [f"{name}={getattr(self, name)}" for name in SLO_METRICS if getattr(self, name) is not None]
        return ",".join(parts)


def parse_slo(text: str, flag: str = "--slo") -> SLO:
    """ "ttft=0.5,tpot=0.05" -> SLO (seconds); keys: ttft, tpot, e2e, each at most once."""
    values: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or key not in SLO_METRICS:
            raise BenchConfigError(
                f"{flag}: expected NAME=SECONDS with NAME in {', '.join(SLO_METRICS)}, got {item!r}"
            )
        if key in values:
            raise BenchConfigError(f"{flag}: {key} given twice")
        try:
            value = float(raw)
        except ValueError:
            raise BenchConfigError(f"{flag}: {key} must be a number of seconds, got {raw!r}") from None
        if not (value > 0 and math.isfinite(value)):
            raise BenchConfigError(f"{flag}: {key} must be a finite number of seconds > 0, got {raw!r}")
        values[key] = value
    if not values:
        raise BenchConfigError(f"{flag}: give at least one target, e.g. ttft=0.5,tpot=0.05")
    return SLO(**values)


@dataclass(frozen=True)
class Goodput:
    """Requests that succeeded AND met every SLO. `share` is over all requests sent (a failed or cancelled
    request never meets the SLOs); `requests_per_s` divides by the benchmark's duration."""

    slo: SLO
    met: int
    sent: int
    share: float
    requests_per_s: float


def goodput(slo: SLO, succeeded: Sequence[RequestMetrics], sent: int, duration_s: float) -> Goodput:
    if sent < len(succeeded):
        raise ValueError(f"goodput: {len(succeeded)} succeeded but only {sent} sent")
    met = sum(1 for m in succeeded if slo.met_by(m))
    share = met / sent if sent else 0.0
    rate = met / duration_s if duration_s > 0 else 0.0
    return Goodput(slo, met, sent, share, rate)
