"""bench/tp_decode.py's host timeline: when each tensor-parallel step was built, published, received and queued.

Every rank records time.monotonic_ns (one clock for every process of a host) around its part of each step:

    lead      started | host batch built | published | all kernels queued | greedy ids on the host
    follower  received | all kernels queued

in step order, into a file beside the benchmark's JSON (<out>.rank<r>.steps.json). Once the ranks have exited,
`report_timeline` matches the records step by step, prints per label the median microseconds from the lead's
start of a step to each event, adds them to the JSON as host_timeline_us and removes the files.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from model_runtime.host_batch import build_host_batch
from model_runtime.model_runner import ModelRunner
from model_runtime.parallel.group import TPGroup
from model_runtime.parallel.step_sync import StepReceiver
from model_runtime.request import SchedulerOutput
from model_runtime.runner_setup import RankRunner

# The lead's records: (label, started, built, published, queued, done).
_LEAD_TIMES: list[tuple[str, int, int, int, int, int]] = []


def steps_path(out: str, rank: int) -> Path:
    return Path(out).with_suffix(f".rank{rank}.steps.json")


def lead_step(runner: ModelRunner, out: SchedulerOutput, label: str, use_graphs: bool = True) -> None:
    """One step as the engine's lead runs it (ModelRunner.execute's three parts: build the host batch, publish
    it, run it; then the logits gathered and greedy ids to the host), timed between the parts."""
    start = time.monotonic_ns()
    batch = build_host_batch(out, runner.layout.block_size, runner.block_tables)
    built = time.monotonic_ns()
    if runner.tensor_parallel is not None:
        runner.tensor_parallel.publish(batch)
    published = time.monotonic_ns()
    logits = runner.execute_batch(batch, use_graphs=use_graphs)
    queued = time.monotonic_ns()
    logits.argmax(-1).tolist()
    _LEAD_TIMES.append((label, start, built, published, queued, time.monotonic_ns()))


def write_lead_times(out: str) -> None:
    steps_path(out, 0).write_text(json.dumps(_LEAD_TIMES))


def follow_timed(built: RankRunner, group: TPGroup, out: str, shared_memory: bool = True) -> None:
    """model_runtime.parallel.follower.follow, recording when each step arrived and was queued.
    `shared_memory=False` makes every rank send the steps over gloo (the ranks agree at the first message)."""
    receiver = StepReceiver(group, shared_memory=shared_memory)
    times = []
    while (batch := receiver.receive()) is not None:
        received = time.monotonic_ns()
        built.runner.execute_batch(batch)
        times.append((received, time.monotonic_ns()))
    steps_path(out, group.rank).write_text(json.dumps(times))


def host_timeline(out: str, ranks: int) -> dict[str, dict[str, float]]:
    """Per label, the median microseconds from the lead's start of a step to: its host batch built, published,
    the lead's kernels all queued, its ids on the host, and each follower's receipt and queued kernels (from the
    files the ranks wrote, which it then removes)."""
    paths = [steps_path(out, r) for r in range(ranks)]
    if not paths[0].exists():
        return {}
    lead = json.loads(paths[0].read_text())
    followers = [json.loads(p.read_text()) if p.exists() else [] for p in paths[1:]]
    spans: dict[str, dict[str, list[float]]] = {}
    for i, (label, start, *events) in enumerate(lead):
        span = spans.setdefault(label, {})
        for name, t in zip(("lead_built", "lead_published", "lead_queued", "lead_done"), events):
            span.setdefault(name, []).append((t - start) / 1e3)
        for r, steps in enumerate(followers, start=1):
            if i < len(steps):
                span.setdefault(f"rank{r}_received", []).append((steps[i][0] - start) / 1e3)
                span.setdefault(f"rank{r}_queued", []).append((steps[i][1] - start) / 1e3)
    for path in paths:
        path.unlink(missing_ok=True)
    return {label: {k: float(np.median(v)) for k, v in span.items()} for label, span in spans.items()}


def report_timeline(out: str, ranks: int) -> None:
    """Print the timeline and add it to the benchmark's JSON at `out` (nothing when the ranks recorded none)."""
    timeline = host_timeline(out, ranks)
    if not timeline:
        return
    print("host timeline, median us from the lead's start of a step:")
    for label, spans in timeline.items():
        print(f"  {label}: " + ", ".join(f"{k} {v:.0f}" for k, v in spans.items()))
    doc = json.loads(Path(out).read_text())
    doc["host_timeline_us"] = timeline
    Path(out).write_text(json.dumps(doc, indent=2) + "\n")
