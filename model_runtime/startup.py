"""StartupProgress: an engine's start-up as a few short status lines for the people waiting on it.

Loading a 70B checkpoint or capturing a few dozen CUDA graphs takes minutes; a worker shows where it is:

    progress = StartupProgress(print)
    progress.phase("reading the model config")
    progress.weights(done_bytes, total_bytes)   # "loading weights: 40% (6.0 of 15.0 GiB)", every 10%
    progress.graphs(captured, total)            # "capturing CUDA graphs: 12 of 35", about every 10%
"""

from __future__ import annotations

import math
from collections.abc import Callable

STEP_PERCENT = 10


class StartupProgress:
    def __init__(self, report: Callable[[str], None] | None = None) -> None:
        self._report = report
        self._weights_shown = -1
        self._graphs_shown = -1

    def phase(self, text: str) -> None:
        if self._report is not None:
            self._report(text)

    def weights(self, done: int, total: int) -> None:
        step = _step(done, total)
        if step > self._weights_shown:
            self._weights_shown = step
            self.phase(f"loading weights: {step}% ({done / 2**30:.1f} of {total / 2**30:.1f} GiB)")

    def graphs(self, done: int, total: int) -> None:
        step = _step(done, total)
        if step > self._graphs_shown:
            self._graphs_shown = step
            self.phase(f"capturing CUDA graphs: {done} of {total}")


def _step(done: int, total: int) -> int:
    """done/total as a percentage rounded down to a multiple of STEP_PERCENT (100 only when done)."""
    if total <= 0 or done >= total:
        return 100
    return min(100 - STEP_PERCENT, math.floor(100 * done / total / STEP_PERCENT) * STEP_PERCENT)
