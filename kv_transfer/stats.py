"""Transfer counters as a plain snapshot, for the observability layer to export.

Counters only grow; `TransferStats` is a frozen copy taken under the recorder's lock. Seconds go into a
cumulative histogram with fixed bounds (Prometheus style: count of transfers that took <= bound); so does each
phase of a completed transfer (SendResult.phases, TransferResult.phases, and what the worker adds: the decode
worker's "admit", from landing to the request joining the batch), on finer bounds.
"""

from __future__ import annotations

import bisect
import math
import threading
from dataclasses import dataclass, field

from kv_transfer.contracts import FailureReason

SECONDS_BOUNDS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    math.inf,
)

PHASE_BOUNDS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
    math.inf,
)

Buckets = tuple[tuple[float, int], ...]  # (upper bound, cumulative count)


@dataclass(frozen=True)
class PhaseStats:
    count: int
    seconds_sum: float
    buckets: Buckets


@dataclass(frozen=True)
class TransferStats:
    transfers_ok: int = 0
    transfers_failed: int = 0
    bytes_ok: int = 0  # bytes of KV moved by transfers that completed
    seconds_sum: float = 0.0  # summed over transfers that completed
    seconds_buckets: Buckets = ()
    failures: dict[FailureReason, int] = field(default_factory=dict)
    active_leases: int = 0  # receiver: leases reserved and not yet landed or failed
    active_transfers: int = 0  # sender: sends started and not yet finished
    phases: dict[str, PhaseStats] = field(default_factory=dict)
    # receiver: connections or transfers refused before any byte landed, by reason ("tls_handshake", or the
    # lease refusal: "unknown_handle", "handle_reused", ...): what a forged or misconfigured peer shows up as
    refused: dict[str, int] = field(default_factory=dict)
    armed_ok: int = 0  # receiver: transfers_ok that landed through a doorbell (kv_transfer.doorbell)


class _Histogram:
    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.total = 0.0
        self.n = 0

    def add(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.total += seconds
        self.n += 1

    def cumulative(self) -> Buckets:
        running, out = 0, []
        for bound, count in zip(self.bounds, self.counts):
            running += count
            out.append((bound, running))
        return tuple(out)


class StatsRecorder:
    """Thread-safe accumulation behind a TransferStats snapshot."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ok = 0
        self._failed = 0
        self._bytes = 0
        self._seconds = _Histogram(SECONDS_BOUNDS)
        self._phases: dict[str, _Histogram] = {}
        self._failures: dict[FailureReason, int] = {}
        self._refused: dict[str, int] = {}
        self._armed = 0

    def record_refused(self, reason: str) -> None:
        with self._lock:
            self._refused[reason] = self._refused.get(reason, 0) + 1

    def record_ok(
        self, num_bytes: int, seconds: float, phases: dict[str, float] | None = None, armed: bool = False
    ) -> None:
        with self._lock:
            self._ok += 1
            self._armed += armed
            self._bytes += num_bytes
            self._seconds.add(seconds)
        for name, value in (phases or {}).items():
            self.record_phase(name, value)

    def record_phase(self, name: str, seconds: float) -> None:
        with self._lock:
            self._phases.setdefault(name, _Histogram(PHASE_BOUNDS)).add(seconds)

    def record_failure(self, reason: FailureReason) -> None:
        with self._lock:
            self._failed += 1
            self._failures[reason] = self._failures.get(reason, 0) + 1

    def snapshot(self, active_leases: int = 0, active_transfers: int = 0) -> TransferStats:
        with self._lock:
            return TransferStats(
                self._ok,
                self._failed,
                self._bytes,
                self._seconds.total,
                self._seconds.cumulative(),
                dict(self._failures),
                active_leases,
                active_transfers,
                {name: PhaseStats(h.n, h.total, h.cumulative()) for name, h in self._phases.items()},
                dict(self._refused),
                self._armed,
            )
