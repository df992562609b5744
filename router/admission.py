"""Bounded admission with two priority classes: at most `max_inflight` requests hold a slot (are placed on
workers), at most `max_queue` more wait for one; anything beyond is refused at once with RESOURCE_EXHAUSTED
instead of queueing without bound (an overloaded router answers fast rather than letting every client time out).

    accepted --enter()--> queued --start()--> in flight --close()--> gone
                             |                    (close() from queued also works: cancel, deadline, bad input)
                             '--shed (a batch ticket, when an interactive request arrives at a full router)

Priority (an API key's class; INTERACTIVE without keys): a freed slot goes to the oldest waiting interactive
request, and only when none waits to the oldest batch one. When the router is full, an arriving interactive
request takes the place of the newest queued batch request, which ends with RESOURCE_EXHAUSTED (it is shed, and
told to retry); an arriving batch request is refused. Strict priority: steady interactive load can starve batch,
which is what batch signs up for.
"""

from __future__ import annotations

import asyncio
import enum
from collections import deque
from types import TracebackType

import grpc

from router.errors import RouterError

RETRY_AFTER_FULL_S = 1.0  # what a refused or shed request is asked to wait: slots free up as requests end


class Priority(enum.StrEnum):
    INTERACTIVE = "interactive"
    BATCH = "batch"


class Admission:
    def __init__(self, max_inflight: int, max_queue: int) -> None:
        self.max_inflight = max_inflight
        self.max_queue = max_queue
        self.queued = 0
        self.in_flight = 0
        self._closed_reason: str | None = None
        # Tickets queued, by class, oldest first (the shedding order reads the batch one from the right).
        self._queued: dict[Priority, deque[Ticket]] = {p: deque() for p in Priority}
        # Tickets whose start() waits for a slot, by class, oldest first.
        self._waiting: dict[Priority, deque[Ticket]] = {p: deque() for p in Priority}

    @property
    def open(self) -> bool:
        return self._closed_reason is None

    @property
    def accepted(self) -> int:
        """Requests holding a ticket (queued or in flight)."""
        return self.queued + self.in_flight

    def close(self, reason: str) -> None:
        """Refuse every later request with UNAVAILABLE `reason` (a draining router); tickets already given
        out keep their places."""
        self._closed_reason = reason

    def enter(self, priority: Priority = Priority.INTERACTIVE) -> Ticket:
        """Accept one request as queued, or raise UNAVAILABLE when closed, RESOURCE_EXHAUSTED when full (after
        shedding a queued batch request for an interactive one, when there is one to shed)."""
        if self._closed_reason is not None:
            raise RouterError(grpc.StatusCode.UNAVAILABLE, self._closed_reason)
        if self.queued + self.in_flight >= self.max_inflight + self.max_queue:
            victims = self._queued[Priority.BATCH]
            if priority is not Priority.INTERACTIVE or not victims:
                raise RouterError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"router is full: {self.in_flight} requests running, {self.queued} waiting "
                    f"(max_inflight {self.max_inflight}, max_queue {self.max_queue}); retry later",
                    RETRY_AFTER_FULL_S,
                )
            victims[-1]._shed()
        ticket = Ticket(self, priority)
        self._queued[priority].append(ticket)
        self.queued += 1
        return ticket

    def _has_free_slot(self) -> bool:
        return self.in_flight < self.max_inflight

    def _wake_next(self) -> None:
        """Hand free slots to waiting tickets, interactive first, oldest first."""
        while self._has_free_slot():
            waiting = self._waiting[Priority.INTERACTIVE] or self._waiting[Priority.BATCH]
            if not waiting:
                return
            waiting.popleft()._run()

    def _unqueue(self, ticket: Ticket) -> None:
        self._queued[ticket.priority].remove(ticket)
        self.queued -= 1
        waiting = self._waiting[ticket.priority]
        if ticket in waiting:
            waiting.remove(ticket)


class Ticket:
    """One accepted request's place in the admission bound. Use as a context manager; close() is idempotent."""

    def __init__(self, admission: Admission, priority: Priority) -> None:
        self._admission = admission
        self.priority = priority
        self._state = "queued"  # queued -> running | shed -> closed
        self._woken: asyncio.Future[None] | None = None

    @property
    def shed(self) -> bool:
        return self._state == "shed"

    async def start(self) -> None:
        """Wait for an in-flight slot (the caller's deadline bounds the wait). Raises RESOURCE_EXHAUSTED when
        the ticket was shed for an interactive request, before or while it waited."""
        a = self._admission
        if self._state == "shed":
            raise _shed_error()
        if self._state != "queued":
            return
        batch_ahead = self.priority is Priority.BATCH and a._waiting[Priority.BATCH]
        if a._has_free_slot() and not (a._waiting[Priority.INTERACTIVE] or batch_ahead):
            self._run()
            return
        self._woken = asyncio.get_running_loop().create_future()
        a._waiting[self.priority].append(self)
        try:
            await self._woken  # a cancel after the slot came leaves the ticket running: close() returns it
        finally:
            self._woken = None

    def _run(self) -> None:
        a = self._admission
        a._queued[self.priority].remove(self)
        a.queued -= 1
        a.in_flight += 1
        self._state = "running"
        if self._woken is not None and not self._woken.done():
            self._woken.set_result(None)

    def _shed(self) -> None:
        self._admission._unqueue(self)
        self._state = "shed"
        if self._woken is not None and not self._woken.done():
            self._woken.set_exception(_shed_error())

    def close(self) -> None:
        a = self._admission
        if self._state == "queued":
            a._unqueue(self)
        elif self._state == "running":
            a.in_flight -= 1
            a._wake_next()
        self._state = "closed"

    def __enter__(self) -> Ticket:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _shed_error() -> RouterError:
    return RouterError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "router is full and this batch-class request gave its place to an interactive one; retry later",
        RETRY_AFTER_FULL_S,
    )
