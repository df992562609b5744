"""Where the GPU waits inside a step that carries prompt chunks, and what the host was doing then.

Run 76 (one H200, `bench/offline_throughput.py --variants bf16-ahead,fp8-ahead --shapes 2048/128`): the prompt
steps' GPU span (first launch to sampler, CUDA events) was 139.9 ms for FP8 and 215.9 ms for bf16, with no
idle time before them; run 75's profile of one such FP8 step summed 120.6 ms of kernels (bf16: 201.6). If the
difference is time the GPU spends between kernels of the step, something in the step makes the GPU wait for the
host: a synchronizing call, or a stretch of small kernels launched one by one from Python. This runs the
offline benchmark's engine and load (one variant, one shape) until `--after` prompt steps have run, then on the
following prompt steps:

1. syncs: `torch.cuda.set_sync_debug_mode("warn")` for `--sync-steps` steps; every synchronizing call is counted
   by the Python line that made it (the innermost frame of this repository).
2. gaps: the torch profiler, GPU activity only (little host overhead), `--trace-steps` steps: each step's GPU
   span, summed kernel (and copy, memset) time, and the gaps between them of at least `--min-gap-us`.
3. where: the profiler again with CPU ops and Python stacks, `--trace-steps` steps (its host overhead makes the
   gaps longer than they are): each gap is charged to the Python line that launched the work after it, and
   runtime calls of 50 us or more inside a gap (a cudaStreamSynchronize, a blocking copy) are listed by line.

    python3 bench/diag/prompt_step_gaps.py                              # fp8-ahead, 2048/128, 500 prompts
    python3 bench/diag/prompt_step_gaps.py --variant bf16-ahead
    python3 bench/diag/prompt_step_gaps.py --smoke                      # the CPU check: tiny model, seconds

Writes the summary to --out (default bench/results/prompt_step_gaps_<gpu>.json; --smoke: the temp dir) and the
attribution pass's Chrome trace beside it (gzip).
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import shutil
import sys
import tempfile
import traceback
import warnings
from collections import Counter, defaultdict, deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import harness as gpu
from bench.offline_drive import Shape, concurrency, warm_up
from bench.offline_throughput import parse_shapes
from bench.offline_variants import VARIANTS
from model_runtime.config import SchedulerConfig
from model_runtime.engine import Engine
from model_runtime.request import SamplingParams
from tandem_cli.bench.report import git_commit

REPO = Path(__file__).resolve().parents[2]
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
SLOW_CALL_US = 50.0


@dataclass
class GapSummary:
    steps: int = 0
    span_us: float = 0.0  # first GPU activity to last, summed over the steps
    busy_us: float = 0.0  # kernels, copies and memsets (overlaps counted once)
    gaps_us: float = 0.0  # gaps of at least min_gap_us
    gaps: int = 0
    by_next: list[tuple[str, float, int]] = field(default_factory=list)  # (GPU activity after, us, gaps)
    by_line: list[tuple[str, float, int]] = field(default_factory=list)  # (line, us, gaps), most first
    slow_calls: list[tuple[str, str, float, int]] = field(default_factory=list)  # (line, call, us, count)


class Load:
    """offline_drive's load: at most `limit` requests in the engine, topped up as they finish."""

    def __init__(self, engine: Engine, shape: Shape, prompts: list[list[int]], limit: int) -> None:
        self.engine, self.limit, self.in_flight = engine, limit, 0
        self.pending = deque(enumerate(prompts))
        self.added: list[str] = []
        self.sampling = SamplingParams(temperature=0, max_tokens=shape.output_len, ignore_eos=True)
        self.prompt_steps = 0

    def step(self) -> bool:
        """One engine step; True when it carried prompt chunks."""
        while self.pending and self.in_flight < self.limit:
            i, prompt = self.pending.popleft()
            self.engine.add_request(f"r-{i}", prompt, self.sampling)
            self.added.append(f"r-{i}")
            self.in_flight += 1
        outputs = self.engine.step()
        self.in_flight -= sum(1 for out in outputs if out.finish_reason is not None)
        record = self.engine.last_step
        prompt = record is not None and record.prefill_tokens > 0
        self.prompt_steps += prompt
        return prompt

    def busy(self) -> bool:
        return bool(self.pending or self.in_flight)

    def until_prompt_steps(self, count: int) -> int:
        """Steps until `count` more prompt steps ran (fewer if the load ends); returns how many steps ran."""
        target, steps = self.prompt_steps + count, 0
        while self.prompt_steps < target and self.busy():
            self.step()
            steps += 1
        return steps

    def finish(self) -> None:
        """Aborts what is left (a finished request's abort finds nothing)."""
        for request_id in self.added:
            self.engine.abort(request_id)
        self.pending.clear()
        self.in_flight = 0


