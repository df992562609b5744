"""bench/disagg_vs_colocated.py's points: one rate's run sent through `tandem bench` (bench_point), what the
results file keeps of it (point_record), its progress line's handoff part (handoff_line) and the warning when the
drain cut requests short (drain_warning)."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict
from pathlib import Path

from bench.dvc_deployments import Server
from bench.dvc_workloads import DECODE_HEAVY, PREFILL_HEAVY, SMOKE_MIX, Workload, chat_trace, mixed_trace
from tandem_cli.bench import BenchReport, BenchSettings, parse_dist, run_benchmark
from tandem_cli.bench.plots import LatencySamples


def bench_point(
    server: Server, workload: Workload, rate: float, seconds: float, seed: int, args: argparse.Namespace
) -> BenchReport:
    """Poisson arrivals at `rate` for `seconds`; the count bound (20% above the expected number) only guards
    against a long random tail, the time bound decides how many are sent."""
    closed = workload.concurrency > 0  # closed loop: `seconds` of sending, as many requests as that takes
    count = workload.concurrency * 50 if closed else math.ceil(rate * seconds * 1.2) + 1
    trace = None
    if workload.mixed:
        trace = str(server.work / f"mixed_{seed}.jsonl")
        mixed_trace(Path(trace), count, seed, SMOKE_MIX if args.smoke else (PREFILL_HEAVY, DECODE_HEAVY))
    elif workload.chat:
        trace = str(server.work / f"chat_{seed}.jsonl")
        chat_trace(Path(trace), count, seed, workload)
    placeholder = SMOKE_MIX[0] if args.smoke else PREFILL_HEAVY  # lengths come from the trace when mixed
    settings = BenchSettings(
        server=server.bench_server, num_requests=count, rate=None if closed else rate,
        concurrency=workload.concurrency if closed else None, burstiness=1.0,
        input_len=parse_dist(placeholder[0] if workload.mixed else workload.input_len, "--input-len"),
        output_len=parse_dist(placeholder[1] if workload.mixed else workload.output_len, "--output-len"),
        trace=trace, seed=seed, duration_s=seconds, drain_s=args.drain, timeout_s=300.0, slo=args.slo,
        shared_prefix=0 if workload.chat else workload.shared_prefix, processes=args.client_processes,
    )  # fmt: skip
    return run_benchmark(settings, progress=True)


def point_record(report: BenchReport, kv: dict | None) -> dict:
    """One sweep point for the results file: the report without per-request rows, plus latency samples."""
    data = json.loads(report.to_json())
    data.pop("requests")
    samples = LatencySamples.from_report(report)
    data["samples"] = {k: [round(v, 5) for v in vals] for k, vals in asdict(samples).items()}
    # Each succeeded request's TTFT, TPOT and e2e, so the summary can judge another SLO set (dvc_summary.INTERACTIVE).
    data["slo_samples"] = [
        [None if v is None else round(v, 5) for v in (r.ttft, r.tpot, r.e2e)]
        for r in report.requests
        if r.outcome == "succeeded"
    ]
    data["kv_transfer"] = kv
    return data


def handoff_line(point: dict) -> str:
    """Where a disaggregated point's handoffs spent their time (means, ms) and the first token -> second token
    gap a client saw (p50, ms)."""
    kv = point.get("kv_transfer")
    if not kv:
        return ""
    gaps = sorted(point["samples"].get("first_itl", []))
    gap = f"; first->second token p50 {gaps[len(gaps) // 2] * 1e3:.1f} ms" if gaps else ""
    phases = " ".join(f"{k} {v * 1e3:.2f}" for k, v in sorted(kv.get("phases_mean_s", {}).items()))
    pairs = point.get("pairs")
    over = f" over {', '.join(f'{k} x{n}' for k, n in pairs.items())}" if pairs else ""
    if kv["mean_s"] is None:
        return f"; phase means ms ({phases})"
    armed = f", {kv['armed']:.0f} of {kv['transfers']:.0f} armed" if kv.get("armed") else ""
    return f"; KV handoff mean {kv['mean_s'] * 1e3:.2f} ms{over}{armed} ({phases}){gap}"


def full_batch_line(point: dict) -> str:
    """The closed-loop line's rate while every slot was busy (the report's full_batch), "" without one."""
    full = point.get("full_batch")
    if not full:
        return ""
    return (
        f" ({full['output_tokens_per_s']:,.0f} while the batch was full, "
        f"{full['from_s']:.0f}-{full['to_s']:.0f} s)"
    )


def steps_line(point: dict) -> str:
    """Each worker role's engine steps over a point (from kv_delta's "steps"): steps a second, sequences a step,
    prompt tokens computed a second and the mean step wall time, so a closed-loop run shows whether its time went
    to prefill or to decode steps, and any Triton kernel built during the point (each holds up a step for up to
    a second: a run that had them is slower for it); "" when no worker reported steps."""
    kv = point.get("kv_transfer") or {}
    seconds = point.get("duration_s") or 0.0
    parts = []
    for role, sums in sorted((kv.get("steps") or {}).items()):
        step = (kv.get("phases_mean_s") or {}).get(f"{role}.step")
        wall = f", {step * 1e3:.1f} ms a step" if step is not None else ""
        if sums.get("launch_waits"):
            wall += f", {sums['launch_waits']:.0f} launches held ({sums.get('launch_misses', 0):.0f} found the GPU idle)"
        if sums.get("kernel_builds"):
            wall += f", {sums['kernel_builds']:.0f} Triton kernels built during it"
        parts.append(
            f"{role}: {sums['steps'] / seconds:,.0f} steps/s of {sums['batch_seqs'] / sums['steps']:.1f} sequences, "
            f"{sums['prefill_tokens'] / seconds:,.0f} prompt tokens/s{wall}"
            if seconds > 0
            else f"{role}: {sums['steps']:.0f} steps"
        )
    workers = [w for w in (kv.get("steps_by_worker") or {}).values() if w["steps"]]
    if len(workers) > 1:
        parts.append(
            "per worker: "
            + " / ".join(f"{w['batch_seqs'] / w['steps']:.1f}" for w in workers)
            + " sequences a step, "
            + " / ".join(f"{w['prefill_tokens'] / 1e3:.0f}k" for w in workers)
            + " prompt tokens"
        )
    return f"; {'; '.join(parts)}" if parts else ""


def drain_warning(report: BenchReport, drain_s: float) -> str:
    """A warning line when requests were still running at the drain's end (cancelled: they count as SLO misses),
    naming how long the slowest finished one took, so a run whose drain is shorter than its workload's outputs
    need is not mistaken for an overloaded deployment; "" when none was cut."""
    cancelled = report.counts.cancelled
    if not cancelled:
        return ""
    finished = [r.e2e for r in report.requests if r.outcome == "succeeded" and r.e2e is not None]
    slowest = f"; the slowest finished request took {max(finished):.1f} s" if finished else ""
    return (
        f"{cancelled} of {report.counts.sent} requests were still running {drain_s:g} s after the last one was sent "
        f"and were cancelled (counted as SLO misses){slowest}: unless the deployment was overloaded, raise --drain"
    )
