"""Bounded admission: at most `max_inflight` requests hold a slot (are placed on workers), at most `max_queue`
more wait for one; anything beyond is refused at once with RESOURCE_EXHAUSTED instead of queueing without
bound (an overloaded router answers fast rather than letting every client time out).

    accepted --enter()--> queued --start()--> in flight --close()--> gone
                                                  (close() from queued also works: cancel, deadline, bad input)
"""

from __future__ import annotations

import asyncio
from types import TracebackType

import grpc

from router.errors import RouterError


class Admission:
    def __init__(self, max_inflight: int, max_queue: int) -> None:
        self.max_inflight = max_inflight
        self.max_queue = max_queue
        self.queued = 0
        self.in_flight = 0
        self._slots = asyncio.Semaphore(max_inflight)
        self._closed_reason: str | None = None

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

    def enter(self) -> Ticket:
        """Accept one request as queued, or raise UNAVAILABLE when closed, RESOURCE_EXHAUSTED when full."""
        if self._closed_reason is not None:
            raise RouterError(grpc.StatusCode.UNAVAILABLE, self._closed_reason)
        if self.queued + self.in_flight >= self.max_inflight + self.max_queue:
            raise RouterError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"router is full: {self.in_flight} requests running, {self.queued} waiting "
                f"(max_inflight {self.max_inflight}, max_queue {self.max_queue}); retry later",
            )
        self.queued += 1
        return Ticket(self)


class Ticket:
    """One accepted request's place in the admission bound. Use as a context manager; close() is idempotent."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self._state = "queued"

    async def start(self) -> None:
        """Wait for an in-flight slot (the caller's deadline bounds the wait)."""
        if self._state != "queued":
            return
        await self._admission._slots.acquire()
        self._admission.queued -= 1
        self._admission.in_flight += 1
        self._state = "running"

    def close(self) -> None:
        if self._state == "queued":
            self._admission.queued -= 1
        elif self._state == "running":
            self._admission.in_flight -= 1
            self._admission._slots.release()
        self._state = "closed"

    def __enter__(self) -> Ticket:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
