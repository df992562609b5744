"""WorkerPool.close() ends however a wake-up and the close interleave.

The poller sleeps until its interval passes or something wakes it (a member reported unreachable, a new
membership). A close that lands in the same loop turn as such a wake-up once lost its cancel on Python 3.11
(asyncio.wait_for returned the wake-up's result instead of raising), and close() then waited on the poller for
ever: a router that never finished stopping. Each case here puts the close a different number of loop turns after
the wake-up, so one of them meets that turn whatever the asyncio version does in between (on 3.11 the old code
hung at 0 and 1 turns)."""

from __future__ import annotations

import asyncio

import pytest

from model_runtime.roles import WorkerRole
from router.metrics import RouterMetrics
from router.pool import Endpoint, WorkerPool
from tests.loopback import free_port

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("turns", range(4))
def test_close_ends_when_it_lands_turns_after_a_wake_up(turns: int) -> None:
    async def scenario() -> bool:
        pool = WorkerPool(
            poll_interval_s=30.0,  # only a wake-up or the close can end the poller's wait
            poll_timeout_s=0.2,
            dead_after_failed_polls=3,
            max_message_bytes=1 << 20,
            metrics=RouterMetrics(),
        )
        pool.replace([Endpoint("d0", WorkerRole.DECODE, f"127.0.0.1:{free_port()}")])  # nobody listens
        pool.start()
        member = pool.get("d0")
        assert member is not None
        async with asyncio.timeout(
            10.0
        ):  # the first poll fails (refused); then the poller waits its interval
            while member.failed_polls == 0:
                await asyncio.sleep(0.01)
        pool.report_unreachable("d0")
        for _ in range(turns):
            await asyncio.sleep(0)
        # asyncio.wait rather than a timeout around the await: a close that swallows cancels would swallow the
        # timeout's too and look as if it had ended.
        closing = asyncio.create_task(pool.close())
        done, _ = await asyncio.wait([closing], timeout=5.0)
        return closing in done

    assert asyncio.run(scenario()), (
        f"WorkerPool.close() did not end within 5 s when called {turns} turns after a wake-up"
    )
