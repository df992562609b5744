"""Driving one engine through one offline shape (bench/offline_throughput.py): how many prompts it runs at once,
the warm-up, and the loop that keeps that many in the engine, with progress lines, the budget's stop and the
optional kernel profiles of a few decode steps and of a few steps that carry prompt chunks."""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass

from bench import harness as gpu
from bench.step_probe import StepProbe, StepSplit
from bench.step_profile import print_profile, profile_step
from model_runtime.engine import Engine
from model_runtime.heap import frozen_while_running
from model_runtime.request import SamplingParams

PROGRESS_EVERY_S = 10.0


@dataclass(frozen=True)
class Shape:
    input_len: int
    output_len: int

    @property
    def key(self) -> str:
        return f"{self.input_len}/{self.output_len}"


@dataclass(frozen=True)
class Driven:
    """What drive() measured: tokens per request, the steps' split, whether every request finished before the
    deadline, and the kernel profiles asked for (None when not asked or not reached)."""

    counts: list[int]
    split: StepSplit
    complete: bool
    decode_profile: dict | None
    prefill_profile: dict | None


def concurrency(engine: Engine, shape: Shape, num_prompts: int) -> int:
    per_seq = engine.layout.blocks_for_tokens(shape.input_len + shape.output_len)
    fits = engine.layout.usable_blocks // per_seq
    if fits < 1:
        raise gpu.BenchError(f"{shape.key}: a sequence needs {per_seq} KV blocks, the cache has fewer")
    return min(num_prompts, engine.config.scheduler.max_num_seqs, fits)


def warm_up(engine: Engine, shape: Shape) -> None:
    """Compiles the kernels for this prompt length before the clock starts."""
    sampling = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for i, prompt in enumerate(gpu.random_prompts(2, shape.input_len, engine.model_config.vocab_size, 7)):
        engine.add_request(f"warm-{i}", prompt, sampling)
    while engine.has_unfinished():
        engine.step()


def drive(
    engine: Engine,
    shape: Shape,
    prompts: list[list[int]],
    limit: int,
    deadline: gpu.Deadline,
    profile: bool = False,
    name: str | None = None,
    profile_prefill: bool = False,
) -> Driven:
    """Runs the prompts, at most `limit` in the engine at once. `profile`: once every prompt is in and 10 decode steps ran, the
    kernels of 5 more decode steps (torch profiler, after 3 unprofiled ones). `profile_prefill`: once 10 steps
    with prompt chunks ran and at least 8 more prompts wait, the kernels of 3 such steps (after 3 unprofiled;
    they carry the running sequences' decode tokens too, as every step while prompts wait does). `name`: the
    progress lines' label (default "tandem SHAPE")."""
    sampling = SamplingParams(temperature=0, max_tokens=shape.output_len, ignore_eos=True)
    pending, counts = deque(enumerate(prompts)), [0] * len(prompts)
    in_flight, finished, next_log = 0, 0, time.monotonic() + PROGRESS_EVERY_S
    probe, decode_profile, prefill_profile = StepProbe(engine), None, None
    outputs: list = []

    def collect() -> None:
        outputs.extend(probe.step())

    with frozen_while_running():  # as LLM.generate runs: the engine's own objects out of full collections
        try:
            while pending or in_flight:
                while pending and in_flight < limit:
                    i, prompt = pending.popleft()
                    engine.add_request(f"r-{i}", prompt, sampling)
                    in_flight += 1
                ready = not pending and engine.scheduler.num_waiting == 0 and probe.split.decode_steps >= 10
                waiting = len(pending) + engine.scheduler.num_waiting
                prompts_ahead = probe.split.prefill_steps >= 10 and waiting >= 8
                if profile and decode_profile is None and ready and in_flight > 0:
                    found = profile_step(collect, reps=5)
                    decode_profile = dataclasses.asdict(found) | {"batch": engine.scheduler.num_running}
                    print_profile(f"{shape.key} decode at batch {engine.scheduler.num_running}", found)
                elif profile_prefill and prefill_profile is None and prompts_ahead:
                    running = engine.scheduler.num_running
                    found = profile_step(collect, reps=3)
                    prefill_profile = dataclasses.asdict(found) | {"running": running, "waiting": waiting}
                    print_profile(f"{shape.key} steps with prompt chunks, {running} running", found)
                else:
                    collect()
                for out in outputs:
                    counts[int(out.request_id[2:])] += len(out.token_ids)
                    if out.finish_reason is not None:
                        in_flight, finished = in_flight - 1, finished + 1
                outputs.clear()
                if time.monotonic() >= next_log:
                    next_log += PROGRESS_EVERY_S
                    gpu.log(
                        f"{name or 'tandem ' + shape.key}: {finished}/{len(prompts)} requests done, {sum(counts)} tokens"
                    )
                if deadline.must_stop():
                    gpu.log(f"tandem {shape.key}: out of time, aborting {in_flight + len(pending)} requests")
                    break
        finally:
            probe.close()
    complete = not pending and in_flight == 0
    for i in range(0 if complete else len(prompts)):
        engine.abort(f"r-{i}")
    return Driven(counts, probe.split, complete, decode_profile, prefill_profile)
