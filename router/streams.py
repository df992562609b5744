"""Worker streams as dispatch reads them: typed failures, idempotent cancel, and a merger that reads the
prefill and decode streams of one request concurrently (events come back in arrival order).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio

# Codes with which a worker refuses the request itself (the router's validation and the worker's disagree):
# retrying elsewhere would not help, the client should see them.
_REJECTIONS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE)


class WorkerCallError(Exception):
    """A worker call failed (or broke the protocol). `worker` names it for messages: "decode worker d1"."""

    def __init__(self, worker_id: str, worker: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{worker} failed: {code.name}: {details}")
        self.worker_id = worker_id
        self.worker = worker
        self.code = code
        self.details = details

    @property
    def no_room(self) -> bool:
        """The worker is full for now (decode: no free KV blocks for the prompt)."""
        return self.code == grpc.StatusCode.RESOURCE_EXHAUSTED

    @property
    def rejected(self) -> bool:
        return self.code in _REJECTIONS

    @property
    def unreachable(self) -> bool:
        return self.code == grpc.StatusCode.UNAVAILABLE


class WorkerStream:
    """One server-streaming call to a worker."""

    def __init__(self, worker_id: str, worker: str, call: Any) -> None:
        self.worker_id = worker_id
        self.worker = worker
        self._call = call
        self.ended = False

    def error(self, code: grpc.StatusCode, details: str) -> WorkerCallError:
        return WorkerCallError(self.worker_id, self.worker, code, details)

    async def read(self) -> Any | None:
        """The next message, or None once the worker closed the stream normally."""
        try:
            message = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            self.ended = True
            raise self.error(exc.code(), exc.details() or "") from None
        if message is grpc.aio.EOF:
            self.ended = True
            return None
        return message

    def cancel(self) -> None:
        """Cancel the call unless it ended; the worker frees the request's blocks and leases."""
        if not self.ended:
            self.ended = True
            self._call.cancel()


@dataclass(frozen=True)
class StreamItem:
    """One thing that happened on `source`: a message, the normal end (message and error None), or an error."""

    source: WorkerStream
    message: Any | None = None
    error: WorkerCallError | None = None


class StreamMerger:
    """Reads several streams at once into one queue. close() stops the readers (not the calls)."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[StreamItem] = asyncio.Queue()
        self._front: collections.deque[StreamItem] = collections.deque()  # taken by ready(), given back
        self._readers: list[asyncio.Task[None]] = []

    def add(self, stream: WorkerStream) -> None:
        self._readers.append(asyncio.create_task(self._pump(stream)))

    def fail_when(self, stream: WorkerStream, event: asyncio.Event, details: Callable[[], str]) -> None:
        """Report `stream` as failed (UNAVAILABLE: details(), read then) once `event` is set, unless it ended
        before."""
        self._readers.append(asyncio.create_task(self._fail_when(stream, event, details)))

    async def _fail_when(
        self, stream: WorkerStream, event: asyncio.Event, details: Callable[[], str]
    ) -> None:
        await event.wait()
        if not stream.ended:
            self._queue.put_nowait(
                StreamItem(stream, error=stream.error(grpc.StatusCode.UNAVAILABLE, details()))
            )

    async def get(self) -> StreamItem:
        if self._front:
            return self._front.popleft()
        return await self._queue.get()

    def ready(self) -> StreamItem | None:
        """The next item if one is already here (never waits), else None."""
        if self._front:
            return self._front.popleft()
        try:
            return self._queue.get_nowait()
        except asyncio.QueueEmpty:
            return None

    def give_back(self, item: StreamItem) -> None:
        """Put an item taken by ready() back at the head, so that get() returns it next."""
        self._front.appendleft(item)

    async def _pump(self, stream: WorkerStream) -> None:
        while True:
            try:
                message = await stream.read()
            except WorkerCallError as exc:
                self._queue.put_nowait(StreamItem(stream, error=exc))
                return
            self._queue.put_nowait(StreamItem(stream, message=message))
            if message is None:
                return

    def close(self) -> None:
        # Not awaited: close() runs in `finally` blocks of a possibly cancelled task, where waiting could
        # swallow that task's own cancellation. A cancelled reader ends on its own.
        for task in self._readers:
            task.cancel()
        self._readers = []