def repo_line(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frame in this repository (not this file), as path(line): function."""
    for frame in reversed(stack):
        path = Path(frame.filename)
        if path == Path(__file__).resolve() or REPO not in path.parents:
            continue
        return f"{path.relative_to(REPO)}({frame.lineno}): {frame.name}"
    return "(outside the repository)"


def count_syncs(load: Load, steps: int, cuda: bool) -> tuple[int, list[tuple[str, int]]]:
    """Synchronizing calls over `steps` prompt steps, by repository line (CUDA only; the CPU has none)."""
    found: Counter[str] = Counter()
    if not cuda:
        return load.until_prompt_steps(steps), []

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        found[repo_line(traceback.extract_stack()[:-1])] += 1

    saved = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            ran = load.until_prompt_steps(steps)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = saved
    return ran, found.most_common()


def trace(load: Load, steps: int, cpu: bool, path: Path) -> tuple[dict, int]:
    """The Chrome trace of the next `steps` prompt steps (and the steps between them), as a dict, and how many
    steps ran."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    if not cpu and torch.cuda.is_available():
        activities = [ProfilerActivity.CUDA]
    with profile(activities=activities, with_stack=cpu) as prof:
        ran = load.until_prompt_steps(steps)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        with raw.open() as f:
            doc = json.load(f)
        with raw.open("rb") as src, gzip.open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return doc, ran


def _events(doc: dict, categories: tuple[str, ...]) -> list[dict]:
    return [e for e in doc.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") in categories]


def gpu_gaps(doc: dict, min_gap_us: float) -> tuple[float, float, list[tuple[float, float, dict]]]:
    """(span, busy, gaps): the GPU's first-to-last activity, its busy time (overlaps once) and each gap of at
    least min_gap_us as (start, length, the activity after it)."""
    work = sorted(_events(doc, GPU_CATEGORIES), key=lambda e: e["ts"])
    if not work:
        return 0.0, 0.0, []
    busy, gaps = 0.0, []
    start, end = work[0]["ts"], work[0]["ts"] + work[0]["dur"]
    first = start
    for e in work[1:]:
        if e["ts"] > end:
            busy += end - start
            if e["ts"] - end >= min_gap_us:
                gaps.append((end, e["ts"] - end, e))
            start = e["ts"]
        end = max(end, e["ts"] + e["dur"])
    busy += end - start
    return end - first, busy, gaps


class Frames:
    """The Python frames (the profiler's python_function events) open on each thread at a given time."""

    def __init__(self, doc: dict) -> None:
        self.by_tid: dict[object, tuple[list[float], list[dict]]] = {}
        grouped: dict[object, list[dict]] = defaultdict(list)
        for e in _events(doc, ("python_function",)):
            grouped[e.get("tid")].append(e)
        for tid, events in grouped.items():
            events.sort(key=lambda e: (e["ts"], -e["dur"]))
            self.by_tid[tid] = ([e["ts"] for e in events], events)

    def line_at(self, tid: object, t: float) -> str:
        """The innermost repository frame open at t on thread tid."""
        starts, events = self.by_tid.get(tid, ([], []))
        # Frames open at t started before it; scan back over a bounded window (frames nest, so the first open
        # one found, the latest started, is the innermost).
        i = bisect.bisect_right(starts, t)
        for e in reversed(events[max(0, i - 4000) : i]):
            if e["ts"] + e["dur"] >= t and _in_repo(e["name"]):
                return _label(e["name"])
        return "(no repository frame)"


def _in_repo(name: str) -> bool:
    """A python_function event's name is "path(line): function", the path relative to the working directory when
    the file lies under it (this repository's, run from its root), absolute otherwise."""
    path = name.split("(", 1)[0]
    if path.endswith(Path(__file__).name) or path.startswith("<"):
        return False
    return not path.startswith("/") or path.startswith(str(REPO) + "/")


def _label(name: str) -> str:
    return name.replace(str(REPO) + "/", "")


def attribute(
    doc: dict, min_gap_us: float
) -> tuple[list[tuple[str, float, int]], list[tuple[str, str, float, int]]]:
    """Each gap charged to the line that launched the activity after it; runtime calls of SLOW_CALL_US or more
    that overlap a gap, by line and call."""
    _, _, gaps = gpu_gaps(doc, min_gap_us)
    runtime = _events(doc, ("cuda_runtime", "cuda_driver"))
    launch_by_corr = {e.get("args", {}).get("correlation"): e for e in runtime}
    frames = Frames(doc)
    by_line: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for _, length, after in gaps:
        launch = launch_by_corr.get(after.get("args", {}).get("correlation"))
        line = frames.line_at(launch.get("tid"), launch["ts"]) if launch else "(launch not found)"
        by_line[line][0] += length
        by_line[line][1] += 1
    slow: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    windows = sorted((start, start + length) for start, length, _ in gaps)
    starts = [w[0] for w in windows]
    for e in runtime:
        if e["dur"] < SLOW_CALL_US:
            continue
        i = bisect.bisect_right(starts, e["ts"] + e["dur"]) - 1
        if i >= 0 and windows[i][1] >= e["ts"]:
            key = (frames.line_at(e.get("tid"), e["ts"]), e["name"])
            slow[key][0] += e["dur"]
            slow[key][1] += 1
    lines = sorted(((k, v[0], int(v[1])) for k, v in by_line.items()), key=lambda r: -r[1])
    calls = sorted(((k[0], k[1], v[0], int(v[1])) for k, v in slow.items()), key=lambda r: -r[2])
    return lines, calls


def summarize(doc: dict, steps: int, min_gap_us: float, attribute_lines: bool) -> GapSummary:
    span, busy, gaps = gpu_gaps(doc, min_gap_us)
    out = GapSummary(steps, span, busy, sum(g for _, g, _ in gaps), len(gaps))
    by_next: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for _, length, after in gaps:
        name = after.get("name", "?")
        by_next[name if len(name) <= 60 else name[:57] + "..."][0] += length
        by_next[name if len(name) <= 60 else name[:57] + "..."][1] += 1
    out.by_next = sorted(((k, v[0], int(v[1])) for k, v in by_next.items()), key=lambda r: -r[1])
    if attribute_lines:
        out.by_line, out.slow_calls = attribute(doc, min_gap_us)
    return out


def print_summary(title: str, s: GapSummary, top: int) -> None:
    per = max(s.steps, 1)
    print(f"\n{title}: {s.steps} steps, per step: GPU span {s.span_us / per / 1e3:.2f} ms, busy "
          f"{s.busy_us / per / 1e3:.2f} ms, {s.gaps / per:.0f} gaps >= the threshold, {s.gaps_us / per / 1e3:.2f} ms")  # fmt: skip
    if s.by_next:
        print(
            "  gap time by the GPU activity after it (ms per step, gaps; a copy from the host starts a step):"
        )
        for name, us, n in s.by_next[:top]:
            print(f"    {us / per / 1e3:8.3f} {n:6d}  {name}")
    if s.by_line:
        print("  gap time by the line that launched the work after it (ms per step, gaps):")
        for line, us, n in s.by_line[:top]:
            print(f"    {us / per / 1e3:8.3f} {n:6d}  {line}")
    if s.slow_calls:
        print(f"  runtime calls of {SLOW_CALL_US:.0f} us or more inside gaps (ms per step, calls):")
        for line, call, us, n in s.slow_calls[:top]:
            print(f"    {us / per / 1e3:8.3f} {n:6d}  {call}  at {line}")


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", default="fp8-ahead", choices=sorted(VARIANTS), help="default fp8-ahead")
    p.add_argument("--shape", default=None, help="INPUT/OUTPUT (default 2048/128; smoke 48/8)")
    p.add_argument("--num-prompts", type=int, default=None, help="default 500 (smoke 12)")
    p.add_argument("--max-num-seqs", type=int, default=512)
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="default 8192 (smoke 64)")
    p.add_argument(
        "--after", type=int, default=None, help="prompt steps before measuring (default 30; smoke 2)"
    )
    p.add_argument("--sync-steps", type=int, default=3)
    p.add_argument("--trace-steps", type=int, default=2)
    p.add_argument("--min-gap-us", type=float, default=5.0)
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, float32, no graphs")
    p.add_argument(
        "--out", default=None, help="JSON path (default bench/results/prompt_step_gaps_<gpu>.json)"
    )
    args = p.parse_args(argv)
    where = gpu.RunDevice.for_mode(args.smoke)
    cuda = where.device.startswith("cuda")
    model = gpu.smoke_model_dir() if args.smoke else "dummy:llama-3-8b"
    shape_text = args.shape or ("48/8" if args.smoke else "2048/128")
    [(shape, n)] = parse_shapes(shape_text, str(args.num_prompts or (12 if args.smoke else 500)))
    budget = args.max_num_batched_tokens or (64 if args.smoke else 8192)
    after = args.after if args.after is not None else (2 if args.smoke else 30)
    variant = VARIANTS[args.variant]
    limits = SchedulerConfig(
        args.max_num_seqs, budget, max_model_len=shape.input_len + shape.output_len + 16,
        async_scheduling=variant.ahead,
    )  # fmt: skip
    engine = gpu.build_engine(
        model, where, limits, 0.9, quantization=variant.quantization, cache_dtype=variant.cache_dtype
    )
    warm_up(engine, shape)
    prompts = gpu.random_prompts(n, shape.input_len, engine.model_config.vocab_size, seed=shape.input_len)
    load = Load(engine, shape, prompts, concurrency(engine, shape, n))
    load.until_prompt_steps(after)
    gpu.log(
        f"{args.variant} {shape.key}: {load.prompt_steps} prompt steps ran, {engine.scheduler.num_running} running"
    )
    ran, syncs = count_syncs(load, args.sync_steps, cuda)
    print(f"\nsynchronizing calls over {ran} steps ({args.sync_steps} with prompt chunks), by line:")
    for line, count in syncs[: args.top]:
        print(f"  {count:6d}  {line}")
    if cuda and not syncs:
        print("  none")
    out = gpu.result_path(args.out, "prompt_step_gaps", where.device, args.smoke)
    out.parent.mkdir(parents=True, exist_ok=True)
    running = engine.scheduler.num_running
    light_doc, light_steps = trace(
        load, args.trace_steps, cpu=False, path=out.with_suffix(".gpu.trace.json.gz")
    )
    light = summarize(light_doc, light_steps, args.min_gap_us, attribute_lines=False)
    print_summary(f"GPU activity only ({running} running)", light, args.top)
    del light_doc
    running = engine.scheduler.num_running
    full_doc, full_steps = trace(load, args.trace_steps, cpu=True, path=out.with_suffix(".trace.json.gz"))
    full = summarize(full_doc, full_steps, args.min_gap_us, attribute_lines=True)
    print_summary(
        f"with CPU ops and Python stacks ({running} running; host overhead lengthens gaps)", full, args.top
    )
    load.finish()
    doc = {
        "benchmark": "GPU gaps inside steps with prompt chunks, and their host causes",
        "device": gpu.device_name(where.device),
        "torch": torch.__version__,
        "commit": git_commit(),
        "settings": vars(args) | {"shape": shape.key, "num_prompts": n, "max_num_batched_tokens": budget},
        "syncs": syncs,
        "gpu_only": asdict(light),
        "attributed": asdict(full),
    }
    gpu.write_json_atomic(out, doc)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
