"""A clock that a test moves by hand, for code that takes `clock=time.monotonic` (schedulers, leases, quotas,
latency windows, the bench budget)."""

from __future__ import annotations


class ManualClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
