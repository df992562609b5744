"""The host's work per decode step at a large batch, on the CPU: what bounds a step once the GPU's part is short.

On one H200 (docs/performance.md, "Step-ahead scheduling") a step of 512 sequences with FP8 weights needs
12.75 ms of GPU time and still takes 17.2 ms with the steps scheduled ahead: the host's cycle (outputs, stop
rules, advance, schedule, host inputs, sampler inputs) is the bound. That work is Python and numpy and does not
depend on the model's size, so it is measured here on the CPU with a tiny model: each decode step's wall time
minus the time inside the model's forward and logits (timed around them; on the CPU they run as they are called).

    python3 bench/host_step.py                      # batch 512, synchronous and ahead, 200 steps each
    python3 bench/host_step.py --batches 64,256,512 --profile 20
    python3 bench/host_step.py --device cuda --profile 30   # on a GPU: the host work the CPU run cannot see

Prints ms per step (wall, model, host) for each batch and mode and writes bench/results/host_step_<device>.json
(--out to change). --profile N prints the N functions with the most own time (cProfile; the timing columns come
from the unprofiled runs).

--device cuda runs the same tiny model on the GPU with its CUDA graphs, so the GPU's part of a step is a small
fraction of a millisecond and a step's wall time is the host's cycle, including what only a GPU run has:
pinned host copies, graph replays and the sampler's launches. There "model" is the host's time inside the
forward and logits calls (their launches), not the GPU's.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import platform
import pstats
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import (
    BLOCK_SIZE,
    RunDevice,
    build_engine,
    device_name,
    random_prompts,
    smoke_model_dir,
    write_json_atomic,
)
from model_runtime.config import SchedulerConfig
from model_runtime.engine import Engine
from model_runtime.request import SamplingParams

PROMPT_TOKENS = 16
WARM_UP_STEPS = 5


@dataclass(frozen=True)
class HostRow:
    batch: int
    ahead: bool
    steps: int
    wall_ms: float  # per decode step
    model_ms: float  # inside the model's forward and logits
    host_ms: float  # the rest: what the GPU would wait for (synchronous) or overlap (ahead)


class ModelClock:
    """Adds up the time spent in the runner's model forward and logits (instance attributes over the methods;
    close() takes them away)."""

    def __init__(self, engine: Engine) -> None:
        self.model, self.seconds = engine.runner.model, 0.0
        forward, logits = self.model.forward, self.model.compute_logits

        def timed(fn):
            def call(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - t0

            return call

        setattr(self.model, "forward", timed(forward))  # noqa: B010
        setattr(self.model, "compute_logits", timed(logits))  # noqa: B010

    def close(self) -> None:
        vars(self.model).pop("forward")
        vars(self.model).pop("compute_logits")


def full_batch(model: str, batch: int, ahead: bool, steps: int, where: RunDevice) -> Engine:
    """An engine holding `batch` running requests past their prompts, each with room for the steps."""
    longest = PROMPT_TOKENS + steps + 64
    scheduler = SchedulerConfig(batch, batch * PROMPT_TOKENS, max_model_len=longest, async_scheduling=ahead)
    blocks = batch * -(-longest // BLOCK_SIZE) + 64  # a tiny model's cache sized by memory would be millions
    engine = build_engine(model, where, scheduler, 0.9, num_blocks=blocks)
    sampling = SamplingParams(temperature=0, max_tokens=steps + 32, ignore_eos=True)
    for i, prompt in enumerate(
        random_prompts(batch, PROMPT_TOKENS, engine.model_config.vocab_size, seed=batch)
    ):
        engine.add_request(f"r-{i}", prompt, sampling)
    for _ in range(WARM_UP_STEPS):  # the prefill step, then decode steps at the full batch
        engine.step()
    if engine.scheduler.num_running != batch or engine.scheduler.num_waiting:
        raise RuntimeError(f"batch {batch}: {engine.scheduler.num_running} running after the warm-up")
    return engine


def measure(model: str, batch: int, ahead: bool, steps: int, where: RunDevice) -> HostRow:
    engine = full_batch(model, batch, ahead, steps, where)
    clock = ModelClock(engine)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    if where.device.startswith("cuda"):
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    clock.close()
    if engine.last_step is None or engine.last_step.num_prefill or engine.last_step.batch_size != batch:
        raise RuntimeError(f"batch {batch}: the measured steps were not all decode steps at the full batch")
    per = 1e3 / steps
    return HostRow(batch, ahead, steps, wall * per, clock.seconds * per, (wall - clock.seconds) * per)


def profile(model: str, batch: int, ahead: bool, steps: int, top: int, where: RunDevice) -> str:
    engine = full_batch(model, batch, ahead, steps, where)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="512", help="comma list of batch sizes (default 512)")
    p.add_argument("--modes", default="sync,ahead", help="sync, ahead or both (default both)")
    p.add_argument("--steps", type=int, default=200, help="decode steps timed per batch and mode")
    p.add_argument(
        "--repeats", type=int, default=3, help="timed runs per batch and mode; the fastest is kept"
    )
    p.add_argument("--profile", type=int, default=0, help="print the N functions with the most own time")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: see above (default cpu)")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/host_step_<device>.json)")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    modes = [m.strip() for m in args.modes.split(",")]
    if any(m not in ("sync", "ahead") for m in modes) or args.steps < 1 or args.repeats < 1:
        p.error("--modes: sync and/or ahead; --steps and --repeats: >= 1")
    torch.set_num_threads(1)  # the tiny model's forward is not what is measured
    where, model = RunDevice.for_mode(smoke=args.device == "cpu"), smoke_model_dir()
    rows = []
    for batch in batches:
        for mode in modes:
            runs = [measure(model, batch, mode == "ahead", args.steps, where) for _ in range(args.repeats)]
            row = min(runs, key=lambda r: r.host_ms)
            rows.append(row)
            print(
                f"batch {batch:>4} {mode:>5}: {row.wall_ms:7.2f} ms a step, model {row.model_ms:6.2f}, "
                f"host {row.host_ms:6.2f} (fastest of {args.repeats} x {args.steps} steps)",
                flush=True,
            )
            if args.profile:
                print(profile(model, batch, mode == "ahead", args.steps, args.profile, where))
    default = Path(__file__).parent / "results" / f"host_step_{args.device}.json"
    out = Path(args.out) if args.out else default
    doc = {
        "benchmark": "host work per decode step (tiny model; wall minus the model's forward and logits calls)",
        "device": device_name(where.device),
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "settings": vars(args),
        "rows": [asdict(r) for r in rows],
    }
    write_json_atomic(out, doc)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
