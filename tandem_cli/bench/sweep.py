"""Reading a request-rate sweep: a configuration's capacity under SLOs, and a load two configurations share.

A sweep is a list of (request rate, share of requests meeting the SLOs) points.
"""

from __future__ import annotations

from collections.abc import Sequence

SweepPoints = Sequence[tuple[float, float]]


def capacity(points: SweepPoints, target: float = 0.9) -> float:
    """The highest rate at which >= target of the requests met the SLOs, with every lower swept rate meeting
    it too (conservative: a lucky point past a miss does not count). 0.0 when even the lowest rate misses."""
    best = 0.0
    for rate, share in sorted(points):
        if share < target:
            break
        best = rate
    return best


def equal_load(a: SweepPoints, b: SweepPoints, target: float = 0.9) -> float | None:
    """A rate to compare two configurations at: the highest rate both ran and both sustained (see capacity);
    failing that, the lowest rate both ran; None when they share no rate."""
    common = sorted({rate for rate, _ in a} & {rate for rate, _ in b})
    if not common:
        return None
    limit = min(capacity(a, target), capacity(b, target))
    sustained = [rate for rate in common if rate <= limit]
    return sustained[-1] if sustained else common[0]
