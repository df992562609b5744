"""router.admission with two classes: a freed slot goes to interactive before batch, a full router sheds its
newest queued batch request for an arriving interactive one, and cancels leave the counts right."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from router.admission import Admission, Priority
from router.errors import RouterError

pytestmark = pytest.mark.unit

INT, BAT = Priority.INTERACTIVE, Priority.BATCH


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_freed_slot_goes_to_interactive_first_then_to_batch_in_arrival_order() -> None:
    async def scenario() -> list[str]:
        admission = Admission(max_inflight=1, max_queue=10)
        holder = admission.enter(BAT)
        await holder.start()
        order: list[str] = []

        async def wait(name: str, priority: Priority) -> None:
            ticket = admission.enter(priority)
            await ticket.start()
            order.append(name)
            ticket.close()  # frees the slot for the next one

        tasks = []
        for name, priority in (("b1", BAT), ("b2", BAT), ("i1", INT), ("b3", BAT), ("i2", INT)):
            tasks.append(asyncio.create_task(wait(name, priority)))
            await settle()  # each is waiting before the next arrives
        assert admission.queued == 5 and admission.in_flight == 1
        holder.close()
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        assert admission.queued == 0 and admission.in_flight == 0
        return order

    assert asyncio.run(scenario()) == ["i1", "i2", "b1", "b2", "b3"]


def test_a_batch_request_does_not_overtake_waiting_interactive_ones_on_a_free_slot() -> None:
    async def scenario() -> None:
        admission = Admission(max_inflight=1, max_queue=4)
        holder = admission.enter(INT)
        await holder.start()
        waiting = admission.enter(INT)
        task = asyncio.create_task(waiting.start())
        await settle()
        holder.close()  # the slot goes to the waiting interactive ticket at once
        late = admission.enter(BAT)
        started = asyncio.create_task(late.start())
        await settle()
        assert task.done() and not started.done() and admission.in_flight == 1
        waiting.close()
        await asyncio.wait_for(started, 5)
        late.close()

    asyncio.run(scenario())


def test_a_full_router_sheds_the_newest_queued_batch_request_for_an_interactive_one() -> None:
    async def scenario() -> None:
        admission = Admission(max_inflight=1, max_queue=2)
        running = admission.enter(INT)
        await running.start()
        old_batch, new_batch = admission.enter(BAT), admission.enter(BAT)
        waiting = asyncio.create_task(new_batch.start())
        await settle()
        with pytest.raises(RouterError) as info:  # a batch request arriving at a full router is refused
            admission.enter(BAT)
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and info.value.retry_after_s == 1.0
        urgent = admission.enter(INT)  # takes new_batch's place
        assert new_batch.shed and not old_batch.shed and admission.queued == 2
        with pytest.raises(RouterError, match="gave its place to an interactive one") as info:
            await asyncio.wait_for(waiting, 5)
        assert info.value.trailing_metadata() == (("retry-after-ms", "1000"),)
        second = admission.enter(INT)  # sheds old_batch, the last batch request queued
        assert old_batch.shed
        with pytest.raises(RouterError, match="full"):
            admission.enter(INT)  # nothing left to shed: interactive is refused too
        for ticket in (new_batch, old_batch, running):
            ticket.close()
        await asyncio.wait_for(urgent.start(), 5)
        assert admission.in_flight == 1 and admission.queued == 1
        for ticket in (urgent, second):
            ticket.close()
        assert admission.accepted == 0

    asyncio.run(scenario())


def test_a_shed_ticket_that_had_not_started_waiting_fails_at_start() -> None:
    async def scenario() -> None:
        admission = Admission(max_inflight=1, max_queue=0)
        batch = admission.enter(BAT)  # holds the only place, not yet started (tokenizing)
        urgent = admission.enter(INT)
        with pytest.raises(RouterError, match="interactive"):
            await batch.start()
        await urgent.start()
        assert admission.in_flight == 1 and admission.queued == 0

    asyncio.run(scenario())


def test_a_cancelled_waiter_leaves_the_queue_and_a_granted_then_cancelled_one_returns_its_slot() -> None:
    async def scenario() -> None:
        admission = Admission(max_inflight=1, max_queue=4)
        holder = admission.enter(INT)
        await holder.start()
        gone = admission.enter(BAT)
        task = asyncio.create_task(gone.start())
        await settle()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        gone.close()
        assert admission.queued == 0
        granted = admission.enter(INT)
        task = asyncio.create_task(granted.start())
        await settle()
        holder.close()  # grants the slot ...
        task.cancel()  # ... and the waiter is cancelled before it runs again
        await asyncio.gather(task, return_exceptions=True)
        granted.close()
        assert admission.in_flight == 0 and admission.queued == 0
        last = admission.enter(BAT)
        await asyncio.wait_for(last.start(), 5)  # the slot came back
        last.close()

    asyncio.run(scenario())
