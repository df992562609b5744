"""The long decode steps of an offline run, and what ran during each: Python's garbage collector, Triton compiling
a kernel, or PyTorch's CUDA caching allocator going back to the driver (a retry frees its whole cache).

One H200, run 28 (docs/performance.md, "Step-ahead scheduling"): FP8 with steps scheduled ahead at 128/128 had a
median decode step of 12.66 ms and a longest one of 669 ms (bf16 ahead: 16.21 and 539 ms). One or two such steps
make up the whole gap between the mean step (15.15 ms) and the GPU's time per step (12.66 ms), about a tenth
of the run's wall time. This runs the same engine and load as `bench/offline_throughput.py` (one variant, one
shape) and times every step on its own:

    python3 bench/diag/long_steps.py                                  # fp8-ahead, 128/128, 1000 prompts
    python3 bench/diag/long_steps.py --variant bf16-ahead --top 8
    python3 bench/diag/long_steps.py --smoke                          # the CPU check: tiny model, seconds

Prints the `--top` longest steps with the step index, kind (prefill or decode, from the step's record), batch,
wall time, the garbage collections that ran inside the step (ms and generations), the Triton kernels built
(model_runtime.kernel_builds: compiled, or loaded from Triton's disk cache) and the caching allocator's retries
and device allocations; then the median decode step and every kernel built during the run. Writes every step's
row to --out (default bench/results/long_steps_<gpu>.json; --smoke: the temp dir).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import harness as gpu
from bench.offline_drive import Shape, concurrency, warm_up
from bench.offline_throughput import parse_shapes
from bench.offline_variants import VARIANTS
from model_runtime import kernel_builds
from model_runtime.config import SchedulerConfig
from model_runtime.engine import Engine
from model_runtime.heap import freeze_startup_objects
from model_runtime.request import SamplingParams
from tandem_cli.bench.report import git_commit


@dataclass(frozen=True)
class StepRow:
    index: int
    kind: str  # "prefill" (any prompt chunk or recompute) or "decode", from the record the step returned
    batch: int
    wall_ms: float
    gc_ms: float  # collections that ran inside the step
    gc_generations: tuple[int, ...]
    triton_compiled: int  # Triton kernel variants compiled (or loaded from its disk cache) during the step
    kernels: tuple[str, ...]  # their names (model_runtime.kernel_builds)
    alloc_retries: int  # the caching allocator freed its cache and retried a cudaMalloc
    device_allocs: int  # cudaMalloc calls


class GcClock:
    """Python's collections as they happen (gc.callbacks): (start, seconds, generation)."""

    def __init__(self) -> None:
        self.events: list[tuple[float, float, int]] = []
        self._started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._started = now
        else:
            self.events.append((self._started, now - self._started, int(info["generation"])))

    def __enter__(self) -> GcClock:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)

    def since(self, t0: float) -> tuple[float, tuple[int, ...]]:
        inside = [(s, g) for start, s, g in self.events if start >= t0]
        return sum(s for s, _ in inside) * 1e3, tuple(g for _, g in inside)


def allocator_counts(cuda: bool) -> tuple[int, int]:
    if not cuda:
        return 0, 0
    stats = torch.cuda.memory_stats()
    return int(stats.get("num_alloc_retries", 0)), int(stats.get("num_device_alloc", 0))


def run(engine: Engine, shape: Shape, prompts: list[list[int]], limit: int, cuda: bool) -> list[StepRow]:
    """offline_drive.drive's load (at most `limit` requests in the engine, topped up as they finish), each step
    timed alone."""
    kernel_builds.watch()  # each kernel built in a step, named with Triton's specialization of it
    sampling = SamplingParams(temperature=0, max_tokens=shape.output_len, ignore_eos=True)
    pending, in_flight = deque(enumerate(prompts)), 0
    rows: list[StepRow] = []
    with GcClock() as clock:
        while pending or in_flight:
            while pending and in_flight < limit:
                i, prompt = pending.popleft()
                engine.add_request(f"r-{i}", prompt, sampling)
                in_flight += 1
            builds, (retries, allocs) = kernel_builds.counts(), allocator_counts(cuda)
            t0 = time.perf_counter()
            outputs = engine.step()
            wall = time.perf_counter() - t0
            in_flight -= sum(1 for out in outputs if out.finish_reason is not None)
            record = engine.last_step
            if record is None:
                continue
            gc_ms, generations = clock.since(t0)
            retries_after, allocs_after = allocator_counts(cuda)
            compiled, entries = built_since(builds)
            rows.append(
                StepRow(
                    len(rows), "prefill" if record.num_prefill else "decode", record.batch_size, wall * 1e3,
                    gc_ms, generations, compiled, tuple(e.split(" (", 1)[0] for e in entries),
                    retries_after - retries, allocs_after - allocs,
                )
            )  # fmt: skip
    return rows


