"""Late launch (scheduler.late_launch) against the step-ahead engine without it, on one engine and one GPU.

A step-ahead engine schedules step N+1 as soon as step N starts; with late launch its serving loop schedules
N+1 shortly before N's expected end, so a request that arrived while N ran joins N+1 rather than N+2
(model_runtime.launch_clock). What that should change: an arriving request's first token comes about one step
sooner; what it must not change: the decode throughput (a launch held back too long leaves the GPU idle).

One engine (Llama-3-8B shape, dummy weights, bf16, CUDA graphs, steps ahead) behind an EngineLoop, as in a
worker, with the clock switched between phases (Engine.set_late_launch), in the order early, late, early, late;
each early/late pair draws the same prompts and arrival times (runs 33-34 drew new ones for every phase):

    closed   --closed sequences added at once, each --output tokens: decode tokens/s and the steps held back
    open     Poisson arrivals at each --rates for --duration s (each --prompt and --output tokens): TTFT and
             TPOT per request, p50 / p90

    python3 bench/late_launch.py                          # one GPU, about two minutes
    python3 bench/late_launch.py --smoke                  # CPU, tiny model (no clock on a CPU: checks the driver)

Prints a table per phase and writes JSON (default bench/results/late_launch_<gpu>.json).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import harness as gpu
from model_runtime.config import SchedulerConfig
from model_runtime.engine import Engine, StepOutput
from model_runtime.engine_loop import EngineLoop
from model_runtime.request import SamplingParams
from tandem_cli.bench.report import git_commit

MODES = ("early", "late", "early", "late")


@dataclass(frozen=True)
class Phase:
    mode: str  # early | late
    kind: str  # closed | open
    rate: float  # arrivals per second (open), 0 for closed
    requests: int
    output_tokens: int
    wall_s: float
    tokens_per_s: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    tpot_p50_ms: float
    tpot_p90_ms: float
    launch_waits: int
    launch_wait_mean_ms: float
    clock_misses: int  # launches the clock timed that found the GPU idle all the same


class Recorder:
    """Each request's submit time and output times (appended on the loop thread)."""

    def __init__(self) -> None:
        self.submitted: dict[str, float] = {}
        self.outputs: dict[str, list[tuple[float, int]]] = {}
        self.finished = threading.Semaphore(0)

    def subscriber(self, rid: str):
        times = self.outputs.setdefault(rid, [])

        def on_output(out: StepOutput) -> None:
            times.append((time.perf_counter(), len(out.token_ids)))
            if out.finish_reason is not None:
                self.finished.release()

        return on_output

    def latencies(self) -> tuple[list[float], list[float], int]:
        ttft, tpot, tokens = [], [], 0
        for rid, times in self.outputs.items():
            if not times:
                continue
            ttft.append(times[0][0] - self.submitted[rid])
            n = sum(count for _, count in times)
            tokens += n
            if n > 1:
                tpot.append((times[-1][0] - times[0][0]) / (n - times[0][1]))
        return ttft, tpot, tokens


def submit(loop: EngineLoop, rec: Recorder, rid: str, prompt: list[int], sampling: SamplingParams) -> None:
    loop.subscribe(rid, rec.subscriber(rid))
    rec.submitted[rid] = time.perf_counter()
    loop.submit(lambda e: e.add_request(rid, prompt, sampling))


def run_phase(loop: EngineLoop, mode: str, kind: str, rate: float, count: int, args: argparse.Namespace,
              vocab: int, seed: int) -> Phase:  # fmt: skip
    loop.call(lambda e: e.set_late_launch(mode == "late"))
    waits0, waited0 = loop.launch_waits, loop.launch_wait_seconds
    misses0 = loop.call(lambda e: e.launch_clock_stats()[1])
    rec = Recorder()
    sampling = SamplingParams(temperature=0, max_tokens=args.output, ignore_eos=True)
    prompts = gpu.random_prompts(count, args.prompt, vocab, seed)
    rng = random.Random(seed)
    t0 = due = time.perf_counter()
    for i, prompt in enumerate(prompts):
        if kind == "open":  # Poisson arrivals
            due += rng.expovariate(rate)
            while (left := due - time.perf_counter()) > 0:
                time.sleep(min(0.002, left))
        submit(loop, rec, f"{mode}-{kind}-{rate:g}-{seed}-{i}", prompt, sampling)
    for _ in range(count):
        if not rec.finished.acquire(timeout=args.timeout_s):
            raise gpu.BenchError(f"{mode} {kind}: a request did not finish within {args.timeout_s} s")
    wall = time.perf_counter() - t0
    ttft, tpot, tokens = rec.latencies()
    if tokens != count * args.output:
        raise gpu.BenchError(f"{mode} {kind}: {tokens} tokens, expected {count * args.output}")
    waits = loop.launch_waits - waits0
    waited = loop.launch_wait_seconds - waited0
    misses = loop.call(lambda e: e.launch_clock_stats()[1]) - misses0
    return Phase(
        mode, kind, rate, count, tokens, wall, tokens / wall, _ms(ttft, 0.5), _ms(ttft, 0.9), _ms(tpot, 0.5),
        _ms(tpot, 0.9), waits, 1e3 * waited / waits if waits else 0.0, misses,
    )  # fmt: skip


