"""EngineLoop: calls from other threads reach a busy engine within a step, errors go back to the caller, and
nothing waits forever when the loop ends."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from model_runtime.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from model_runtime.engine import Engine, StepOutput
from model_runtime.engine_loop import EngineLoop
from model_runtime.request import SamplingParams
from model_runtime.step_record import StepRecord
from tests.model.tiny_models import write_tiny_hf

LONG = SamplingParams(temperature=0, max_tokens=480, ignore_eos=True)  # the tiny model's context is 512


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf(tmp_path_factory.mktemp("loop"))


def make_loop(model_dir: Path) -> EngineLoop:
    config = EngineConfig(
        model=str(model_dir),
        cache=CacheConfig(block_size=4, num_blocks=256),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
        device=DeviceConfig(device="cpu"),
    )
    return EngineLoop(Engine(config), idle_wait_s=0.01)


@pytest.fixture
def loop(model_dir: Path) -> Iterator[EngineLoop]:
    loop = make_loop(model_dir)
    loop.start()
    yield loop
    loop.stop()


def start_long_request(loop: EngineLoop, rid: str) -> queue.Queue[StepOutput]:
    outputs: queue.Queue[StepOutput] = queue.Queue()
    loop.subscribe(rid, outputs.put)
    loop.call(lambda e: e.add_request(rid, [5, 6, 7, 8, 9], LONG))
    outputs.get(timeout=30)  # decoding has begun
    return outputs


def test_an_abort_from_another_thread_lands_within_a_step_of_a_busy_loop(loop: EngineLoop) -> None:
    """The loop steps back to back; an abort from a handler thread must not starve behind it (with a lock
    that the loop re-takes after each step, it waited for all the request's steps)."""
    outputs = start_long_request(loop, "busy")
    for _ in range(3):
        outputs.get(timeout=30)
    seen: dict[str, int] = {}

    def abort(engine: Engine) -> bool:
        seen["ran_at"] = loop.steps
        return engine.abort("busy")

    def handler() -> None:
        seen["queued_at"] = loop.steps
        loop.call(abort)

    thread = threading.Thread(target=handler, daemon=True)
    thread.start()
    thread.join(30)
    assert "ran_at" in seen, "the call never ran"
    # It ran between two steps: the step in flight, plus (on a loaded host) the few that ran while this thread
    # was descheduled between reading the counter and queueing; never the rest of the request (~475 steps).
    assert seen["ran_at"] - seen["queued_at"] <= 50, seen
    assert loop.counters.kv_blocks_used == 0 and loop.counters.running == 0
    assert not loop.call(lambda e: e.has_unfinished())


def test_many_concurrent_callers_are_all_served_while_the_loop_is_busy(loop: EngineLoop) -> None:
    start_long_request(loop, "busy")
    results: list[int] = []
    lock = threading.Lock()

    def caller(i: int) -> None:
        value = loop.call(lambda e: e.pool.usable + i)
        with lock:
            results.append(value - i)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == [loop.engine.pool.usable] * 16
    loop.end("busy")


def test_a_call_that_raises_raises_in_the_caller_and_the_loop_goes_on(loop: EngineLoop) -> None:
    outputs = start_long_request(loop, "busy")
    with pytest.raises(KeyError, match="no such thing"):
        loop.call(lambda e: {}["no such thing"])
    assert loop.alive
    while not outputs.empty():  # what the request produced before and during the call
        outputs.get_nowait()
    steps = loop.steps
    outputs.get(timeout=30)  # a new token: the request still runs
    deadline = time.monotonic() + 30
    while loop.steps < steps + 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert loop.steps >= steps + 2
    loop.end("busy")


def test_submit_returns_before_the_call_runs_and_keeps_the_order_of_calls(loop: EngineLoop) -> None:
    """A KV receive thread admits a landed request with submit(): it must not wait for the step, the call
    must run on the loop thread, and a call() queued after it (the handler's end()) must run after it."""
    start_long_request(loop, "busy")
    ran: list[tuple[str, threading.Thread]] = []
    entered, gate = threading.Event(), threading.Event()
    loop.call(lambda e: setattr(e, "step", _held_step(e.step, entered, gate)))
    assert entered.wait(30)  # a step is running, held until the gate opens
    admitted = loop.submit(lambda e: ran.append(("submit", threading.current_thread())) or "taken")
    assert not admitted.done()  # queued behind the held step, and submit() did not wait for it
    caller = threading.Thread(
        target=lambda: loop.call(lambda e: ran.append(("call", threading.current_thread())))
    )
    caller.start()
    gate.set()
    assert loop.wait(admitted) == "taken"
    caller.join(30)
    assert [name for name, _ in ran] == ["submit", "call"]
    assert all(thread.name == "engine-loop" for _, thread in ran)
    loop.end("busy")


def _held_step(step, entered: threading.Event, gate: threading.Event):
    def held() -> list[StepOutput]:
        entered.set()
        gate.wait(30)
        return step()

    return held


def test_after_unsubscribe_returns_no_output_reaches_the_subscriber(loop: EngineLoop) -> None:
    outputs = start_long_request(loop, "busy")
    loop.unsubscribe("busy")
    while not outputs.empty():
        outputs.get_nowait()
    steps = loop.steps
    while loop.steps < steps + 3:  # the request keeps running; its outputs go nowhere
        time.sleep(0.01)
    assert outputs.empty()
    loop.end("busy")


def test_calls_run_inline_without_a_loop_thread(model_dir: Path) -> None:
    loop = make_loop(model_dir)
    assert loop.call(lambda e: threading.current_thread()) is threading.current_thread()
    loop.start()
    assert loop.call(lambda e: threading.current_thread()) is not threading.current_thread()
    loop.stop()
    assert loop.call(lambda e: e.has_unfinished()) is False


def test_a_failed_step_leaves_no_caller_waiting(model_dir: Path) -> None:
    """When a step raises, the loop is reported dead and queued or later calls still return."""
    loop = make_loop(model_dir)
    loop.start()
    try:
        start_long_request(loop, "doomed")

        def broken_step() -> list[StepOutput]:
            raise RuntimeError("device lost")

        loop.call(lambda e: setattr(e, "step", broken_step))
        deadline = time.monotonic() + 30
        while loop.alive and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not loop.alive and isinstance(loop.failure, RuntimeError)
        assert loop.call(lambda e: e.abort("doomed")) is True
    finally:
        loop.stop()


def test_step_listeners_get_a_record_of_each_step_before_its_outputs(loop: EngineLoop) -> None:
    """A 5-token prompt is one prefill step (its first token), then one decode step per further token."""
    records: list[StepRecord] = []
    seen_at_output: list[int] = []
    loop.add_step_listener(records.append)
    outputs: queue.Queue[StepOutput] = queue.Queue()
    loop.subscribe("r", lambda out: (seen_at_output.append(len(records)), outputs.put(out)))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    loop.call(lambda e: e.add_request("r", [5, 6, 7, 8, 9], params))
    while outputs.get(timeout=30).finish_reason is None:
        pass
    assert [(r.prefill_tokens, r.num_prefill, r.num_decode, r.num_tokens) for r in records] == [
        (5, 1, 0, 5),
        (0, 0, 1, 1),
        (0, 0, 1, 1),
    ]
    assert all(r.batch_size == 1 and r.duration_s > 0 and r.num_preempted == 0 for r in records)
    assert seen_at_output == [1, 2, 3]  # each step's record went out before its token did


def test_busy_seconds_count_the_steps_that_ran_and_not_the_idle_time(loop: EngineLoop) -> None:
    """Status's busy_seconds_total (the autoscaler's prefill load signal) is the wall time of the steps: at
    least what the engine's own step records measured, never more than the time that passed, and an idle loop
    adds nothing."""
    time.sleep(0.2)
    assert loop.busy_seconds == 0.0  # 0.2 s of idle passes: no step ran
    records: list[StepRecord] = []
    loop.add_step_listener(records.append)
    outputs: queue.Queue[StepOutput] = queue.Queue()
    loop.subscribe("r", outputs.put)
    started = time.monotonic()
    loop.call(lambda e: e.add_request("r", list(range(5, 45)), SamplingParams(temperature=0, max_tokens=6)))
    while outputs.get(timeout=30).finish_reason is None:
        pass
    busy = loop.busy_seconds
    assert sum(r.duration_s for r in records) <= busy <= time.monotonic() - started
    time.sleep(0.2)
    assert loop.busy_seconds == busy
