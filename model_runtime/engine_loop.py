"""EngineLoop: runs an Engine's steps on one thread and hands each request's outputs to its subscriber.

Every touch of the engine (adding, aborting, reading counters, the KV allocator of a decode worker) goes through
`call()`, which the loop thread runs between two steps, so the engine itself stays single-threaded. Subscribers
and step listeners are called on the loop thread and must not block (put the output on a queue).

    loop = EngineLoop(engine); loop.start()
    loop.subscribe(rid, queue.put); loop.call(lambda e: e.add_request(rid, ids, params))
    ... queue.get() -> StepOutput ...
    loop.add_step_listener(metrics.observe)      # a StepRecord per step that ran, before its outputs go out
    loop.stop()
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

from model_runtime.engine import Engine, StepOutput
from model_runtime.step_record import StepRecord

log = logging.getLogger(__name__)
T = TypeVar("T")
PREFIX_REFRESH_S = 0.25
PREFIX_REPORT_LIMIT = 4096  # block hashes a worker reports at most (16 bytes each): the hottest prefixes
Subscriber = Callable[[StepOutput], None]
StepListener = Callable[[StepRecord], None]


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
    cached_prompt_tokens_total: int = 0  # prompt tokens served from the prefix cache since start

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
            sched.cached_tokens_total,
        )


@dataclass(frozen=True)
class PrefixSnapshot:
    """Which full blocks the prefix cache holds (BlockPool.cached_hashes, bounded), as of `version`
    (BlockPool.cache_version). Retaken at most every PREFIX_REFRESH_S, so a busy engine does not rebuild it on
    every step; version and hashes always belong together."""

    version: int = 0
    block_hashes: tuple[bytes, ...] = ()
    taken_at: float = 0.0

    def refreshed(self, engine: Engine, limit: int) -> PrefixSnapshot:
        version = engine.pool.cache_version
        now = time.monotonic()
        if version == self.version or now - self.taken_at < PREFIX_REFRESH_S:
            return self
        return PrefixSnapshot(version, tuple(engine.pool.cached_hashes(limit)), now)


class EngineLoop:
    """The engine's one owner thread. Other threads never take the engine: call() queues a function that the
    loop thread runs between two steps, so a caller waits at most one step. (A lock that the loop re-takes
    right after each step starves waiting threads: Python locks are not fair, and the loop thread holds the
    GIL when it lets go. Aborts then waited tens of seconds on a busy worker.)"""

    def __init__(
        self, engine: Engine, idle_wait_s: float = 0.05, prefix_report_limit: int = PREFIX_REPORT_LIMIT
    ) -> None:
        self.engine = engine
        self._lock = threading.RLock()  # the engine, while the loop thread runs or when no loop thread runs
        self._calls: collections.deque[tuple[Callable[[Engine], object], Future[object]]] = (
            collections.deque()
        )
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._subscribers: dict[str, Subscriber] = {}
        self._subscribers_lock = threading.Lock()
        self._step_listeners: tuple[
            StepListener, ...
        ] = ()  # replaced whole: the loop reads it without a lock
        self._idle_wait_s = idle_wait_s
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.last_beat = time.monotonic()  # refreshed every iteration: a stale value means a hung step
        self.steps = 0
        # The steps' own wall times (StepRecord.duration_s), added up by the loop thread.
        self.busy_seconds = 0.0
        # scheduler.late_launch: how often and how long the loop held a step back to let arrivals join it
        self.launch_waits = 0
        self.launch_wait_seconds = 0.0
        self.failure: BaseException | None = None
        self._prefix_limit = prefix_report_limit
        self.prefix = PrefixSnapshot()
        self._publish()

    def _publish(self) -> None:
        """Refresh what readers on other threads see (under the lock, on the loop thread or without one)."""
        self.counters = EngineCounters.of(self.engine)
        self.prefix = self.prefix.refreshed(self.engine, self._prefix_limit)

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
        """Run fn(engine) on the loop thread between two steps and return its result (or raise its error).

        Without a running loop thread (before start(), after stop() or a failure) fn runs here, under the
        lock. From the loop thread itself (a subscriber) it runs at once."""
        return self.wait(self.submit(fn))

    def submit(self, fn: Callable[[Engine], T]) -> Future[T]:
        """call() without the wait: fn(engine) is queued for the loop's next pass between two steps, and its
        result (or error) goes to the returned future. A thread that must not block (a KV receive thread
        admitting a request whose blocks just landed) hands work over this way. Where call() would run fn at
        once, so does this."""
        pending: Future[T] = Future()
        if threading.current_thread() is self._thread or not self._thread.is_alive():
            with self._lock:
                try:
                    pending.set_result(self._run_now(fn))
                except BaseException as exc:
                    pending.set_exception(exc)
            return pending
        self._calls.append((fn, pending))  # type: ignore[arg-type]
        self._wake.set()
        return pending

    def wait(self, pending: Future[T]) -> T:
        """The result of a submitted call, waiting as long as the loop thread lives (or running what is left
        of the queue here once it has ended)."""
        while not futures.wait([pending], timeout=0.5).done:
            if not self._thread.is_alive():  # it ended after we queued: run what is left ourselves
                with self._lock:
                    self._run_calls()
        return pending.result()

    def subscribe(self, request_id: str, subscriber: Subscriber) -> None:
        with self._subscribers_lock:
            self._subscribers[request_id] = subscriber

    def add_step_listener(self, listener: StepListener) -> None:
        """listener(record) after every step that ran, on the loop thread, before that step's outputs reach
        their subscribers."""
        with self._subscribers_lock:
            self._step_listeners = (*self._step_listeners, listener)

    def unsubscribe(self, request_id: str) -> None:
        """Once this returns, nothing more reaches that subscriber (delivery runs on the loop thread too)."""
        self.call(lambda _engine: self._forget(request_id))

    def end(self, request_id: str) -> None:
        """A handler's exit, in one pass of the loop: forget its subscriber and abort its request (a no-op for
        a request the engine no longer has)."""

        def forget_and_abort(engine: Engine) -> None:
            self._forget(request_id)
            engine.abort(request_id)

        self.call(forget_and_abort)

    def _forget(self, request_id: str) -> None:
        with self._subscribers_lock:
            self._subscribers.pop(request_id, None)

    def _run_now(self, fn: Callable[[Engine], T]) -> T:
        result = fn(self.engine)
        self._publish()
        return result

    def _run_calls(self) -> None:
        """Run every queued call (loop thread, or any thread once the loop is gone); an error goes to its
        caller, never to the loop."""
        if not self._calls:
            return
        while self._calls:
            fn, pending = self._calls.popleft()
            try:
                pending.set_result(fn(self.engine))
            except BaseException as exc:
                pending.set_exception(exc)
        self._publish()

    def _deliver(self, outputs: list[StepOutput]) -> None:
        """On the loop thread. An output nobody listens for any more may carry detached KV blocks
        (prefill_only): they go straight back to the pool."""
        for output in outputs:
            with self._subscribers_lock:
                subscriber = self._subscribers.get(output.request_id)
            if subscriber is not None:
                subscriber(output)
            elif output.kv_block_ids:
                self.engine.release_blocks(output.kv_block_ids)

    def _await_launch(self) -> None:
        """scheduler.late_launch: until the engine's launch_at (model_runtime.launch_clock), run queued calls as
        they arrive, so a request added meanwhile joins the step launched next; a call after which the engine
        no longer holds the launch (a prompt arrived) ends the wait."""
        at = self.engine.launch_at()
        if at is None:
            return
        began = time.perf_counter()
        while not self._stop.is_set():
            left = at - time.perf_counter()
            if left <= 0:
                break
            if self._wake.wait(left):
                self._wake.clear()
                with self._lock:
                    self._run_calls()
                    at = self.engine.launch_at()
                if at is None:
                    break
        self.launch_waits += 1
        self.launch_wait_seconds += time.perf_counter() - began

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.last_beat = time.monotonic()
                self._await_launch()
                with self._lock:
                    self._run_calls()
                    outputs = self.engine.step() if self.engine.has_unfinished() else None
                    if outputs is not None and self.engine.last_step is not None:
                        self.busy_seconds += self.engine.last_step.duration_s
                        for listener in self._step_listeners:
                            listener(self.engine.last_step)
                    self._deliver(outputs or [])
                    self._publish()
                if outputs is None or not self.engine.last_step_ran:  # idle, or blocked until blocks return
                    if not self._calls:
                        self._wake.wait(self._idle_wait_s)
                    self._wake.clear()
                    continue
                self.steps += 1
        except BaseException as exc:  # the worker reports the loop dead; requests fail instead of hanging
            log.exception("engine loop failed")
            self.failure = exc
        finally:
            with self._lock:  # nobody is left to run them: callers must not wait forever
                self._run_calls()
