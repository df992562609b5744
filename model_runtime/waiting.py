"""`WaitingQueue`: requests waiting for admission, in two priority classes, and which one goes next.

    queue = WaitingQueue(batch_max_wait_s=30.0)
    queue.append(request)            # by request.priority
    head = queue.peek()              # the request to admit next (None when empty)
    queue.remove(head)               # once it was admitted (or aborted: remove works anywhere in the queue)

Order: the oldest waiting INTERACTIVE request goes before any BATCH one; within a class, first come first
served. Starvation bound: a BATCH request that has waited `batch_max_wait_s` or longer competes by arrival time
with the interactive ones, so it goes before every interactive request that arrived after it. Under steady
interactive load a batch prompt therefore waits about batch_max_wait_s plus the interactive prompts that were
already waiting when it aged, not forever. Only waiting requests are ordered: the scheduler never preempts a
running request for a higher class.

    interactive: [i1 i2 i3]        peek() -> i1
    batch:       [b1 b2]           ... unless now - b1.arrival_time >= batch_max_wait_s and b1 arrived before i1
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator

from model_runtime.request import Priority, Request


class WaitingQueue:
    def __init__(self, batch_max_wait_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.batch_max_wait_s = batch_max_wait_s
        self._clock = clock  # the clock request.arrival_time was read from
        self._queues: dict[Priority, deque[Request]] = {p: deque() for p in Priority}

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def __bool__(self) -> bool:
        return any(self._queues.values())

    def __iter__(self) -> Iterator[Request]:
        for queue in self._queues.values():
            yield from queue

    def append(self, request: Request) -> None:
        self._queues[request.priority].append(request)

    def peek(self) -> Request | None:
        """The request to admit next: see the module docstring."""
        interactive, batch = self._queues[Priority.INTERACTIVE], self._queues[Priority.BATCH]
        if not batch:
            return interactive[0] if interactive else None
        if not interactive:
            return batch[0]
        oldest_batch, oldest_interactive = batch[0], interactive[0]
        aged = self._clock() - oldest_batch.arrival_time >= self.batch_max_wait_s
        if aged and oldest_batch.arrival_time <= oldest_interactive.arrival_time:
            return oldest_batch
        return oldest_interactive

    def popleft(self) -> Request:
        """Take the request peek() names; IndexError when empty."""
        head = self.peek()
        if head is None:
            raise IndexError("popleft: the waiting queue is empty")
        self._queues[head.priority].popleft()
        return head

    def remove(self, request: Request) -> bool:
        """Take `request` out wherever it waits (by identity); False when it is not here."""
        queue = self._queues[request.priority]
        if queue and queue[0] is request:  # the common case: the head was just admitted
            queue.popleft()
            return True
        for i, r in enumerate(queue):
            if r is request:  # Request compares field-wise: identity, so an equal twin stays
                del queue[i]
                return True
        return False
