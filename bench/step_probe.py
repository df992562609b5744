"""StepProbe: an engine's steps timed and classified (prefill or decode), and a decode step's wall time split
into the GPU's part and the host work the GPU waits for (bench/offline_throughput.py, bench/ttft.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from model_runtime.engine import Engine, StepOutput


@dataclass
class StepSplit:
    """Wall time of engine steps by kind (a step that ran any prefill or preemption-recompute chunk counts as
    prefill), the largest batch a step ran, and the scheduler's preemptions. For decode steps on a GPU also where
    the wall time went: `decode_gpu_s` from the forward's first launch to the sampler's last kernel (CUDA events),
    `decode_schedule_s` the host work before the forward is launched (scheduling, host inputs), and
    `decode_post_s` the host work after the sampled tokens reached the host (stop rules, outputs). The GPU idles
    during those two: they are what overlapping the host with the GPU would hide."""

    prefill_steps: int = 0
    prefill_s: float = 0.0
    decode_steps: int = 0
    decode_s: float = 0.0
    decode_gpu_s: float = 0.0
    decode_schedule_s: float = 0.0
    decode_post_s: float = 0.0
    peak_running: int = 0
    preempted: int = 0


class StepProbe:
    """Times engine steps and classifies each from the engine's own StepRecord (engine.last_step): a step that
    ran any prompt chunk or preemption recompute counts as prefill. Use probe.step() in place of engine.step().
    It wraps the engine's runner.execute, sampler and scheduler.advance (instance attributes, undone by close())
    to split a decode step's wall time (StepSplit): on a GPU the forward-to-sampler span is timed by CUDA
    events, on a CPU (where the work runs as it is called) by the clock."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.split = engine, StepSplit()
        self._marks: dict[str, float] = {}
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        if engine.runner.device.type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        self._sampler = engine.sampler
        self._wrap()
        self._wrapped = True

    def _wrap(self) -> None:
        engine, marks, events = self.engine, self._marks, self._events
        execute, sampler, advance = engine.runner.execute, engine.sampler, engine.scheduler.advance

        def timed_execute(*args, **kwargs):
            marks["launch"] = time.perf_counter()
            if events is not None:
                events[0].record()
            return execute(*args, **kwargs)

        def timed_sampler(*args, **kwargs):
            result = sampler(*args, **kwargs)
            if events is not None:
                events[1].record()
            marks["sampled"] = time.perf_counter()
            return result

        def timed_advance(*args, **kwargs):
            marks["tokens"] = time.perf_counter()  # the engine advances right after the tokens reach the host
            return advance(*args, **kwargs)

        # setattr: instance attributes over the methods, which mypy would refuse as assignments
        setattr(engine.runner, "execute", timed_execute)  # noqa: B010
        setattr(engine, "sampler", timed_sampler)  # noqa: B010
        setattr(engine.scheduler, "advance", timed_advance)  # noqa: B010

    def step(self) -> list[StepOutput]:
        self._marks.clear()
        t0 = time.perf_counter()
        outputs = self.engine.step()  # ends in the sampler's .tolist(): the step's GPU work is done
        t1 = time.perf_counter()
        seconds, s, record, marks = t1 - t0, self.split, self.engine.last_step, self._marks
        if record is None:  # nothing was runnable
            return outputs
        s.peak_running = max(s.peak_running, record.batch_size)
        s.preempted += record.num_preempted
        if record.num_prefill:
            s.prefill_steps, s.prefill_s = s.prefill_steps + 1, s.prefill_s + seconds
        else:
            s.decode_steps, s.decode_s = s.decode_steps + 1, s.decode_s + seconds
            if {"launch", "sampled", "tokens"} <= marks.keys():
                if self._events is not None:
                    s.decode_gpu_s += self._events[0].elapsed_time(self._events[1]) / 1e3
                else:
                    s.decode_gpu_s += marks["sampled"] - marks["launch"]
                s.decode_schedule_s += marks["launch"] - t0
                s.decode_post_s += t1 - marks["tokens"]
        return outputs

    def close(self) -> None:
        """Give the engine back its own methods and sampler."""
        if self._wrapped:
            vars(self.engine.runner).pop("execute")  # the class's methods show through again
            vars(self.engine.scheduler).pop("advance")
            setattr(self.engine, "sampler", self._sampler)  # noqa: B010
            self._wrapped = False
