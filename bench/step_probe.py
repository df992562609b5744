"""StepProbe: an engine's steps timed and classified (prefill or decode), and a decode step's wall time split
into the GPU's part and the host work the GPU waits for (bench/offline_throughput.py, bench/ttft.py)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from model_runtime.engine import Engine, StepOutput
from tandem_cli.bench.stats import summarize


@dataclass
class StepSplit:
    """Wall time of engine steps by kind (a step that ran any prefill or preemption-recompute chunk counts as
    prefill), the largest batch a step ran, and the scheduler's preemptions. For decode steps on a GPU also where
    the wall time went: `decode_gpu_s` from the forward's first launch to the sampler's last kernel (CUDA events),
    `decode_schedule_s` the host work before the forward is launched (scheduling, host inputs), and
    `decode_post_s` the host work after the sampled tokens reached the host (stop rules, outputs). The GPU idles
    during those two: they are what overlapping the host with the GPU would hide. `decode_gpu_idle_s` (GPU only)
    adds up the GPU's idle time right before each decode launch (from the previous launch's sampler to this
    launch's start), which is what the host cost a step with its steps scheduled ahead; the `decode_wall_*`
    fields are the median, 90th percentile and longest decode step (filled by StepProbe.close), which tell an
    even cost per step from a few long ones. Steps with prompt chunks get the same GPU span and idle time
    (`prefill_gpu_s`, `prefill_gpu_idle_s`) for those that sampled (`prefill_timed_steps`: a step whose every
    chunk is part of a longer prompt runs no sampler to end its span), so a prompt step that waits on the host
    shows as wall time above its GPU time. `prefill_input_wait_s` adds up, for those steps, the time from the
    previous launch's sampler to the moment this launch's inputs were on the device (the copies of an eager
    step's host batch, runner._upload): near the copies' own few microseconds when the host enqueued them while
    the step before still ran, longer by whatever the GPU waited for the host to build and send them. The
    idle time cannot show that wait: a launch's first event is recorded before its inputs are built.
    """

    prefill_steps: int = 0
    prefill_s: float = 0.0
    decode_steps: int = 0
    decode_s: float = 0.0
    decode_gpu_s: float = 0.0
    decode_schedule_s: float = 0.0
    decode_post_s: float = 0.0
    decode_gpu_idle_s: float = 0.0
    decode_wall_p50_s: float = 0.0
    decode_wall_p90_s: float = 0.0
    decode_wall_max_s: float = 0.0
    peak_running: int = 0
    preempted: int = 0
    prefill_timed_steps: int = 0
    prefill_gpu_s: float = 0.0
    prefill_gpu_idle_s: float = 0.0
    prefill_input_wait_s: float = 0.0


@dataclass
class _Launch:
    """A runner.execute's CUDA events: end None while (or when) no sampler ran after it (such a launch is not
    timed)."""

    start: torch.cuda.Event
    end: torch.cuda.Event | None = None
    inputs: torch.cuda.Event | None = None  # after the eager inputs' copies were enqueued (runner._upload)


class StepProbe:
    """Times engine steps and classifies each from the engine's own StepRecord (engine.last_step): a step that
    ran any prompt chunk or preemption recompute counts as prefill. Use probe.step() in place of engine.step().
    It wraps the engine's runner.execute, sampler and scheduler.advance (instance attributes, undone by close())
    to split a decode step's wall time (StepSplit): on a GPU the forward-to-sampler span is timed by CUDA
    events, on a CPU (where the work runs as it is called) by the clock.

    With steps scheduled ahead (scheduler.async_scheduling) a step() returns the tokens of the step launched
    by the step() before it, while the GPU still runs the one it has just launched. Either way each step() that
    ran something returns the record of the oldest launch not yet returned, so launches are queued in order and
    each is classified by the record it comes back with (no second pass over the step's chunks); its events are
    read once they have completed (at a later step(), or in close()). The host work of a step ahead overlaps the
    GPU's, so it is not split (schedule and post stay 0): wall against GPU per step says what the overlap left."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.split = engine, StepSplit()
        self.ahead = engine.config.scheduler.async_scheduling
        self._marks: dict[str, float] = {}
        self._cuda = engine.runner.device.type == "cuda"
        self._launches: deque[_Launch] = deque()  # GPU: per runner.execute, oldest first, until its record
        # GPU: every launch that came back with its record, in order, not yet read, and whether it decoded
        self._timed: list[tuple[_Launch, bool]] = []
        self._previous_end: torch.cuda.Event | None = None  # the sampler of the last launch read
        self._decode_walls: list[float] = []
        self._sampler = engine.sampler
        self._wrap()
        self._wrapped = True

    def _wrap(self) -> None:
        engine, marks = self.engine, self._marks
        execute, sampler, advance = engine.runner.execute, engine.sampler, engine.scheduler.advance
        upload = engine.runner._upload
        self._own_upload = vars(engine.runner).get(
            "_upload"
        )  # an instance's own wrapper, put back by close()

        def timed_execute(*args, **kwargs):
            if self._cuda:
                start = torch.cuda.Event(enable_timing=True)
                start.record()
                self._launches.append(_Launch(start))
            marks["launch"] = time.perf_counter()
            return execute(*args, **kwargs)

        def timed_upload(*args, **kwargs):
            inputs = upload(*args, **kwargs)
            if self._launches:  # the copies of the latest launch's inputs are enqueued
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                self._launches[-1].inputs = event
            return inputs

        def timed_sampler(*args, **kwargs):
            result = sampler(*args, **kwargs)
            if self._launches:  # the sampler of the latest launch
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self._launches[-1].end = end
            marks["sampled"] = time.perf_counter()
            return result

        def timed_advance(*args, **kwargs):
            marks["tokens"] = time.perf_counter()  # the engine advances right after the tokens reach the host
            return advance(*args, **kwargs)

        # setattr: instance attributes over the methods, which mypy would refuse as assignments
        setattr(engine.runner, "execute", timed_execute)  # noqa: B010
        setattr(engine.runner, "_upload", timed_upload)  # noqa: B010
        setattr(engine, "sampler", timed_sampler)  # noqa: B010
        setattr(engine.scheduler, "advance", timed_advance)  # noqa: B010

    def _read_events(self, wait: bool) -> None:
        """Adds the GPU time (and the idle time before it) of every launch that has completed, by kind, in launch
        order, up to the first one still running (all of them if `wait`)."""
        done, s = 0, self.split
        for launch, decode in self._timed:
            start, end = launch.start, launch.end
            if end is not None:
                if wait:
                    end.synchronize()
                elif not end.query():
                    break
            if end is not None:
                gpu = start.elapsed_time(end) / 1e3
                idle = inputs = 0.0
                if self._previous_end is not None:
                    idle = max(0.0, self._previous_end.elapsed_time(start) / 1e3)
                    if launch.inputs is not None:
                        inputs = max(0.0, self._previous_end.elapsed_time(launch.inputs) / 1e3)
                if decode:
                    s.decode_gpu_s, s.decode_gpu_idle_s = s.decode_gpu_s + gpu, s.decode_gpu_idle_s + idle
                else:
                    s.prefill_gpu_s, s.prefill_gpu_idle_s = s.prefill_gpu_s + gpu, s.prefill_gpu_idle_s + idle
                    s.prefill_input_wait_s += inputs
                    s.prefill_timed_steps += 1
            self._previous_end = end
            done += 1
        del self._timed[:done]

    def step(self) -> list[StepOutput]:
        self._marks.clear()
        t0 = time.perf_counter()
        outputs = self.engine.step()  # synchronous: ends in the sampler's .tolist(), the step's GPU work done
        t1 = time.perf_counter()
        seconds, s, record, marks = t1 - t0, self.split, self.engine.last_step, self._marks
        if record is None:  # nothing was runnable
            return outputs
        if self._launches:  # the launch whose record this is
            launch = self._launches.popleft()
            self._timed.append((launch, not record.num_prefill))
        self._read_events(wait=False)
        s.peak_running = max(s.peak_running, record.batch_size)
        s.preempted += record.num_preempted
        if record.num_prefill:
            s.prefill_steps, s.prefill_s = s.prefill_steps + 1, s.prefill_s + seconds
            if not self._cuda and not self.ahead and {"launch", "sampled"} <= marks.keys():
                s.prefill_gpu_s += marks["sampled"] - marks["launch"]
                s.prefill_timed_steps += 1
        else:
            s.decode_steps, s.decode_s = s.decode_steps + 1, s.decode_s + seconds
            self._decode_walls.append(seconds)
            if not self.ahead and {"launch", "sampled", "tokens"} <= marks.keys():
                if not self._cuda:
                    s.decode_gpu_s += marks["sampled"] - marks["launch"]
                s.decode_schedule_s += marks["launch"] - t0
                s.decode_post_s += t1 - marks["tokens"]
        return outputs

    def close(self) -> None:
        """Read the launches still timing, sum up the decode steps' wall times, and give the engine back its own
        methods and sampler."""
        self._read_events(wait=True)
        if self._decode_walls:
            walls = summarize(self._decode_walls)
            assert walls.p50 is not None and walls.p90 is not None and walls.max is not None  # values given
            self.split.decode_wall_p50_s, self.split.decode_wall_p90_s = walls.p50, walls.p90
            self.split.decode_wall_max_s = walls.max
        if self._wrapped:
            vars(self.engine.runner).pop("execute")  # the class's methods show through again
            vars(self.engine.runner).pop("_upload")
            if self._own_upload is not None:
                setattr(self.engine.runner, "_upload", self._own_upload)  # noqa: B010
            vars(self.engine.scheduler).pop("advance")
            setattr(self.engine, "sampler", self._sampler)  # noqa: B010
            self._wrapped = False
