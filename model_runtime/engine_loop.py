"""EngineLoop: runs an Engine's steps on one thread and hands each request's outputs to its subscriber.

Every touch of the engine (adding, aborting, reading counters, the KV allocator of a decode worker) goes through
`call()`, which holds the loop's lock, so the engine itself stays single-threaded. Subscribers are called on the
loop thread under the lock and must not block (put the output on a queue).

    loop = EngineLoop(engine); loop.start()
    loop.subscribe(rid, queue.put); loop.call(lambda e: e.add_request(rid, ids, params))
    ... queue.get() -> StepOutput ...
    loop.stop()
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from model_runtime.engine import Engine, StepOutput

log = logging.getLogger(__name__)
T = TypeVar("T")
Subscriber = Callable[[StepOutput], None]


@dataclass(frozen=True)
class EngineCounters:
    """What Status and metrics report, published by the loop after every step and every call(): readers never
    take the lock, so a long step cannot make a worker look dead to its health checks."""

    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    running: int = 0
    waiting: int = 0
    queued_prompt_tokens: int = 0
    requests_total: int = 0

    @classmethod
    def of(cls, engine: Engine) -> EngineCounters:
        sched = engine.scheduler
        return cls(
            engine.pool.num_used,
            engine.pool.usable,
            sched.num_running,
            sched.num_waiting,
            engine.queued_prompt_tokens(),
            engine.requests_total,
        )


class EngineLoop:
    def __init__(self, engine: Engine, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._subscribers: dict[str, Subscriber] = {}
        self._idle_wait_s = idle_wait_s
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.last_beat = time.monotonic()  # refreshed every iteration: a stale value means a hung step
        self.steps = 0
        self.failure: BaseException | None = None
        self.counters = EngineCounters.of(engine)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.failure is None

    def call(self, fn: Callable[[Engine], T]) -> T:
        """Run fn(engine) under the loop's lock and wake the loop (fn may have added work)."""
        with self._lock:
            result = fn(self.engine)
            self.counters = EngineCounters.of(self.engine)
        self._wake.set()
        return result

    def subscribe(self, request_id: str, subscriber: Subscriber) -> None:
        with self._lock:
            self._subscribers[request_id] = subscriber

    def unsubscribe(self, request_id: str) -> None:
        with self._lock:
            self._subscribers.pop(request_id, None)

    def _deliver(self, outputs: list[StepOutput]) -> None:
        """Under the lock, so once unsubscribe() returns nothing more reaches that subscriber. An output nobody
        listens for any more may carry detached KV blocks (prefill_only): they go straight back to the pool."""
        for output in outputs:
            subscriber = self._subscribers.get(output.request_id)
            if subscriber is not None:
                subscriber(output)
            elif output.kv_block_ids:
                self.engine.release_blocks(output.kv_block_ids)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.last_beat = time.monotonic()
                with self._lock:
                    outputs = self.engine.step() if self.engine.has_unfinished() else None
                    self._deliver(outputs or [])
                    self.counters = EngineCounters.of(self.engine)
                if outputs is None or not self.engine.last_step_ran:  # idle, or blocked until blocks return
                    self._wake.wait(self._idle_wait_s)
                    self._wake.clear()
                    continue
                self.steps += 1
        except BaseException as exc:  # the worker reports the loop dead; requests fail instead of hanging
            log.exception("engine loop failed")
            self.failure = exc
