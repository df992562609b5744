"""`RecentLatency`: the latency of the requests that ended in the last few minutes, for the SLO autoscaler.

The Prometheus histograms (router.prometheus) count since the router started; a scaling decision needs the
recent past only. Each request that ends adds one sample (when it ended, its TTFT, its TPOT); `counts(window_s)`
buckets the samples of the last `window_s` seconds over fixed bounds, and `LatencyCounts.stats()` reads the p90
of each from the buckets. Buckets, not raw samples, so that the windows of several routers (Kubernetes runs a
Deployment of them) add up exactly: the controller asks each over Admin.Status and sums.

    TTFT = arrival -> first output token
    TPOT = (end - first token) / (completion_tokens - 1)      (the mean gap; only with >= 2 output tokens)

    bounds: 1 ms * 1.1^i up to 600 s; a p90 reads as the geometric middle of its bucket (within 5% of the truth)

A request whose deadline passed before its first token counts with TTFT = its whole time (a lower bound): such
requests are the clearest TTFT misses of all. Cancelled and refused requests add nothing.

Samples older than MAX_WINDOW_S, and past MAX_SAMPLES, are dropped: memory is bounded whatever the traffic.
Thread-safe: the router's event loop records, the autoscaler's thread or Admin.Status reads.
"""

from __future__ import annotations

import bisect
import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tandem_api.tandem.v1 import admin_pb2

MAX_WINDOW_S = 600.0
MAX_SAMPLES = 50_000
QUANTILE = 0.9
_FIRST_BOUND_S, _RATIO = 0.001, 1.1
BOUNDS: tuple[float, ...] = tuple(
    _FIRST_BOUND_S * _RATIO**i for i in range(math.ceil(math.log(MAX_WINDOW_S / _FIRST_BOUND_S, _RATIO)) + 1)
)


@dataclass(frozen=True)
class WindowStats:
    """The p90s of one window; a p90 is None when no request in the window gave that measurement."""

    window_s: float
    requests: int  # requests with a TTFT sample
    ttft_p90_s: float | None
    tpot_requests: int  # requests with >= 2 output tokens (a TPOT sample)
    tpot_p90_s: float | None


def bucket_quantile(counts: Sequence[int], q: float = QUANTILE) -> float | None:
    """The q-quantile of bucketed values (nearest rank), read as the geometric middle of its bucket."""
    total = sum(counts)
    if total == 0:
        return None
    rank = max(1, math.ceil(q * total))
    i = bisect.bisect_left(list(itertools.accumulate(counts)), rank)
    if i == 0:
        return BOUNDS[0]
    if i >= len(BOUNDS):
        return BOUNDS[-1]
    return math.sqrt(BOUNDS[i - 1] * BOUNDS[i])


def _bucket(value: float) -> int:
    return bisect.bisect_left(BOUNDS, value)  # the first bound >= value; len(BOUNDS): above them all


@dataclass(frozen=True)
class LatencyCounts:
    """One window's requests, bucketed over BOUNDS (len(BOUNDS) + 1 counts each; empty tuples mean none)."""

    window_s: float
    ttft: tuple[int, ...] = ()
    tpot: tuple[int, ...] = ()

    def stats(self) -> WindowStats:
        return WindowStats(
            self.window_s,
            sum(self.ttft),
            bucket_quantile(self.ttft),
            sum(self.tpot),
            bucket_quantile(self.tpot),
        )

    def merged(self, other: LatencyCounts) -> LatencyCounts:
        return LatencyCounts(self.window_s, _add(self.ttft, other.ttft), _add(self.tpot, other.tpot))

    def to_proto(self) -> admin_pb2.RecentLatency:
        return admin_pb2.RecentLatency(
            window_seconds=self.window_s, ttft_counts=self.ttft, tpot_counts=self.tpot
        )

    @classmethod
    def from_proto(cls, message: admin_pb2.RecentLatency, where: str) -> LatencyCounts:
        """Raises ValueError naming `where` when the counts are not over this version's bounds."""
        for name in ("ttft_counts", "tpot_counts"):
            n = len(getattr(message, name))
            if n not in (0, len(BOUNDS) + 1):
                raise ValueError(
                    f"{where}: recent_latency.{name} has {n} buckets, this controller expects "
                    f"{len(BOUNDS) + 1}: the router runs another Tandem version"
                )
        return cls(message.window_seconds, tuple(message.ttft_counts), tuple(message.tpot_counts))


def _add(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    if not a or not b:
        return a or b
    return tuple(x + y for x, y in zip(a, b, strict=True))


class RecentLatency:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._samples: deque[tuple[float, float, float | None]] = deque(maxlen=MAX_SAMPLES)
        self._lock = threading.Lock()

    def record(self, ttft_s: float, tpot_s: float | None) -> None:
        now = self._clock()
        with self._lock:
            self._samples.append((now, ttft_s, tpot_s))
            while self._samples and self._samples[0][0] < now - MAX_WINDOW_S:
                self._samples.popleft()

    def counts(self, window_s: float) -> LatencyCounts:
        """The requests that ended in the last `window_s` seconds (at most MAX_WINDOW_S)."""
        window_s = min(window_s, MAX_WINDOW_S)
        since = self._clock() - window_s
        with self._lock:
            recent = list(itertools.takewhile(lambda s: s[0] >= since, reversed(self._samples)))
        ttft, tpot = [0] * (len(BOUNDS) + 1), [0] * (len(BOUNDS) + 1)
        for _, ttft_s, tpot_s in recent:
            ttft[_bucket(ttft_s)] += 1
            if tpot_s is not None:
                tpot[_bucket(tpot_s)] += 1
        return LatencyCounts(window_s, tuple(ttft), tuple(tpot))

    def stats(self, window_s: float) -> WindowStats:
        return self.counts(window_s).stats()