def _ms(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return 1e3 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="30,60", help="open-loop arrival rates, requests/s (default 30,60)")
    p.add_argument("--duration", type=float, default=8.0, help="seconds of arrivals per open phase")
    p.add_argument("--closed", type=int, default=256, help="sequences of the closed phase (0: none)")
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--output", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--timeout-s", type=float, default=120.0, help="per request, after the arrivals")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model: checks the driver")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/late_launch_<gpu>.json)")
    args = p.parse_args(argv)
    if args.smoke:
        args.rates, args.duration, args.closed, args.prompt, args.output = "20", 0.5, 4, 8, 4
    rates = [float(r) for r in args.rates.split(",") if r]
    where = gpu.RunDevice.for_mode(args.smoke)
    model = gpu.smoke_model_dir() if args.smoke else "dummy:llama-3-8b"
    limits = SchedulerConfig(args.max_num_seqs, 2048, max_model_len=args.prompt + args.output + 16,
                             async_scheduling=True)  # fmt: skip
    engine: Engine = gpu.build_engine(model, where, limits, 0.9)
    able = engine.set_late_launch(True)
    loop = EngineLoop(engine)
    loop.start()
    vocab = engine.model_config.vocab_size
    phases: list[Phase] = []
    try:
        # Warm-up: a whole closed batch, not kept. After a small one the first closed phase ran 11% slower than
        # the others in run 38 (early 18,569, late 20,801, early 20,906, late 20,795 tok/s), and the first phase
        # is always early.
        run_phase(loop, "early", "closed", 0.0, args.closed or 8, args, vocab, seed=1)
        for i, mode in enumerate(MODES):
            if args.closed:
                phases.append(
                    run_phase(loop, mode, "closed", 0.0, args.closed, args, vocab, seed=100 + i // 2)
                )
            for rate in rates:
                count = max(1, round(rate * args.duration))
                phases.append(run_phase(loop, mode, "open", rate, count, args, vocab, seed=200 + i // 2))
            gpu.log(f"{mode} done ({i + 1}/{len(MODES)})")
    finally:
        loop.stop()
    print(f"late launch possible here: {able}")
    print(f"{'mode':>5} {'kind':>6} {'rate':>5} {'reqs':>5} {'tok/s':>8} {'TTFT p50':>9} {'p90':>7} "
          f"{'TPOT p50':>9} {'p90':>7} {'held':>6} {'mean ms':>8} {'misses':>6}")  # fmt: skip
    for ph in phases:
        print(f"{ph.mode:>5} {ph.kind:>6} {ph.rate:>5.0f} {ph.requests:>5} {ph.tokens_per_s:>8.0f} "
              f"{ph.ttft_p50_ms:>9.2f} {ph.ttft_p90_ms:>7.2f} {ph.tpot_p50_ms:>9.2f} {ph.tpot_p90_ms:>7.2f} "
              f"{ph.launch_waits:>6} {ph.launch_wait_mean_ms:>8.2f} {ph.clock_misses:>6}")  # fmt: skip
    for kind, rate in [("closed", 0.0)] * bool(args.closed) + [("open", r) for r in rates]:
        rows = {
            m: [ph for ph in phases if ph.kind == kind and ph.rate == rate and ph.mode == m]
            for m in ("early", "late")
        }
        mean = {m: (statistics.mean(ph.tokens_per_s for ph in r), statistics.mean(ph.ttft_p50_ms for ph in r),
                    statistics.mean(ph.tpot_p50_ms for ph in r)) for m, r in rows.items() if r}  # fmt: skip
        if len(mean) == 2:
            (te, fe, pe), (tl, fl, pl) = mean["early"], mean["late"]
            print(f"{kind} {rate:.0f}/s: late / early: tokens/s {tl / te:.3f}, TTFT p50 {fl:.2f} vs {fe:.2f} ms, "
                  f"TPOT p50 {pl:.2f} vs {pe:.2f} ms")  # fmt: skip
    out = gpu.result_path(args.out, "late_launch", where.device, args.smoke)
    gpu.write_json_atomic(out, {
        "benchmark": "late launch vs early, one engine behind an EngineLoop",
        "device": gpu.device_name(where.device), "torch": torch.__version__, "commit": git_commit(),
        "settings": vars(args), "late_launch_possible": able, "phases": [asdict(ph) for ph in phases],
    })  # fmt: skip
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
