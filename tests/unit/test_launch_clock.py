"""model_runtime.launch_clock: when a step-ahead engine in a serving loop schedules its next step, and the
EngineLoop's wait for that moment (calls from other threads, such as a decode worker's admissions and aborts,
still run during it)."""

from __future__ import annotations

import queue
import time
from pathlib import Path

import pytest

from model_runtime.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from model_runtime.engine import Engine, StepOutput
from model_runtime.engine_loop import EngineLoop
from model_runtime.launch_clock import HOST_WEIGHT, MARGIN_S, MISS_STEP_S, LaunchClock
from model_runtime.request import SamplingParams
from tests.model.tiny_models import write_tiny_hf


def _timed(clock: LaunchClock, batch: int, took_s: float, at: float = 0.0) -> None:
    clock.running(at, batch, decode_only=True)
    clock.done(took_s)


def test_the_next_step_launches_the_host_s_lead_before_the_running_decode_step_s_expected_end() -> None:
    clock = LaunchClock()
    clock.launched(0.002)
    _timed(clock, batch=6, took_s=0.010)
    clock.running(100.0, batch=7, decode_only=True)  # same power-of-two bucket (8)
    assert clock.launch_at() == pytest.approx(100.0 + 0.010 - (HOST_WEIGHT * 0.002 + MARGIN_S))


def test_nothing_to_wait_for_without_a_timed_decode_step_of_that_size() -> None:
    clock = LaunchClock()
    clock.launched(0.001)
    clock.running(5.0, batch=8, decode_only=True)
    assert clock.launch_at() is None  # never timed
    _timed(clock, batch=8, took_s=0.010)
    clock.running(5.0, batch=40, decode_only=True)
    assert clock.launch_at() is None  # another bucket
    clock.running(5.0, batch=8, decode_only=False)
    assert clock.launch_at() is None  # prompt chunks: its time depends on them
    clock.done(0.5)
    assert clock.launch_at() is None  # nothing in flight
    clock.running(5.0, batch=8, decode_only=True)
    assert clock.launch_at() is not None


def test_a_faster_step_counts_at_once_and_a_slow_one_only_in_part() -> None:
    clock = LaunchClock(margin_s=0.0)
    _timed(clock, 16, 0.010)
    _timed(clock, 16, 0.100)  # a stall (a collection): must not make the next waits ten times longer
    clock.running(0.0, 16, True)
    slow = clock.launch_at()
    assert slow is not None and 0.010 < slow < 0.04
    _timed(clock, 16, 0.008)
    clock.running(0.0, 16, True)
    assert clock.launch_at() == pytest.approx(0.008)


def test_an_untimed_step_teaches_nothing() -> None:
    clock = LaunchClock()
    clock.running(0.0, 8, True)
    clock.done(None)  # no events (a step with nothing sampled)
    clock.running(1.0, 8, True)
    assert clock.launch_at() is None


def test_a_held_launch_that_found_the_gpu_idle_widens_the_margin_and_on_time_ones_narrow_it() -> None:
    clock = LaunchClock(margin_s=0.001)
    _timed(clock, 8, 0.010)
    clock.running(0.0, 8, True)
    first = clock.launch_at()
    assert first == pytest.approx(0.009)
    clock.done(0.010)
    clock.running(1.0, 8, True, idle=True)  # the launch it advised came too late
    assert (clock.held, clock.misses) == (1, 1)
    wider = clock.launch_at()
    assert wider is not None and wider == pytest.approx(1.0 + first - MISS_STEP_S)
    for i in range(200):  # on time from here: the learnt margin decays
        clock.done(0.010)
        clock.running(2.0 + i, 8, True, idle=False)
        at = clock.launch_at()
    assert at is not None and at - (2.0 + 199) == pytest.approx(first, abs=1e-5)
    assert (clock.held, clock.misses) == (201, 1)
    # A launch it did not advise (no estimate for that size) is neither held nor a miss.
    fresh = LaunchClock()
    for start in (0.0, 1.0):
        fresh.running(start, 200, True, idle=True)
        assert fresh.launch_at() is None
        fresh.done(None)
    assert (fresh.held, fresh.misses) == (0, 0)


def test_no_wait_when_the_host_needs_the_whole_step() -> None:
    clock = LaunchClock()
    clock.launched(0.004)
    _timed(clock, 4, 0.006)
    clock.running(1.0, 4, True)
    assert clock.launch_at() is None