def built_since(before: kernel_builds.KernelBuilds) -> tuple[int, list[str]]:
    """How many kernels were built after `before`, and the last kernel_builds.MAX_NAMES of them, each with its
    specialization."""
    now = kernel_builds.counts()
    new = now.startup + now.after_start - before.startup - before.after_start
    return new, list(now.recent[len(now.recent) - min(new, len(now.recent)) :])


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", default="fp8-ahead", choices=sorted(VARIANTS), help="default fp8-ahead")
    p.add_argument("--shape", default=None, help="INPUT/OUTPUT (default 128/128; smoke 16/8)")
    p.add_argument("--num-prompts", type=int, default=None, help="default 1000 (smoke 6)")
    p.add_argument("--max-num-seqs", type=int, default=512)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--top", type=int, default=10, help="how many of the longest steps to print")
    p.add_argument(
        "--freeze",
        action="store_true",
        help="after start-up, what a worker does (model_runtime.heap.freeze_startup_objects)",
    )
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, float32, no graphs")
    p.add_argument(
        "--out",
        default=None,
        help="JSON path (default bench/results/long_steps_<gpu>.json; smoke: the temp dir)",
    )
    args = p.parse_args(argv)
    where = gpu.RunDevice.for_mode(args.smoke)
    model = gpu.smoke_model_dir() if args.smoke else "dummy:llama-3-8b"
    [(shape, n)] = parse_shapes(args.shape or ("16/8" if args.smoke else "128/128"), str(args.num_prompts or (6 if args.smoke else 1000)))  # fmt: skip
    variant = VARIANTS[args.variant]
    limits = SchedulerConfig(
        args.max_num_seqs, args.max_num_batched_tokens, max_model_len=shape.input_len + shape.output_len + 16,
        async_scheduling=variant.ahead,
    )  # fmt: skip
    engine = gpu.build_engine(
        model, where, limits, 0.9, quantization=variant.quantization, cache_dtype=variant.cache_dtype
    )
    warm_up(engine, shape)
    if args.freeze:
        freeze_startup_objects()
    prompts = gpu.random_prompts(n, shape.input_len, engine.model_config.vocab_size, seed=shape.input_len)
    limit = concurrency(engine, shape, n)
    gpu.synchronize(where.device)
    before = kernel_builds.counts()
    t0 = time.perf_counter()
    rows = run(engine, shape, prompts, limit, where.device.startswith("cuda"))
    gpu.synchronize(where.device)
    wall = time.perf_counter() - t0
    _, built = built_since(before)
    decode = [r.wall_ms for r in rows if r.kind == "decode"]
    median = statistics.median(decode) if decode else 0.0
    print(f"{args.variant} {shape.key}: {n} prompts, {limit} at once, {len(rows)} steps in {wall:.2f} s")
    print(f"{'step':>5} {'kind':>8} {'batch':>5} {'wall ms':>8} {'gc ms':>7} {'gc gens':>8} {'compiled':>8} "
          f"{'retries':>7} {'cudaMalloc':>10} kernels")  # fmt: skip
    for r in sorted(rows, key=lambda r: -r.wall_ms)[: args.top]:
        gens = ",".join(map(str, r.gc_generations)) or "-"
        print(f"{r.index:>5} {r.kind:>8} {r.batch:>5} {r.wall_ms:>8.2f} {r.gc_ms:>7.2f} {gens:>8} "
              f"{r.triton_compiled:>8} {r.alloc_retries:>7} {r.device_allocs:>10} {' '.join(r.kernels)}")  # fmt: skip
    print(f"decode steps: {len(decode)}, median {median:.2f} ms, sum {sum(decode) / 1e3:.2f} s")
    print(f"Triton kernels built during the run: {len(built)}")
    for entry in built:
        print(f"  {entry}")
    out = gpu.result_path(args.out, "long_steps", where.device, args.smoke)
    doc = {
        "benchmark": "long steps of an offline run and what ran inside them",
        "device": gpu.device_name(where.device),
        "torch": torch.__version__,
        "commit": git_commit(),
        "settings": vars(args),
        "wall_s": wall,
        "decode_median_ms": median,
        "kernels_built_during_run": built,
        "steps": [asdict(r) for r in rows],
    }
    gpu.write_json_atomic(out, doc)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
