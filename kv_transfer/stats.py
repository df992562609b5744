"""Transfer counters as a plain snapshot, for the observability layer to export.

Counters only grow; `TransferStats` is a frozen copy taken under the recorder's lock. Seconds go into a
cumulative histogram with fixed bounds (Prometheus style: count of transfers that took <= bound).
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


@dataclass(frozen=True)
class TransferStats:
    transfers_ok: int = 0
    transfers_failed: int = 0
    bytes_ok: int = 0  # bytes of KV moved by transfers that completed
    seconds_sum: float = 0.0  # summed over transfers that completed
    seconds_buckets: tuple[tuple[float, int], ...] = ()  # (upper bound, cumulative count)
    failures: dict[FailureReason, int] = field(default_factory=dict)
    active_leases: int = 0  # receiver: leases reserved and not yet landed or failed
    active_transfers: int = 0  # sender: sends started and not yet finished


class StatsRecorder:
    """Thread-safe accumulation behind a TransferStats snapshot."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ok = 0
        self._failed = 0
        self._bytes = 0
        self._seconds = 0.0
        self._bucket_counts = [0] * len(SECONDS_BOUNDS)
        self._failures: dict[FailureReason, int] = {}

    def record_ok(self, num_bytes: int, seconds: float) -> None:
        with self._lock:
            self._ok += 1
            self._bytes += num_bytes
            self._seconds += seconds
            self._bucket_counts[bisect.bisect_left(SECONDS_BOUNDS, seconds)] += 1

    def record_failure(self, reason: FailureReason) -> None:
        with self._lock:
            self._failed += 1
            self._failures[reason] = self._failures.get(reason, 0) + 1

    def snapshot(self, active_leases: int = 0, active_transfers: int = 0) -> TransferStats:
        with self._lock:
            running = 0
            buckets = []
            for bound, count in zip(SECONDS_BOUNDS, self._bucket_counts):
                running += count
                buckets.append((bound, running))
            return TransferStats(
                self._ok,
                self._failed,
                self._bytes,
                self._seconds,
                tuple(buckets),
                dict(self._failures),
                active_leases,
                active_transfers,
            )