class _SteadyClock(LaunchClock):
    """Every decode step of this CPU engine is taken to run 0.4 s on a device: the loop then waits that long
    before each launch (the CPU engine's own steps take milliseconds)."""

    def done(self, gpu_s: float | None) -> None:
        self._start, self._bucket = None, None


def _held_engine(tmp_path: Path) -> Engine:
    """A CPU engine whose every decode step is taken to run 0.4 s (_SteadyClock): its loop holds each launch."""
    engine = Engine(
        EngineConfig(
            model=str(write_tiny_hf(tmp_path)),
            cache=CacheConfig(block_size=4, num_blocks=128),
            scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, async_scheduling=True),
            device=DeviceConfig(device="cpu"),
        )
    )
    assert (
        engine._ahead is not None and engine._ahead.clock is None
    )  # on a CPU a step runs at its launch: no clock
    clock = _SteadyClock(margin_s=0.0)
    clock._gpu_s = {1: 0.4, 2: 0.4}
    engine._ahead.clock = clock
    return engine


def test_the_loop_runs_calls_while_it_holds_a_launch_back(tmp_path: Path) -> None:
    loop = EngineLoop(_held_engine(tmp_path), idle_wait_s=0.01)
    loop.start()
    try:
        outputs: queue.Queue[StepOutput] = queue.Queue()
        loop.subscribe("r", outputs.put)
        loop.call(lambda e: e.add_request("r", [5, 6, 7, 8], SamplingParams(max_tokens=6, ignore_eos=True)))
        outputs.get(timeout=30)
        outputs.get(timeout=30)  # decoding: each launch is held back about 0.4 s
        latencies = []
        for _ in range(3):
            t0 = time.perf_counter()
            loop.call(lambda e: e.has_unfinished())
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.05)
        got = [outputs.get(timeout=30) for _ in range(4)]
    finally:
        loop.stop()
    assert got[-1].finish_reason == "length"
    assert loop.launch_waits >= 3 and loop.launch_wait_seconds >= 3 * 0.3
    assert max(latencies) < 0.2  # a call waits for the loop's next pass, not for the launch it holds back


def test_a_prompt_that_arrives_during_the_wait_is_launched_at_once(tmp_path: Path) -> None:
    """Holding the launch is for arrivals to join it: once a prompt waits, the next step carries it, and its long
    launch must not start at a time the clock reckoned for a decode step's."""
    engine = _held_engine(tmp_path)
    loop = EngineLoop(engine, idle_wait_s=0.01)
    loop.start()
    try:
        outputs: dict[str, queue.Queue[StepOutput]] = {"r": queue.Queue(), "s": queue.Queue()}
        for rid, q in outputs.items():
            loop.subscribe(rid, q.put)
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        loop.call(lambda e: e.add_request("r", [5, 6, 7, 8], params))
        outputs["r"].get(timeout=30)
        outputs["r"].get(timeout=30)  # decoding: the loop now holds each launch about 0.4 s
        waits = loop.launch_waits
        time.sleep(0.05)
        t0 = time.perf_counter()
        # On the loop thread, right after the prompt is added: it waits, so nothing is held for
        held_at = loop.call(lambda e: (e.add_request("s", [9, 10, 11], params), e.launch_at())[1])
        assert held_at is None
        outputs["s"].get(timeout=30)
        first_token_s = time.perf_counter() - t0
    finally:
        loop.stop()
    assert loop.launch_waits > waits  # the loop was holding when the prompt came
    assert first_token_s < 0.25  # held to the clock's time it would take about 0.35 s


def test_the_engine_starts_each_clock_from_the_configured_margin(tmp_path: Path) -> None:
    engine = Engine(
        EngineConfig(
            model=str(write_tiny_hf(tmp_path)),
            cache=CacheConfig(block_size=4, num_blocks=64),
            scheduler=SchedulerConfig(
                max_num_seqs=4, max_num_batched_tokens=64, async_scheduling=True, late_launch_margin_s=0.0005
            ),
            device=DeviceConfig(device="cpu"),
        )
    )
    ahead = engine._ahead
    assert ahead is not None and ahead.clock is None  # no clock on a CPU
    ahead._on_cuda = True  # as on a GPU: the clock the engine would run with
    assert ahead.set_late_launch(True)
    assert ahead.clock is not None and ahead.clock.margin_s == 0.0005
