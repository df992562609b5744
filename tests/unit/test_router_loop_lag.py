"""router.loop_lag: the probe reports how late the router's event loop let it wake, near zero while the loop
is free and about as long as something else held the loop; PrometheusRouterMetrics exports it."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import generate_latest

from router.loop_lag import probe_loop_lag
from router.prometheus import PrometheusRouterMetrics

pytestmark = pytest.mark.unit


async def readings(hold_s: float) -> list[float]:
    """The probe's reports over a quarter second, with the loop held for hold_s by a blocking callback."""
    seen: list[float] = []
    probe = asyncio.create_task(probe_loop_lag(seen.append, period_s=0.01))
    await asyncio.sleep(0.05)
    if hold_s:
        asyncio.get_running_loop().call_soon(time.sleep, hold_s)  # a callback that keeps the loop busy
    await asyncio.sleep(0.2)
    probe.cancel()
    await asyncio.wait([probe])
    return seen


def test_a_free_loop_reads_near_zero_and_a_held_one_reads_the_hold() -> None:
    free = asyncio.run(readings(0.0))
    held = asyncio.run(readings(0.15))
    assert len(free) >= 5 and sorted(free)[len(free) // 2] < 0.005, free
    assert max(held) >= 0.1, held


def test_the_router_exports_the_lag_as_a_histogram() -> None:
    metrics = PrometheusRouterMetrics("m")
    metrics.loop_lagged(0.003)
    metrics.loop_lagged(0.2)
    text = generate_latest(metrics.registry).decode()
    assert 'tandem_router_event_loop_lag_seconds_count{model="m"} 2.0' in text
    assert 'tandem_router_event_loop_lag_seconds_bucket{le="0.005",model="m"} 1.0' in text
    assert metrics.loop_lags == [0.003, 0.2]
