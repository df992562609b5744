"""bench/disagg_vs_colocated.py's time budget (--budget-s): whether the next point, warm-up round or deployment
still fits before the deadline, judged from what the earlier ones of this run took.

A point takes its arrivals (known in advance) plus a tail: the drain while requests finish, the metrics
scrapes and the wait for the workers to go quiet. Before anything has run, the tail is reserved whole (--drain
plus FIRST_TAIL_S), as the script always did. Once a point or warm-up round has run, the reserve is the longest
tail seen so far times TAIL_MARGIN plus TAIL_PAD_S, never more than the whole reserve: a drain that ended
after 2 s of its 20 no longer blocks a point that fits. On the 4x H200 runs of 2026-11-28 the whole reserve
(58 s at --drain 20) stopped sweeps with a minute and a half left. A deployment is started only when its
start-up (the longest seen, else FIRST_START_S) and one point of its tail fit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

FIRST_TAIL_S = 30.0  # beyond --drain, before any point has shown what its tail takes
TAIL_MARGIN = 1.25
TAIL_PAD_S = 5.0
FIRST_START_S = 60.0  # tandem serve's start-up with CUDA graphs, before one has been timed


@dataclass
class Budget:
    deadline: float
    drain_s: float
    clock: Callable[[], float] = time.monotonic
    longest_tail_s: float | None = None
    longest_start_s: float | None = None

    def reserve_s(self) -> float:
        """What a point needs beyond its arrivals."""
        whole = self.drain_s + FIRST_TAIL_S
        if self.longest_tail_s is None:
            return whole
        return min(whole, self.longest_tail_s * TAIL_MARGIN + TAIL_PAD_S)

    def fits(self, arrivals_s: float) -> bool:
        return self.clock() + arrivals_s + self.reserve_s() <= self.deadline

    def record_point(self, arrivals_s: float, elapsed_s: float) -> None:
        """A point (or warm-up round) that sent for `arrivals_s` and took `elapsed_s` in all."""
        tail = max(0.0, elapsed_s - arrivals_s)
        self.longest_tail_s = tail if self.longest_tail_s is None else max(self.longest_tail_s, tail)

    def fits_deployment(self, first_arrivals_s: float) -> bool:
        """Start-up and one point of `first_arrivals_s` fit before the deadline."""
        start = FIRST_START_S if self.longest_start_s is None else self.longest_start_s * TAIL_MARGIN
        return self.fits(start + first_arrivals_s)

    def record_start(self, elapsed_s: float) -> None:
        self.longest_start_s = (
            elapsed_s if self.longest_start_s is None else max(self.longest_start_s, elapsed_s)
        )

    def timed(self) -> _Timer:
        return _Timer(self.clock)


class _Timer:
    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.start = clock()

    def elapsed(self) -> float:
        return self.clock() - self.start
