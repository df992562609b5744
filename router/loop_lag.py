"""The router's event-loop probe: a task that sleeps PERIOD_S again and again and reports how late it wakes.

Every request's admission, placement and worker calls, and every relayed token, run as callbacks on the router's
one event loop. When they need more CPU than the loop has, each waits its turn: the probe waits too, and its
lateness is that wait. It shows in `tandem_router_event_loop_lag_seconds` (router.prometheus), so an operator can
tell a saturated router (lag of milliseconds: add router replicas) from slow workers (lag near zero).
One wake-up every PERIOD_S costs a few microseconds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

PERIOD_S = 0.05


async def probe_loop_lag(report: Callable[[float], None], period_s: float = PERIOD_S) -> None:
    """Run until cancelled: report(seconds late) after every sleep of period_s."""
    loop = asyncio.get_running_loop()
    while True:
        asleep = loop.time()
        await asyncio.sleep(period_s)
        report(max(0.0, loop.time() - asleep - period_s))
