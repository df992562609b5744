"""bench/disagg_vs_colocated.py's summary: capacities per deployment and workload, disaggregated vs colocated at
equal load, scaling from 2 GPUs to more, goal checks, tables and plots, rebuilt from the saved point files.

A results file holds every run of every rate ("repeats" runs each; files without the field hold one). Each rate
stands for its worse run (the lower share within the SLOs): capacity needs every run to meet the target, and
the tails at equal load are the worse run's. A rate with fewer runs than "repeats" (a sweep cut short by its
budget) is left out."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from bench.dvc_cpu import SATURATED_CORES
from bench.dvc_headline import bound, doubling, doubling_table, headline, headline_table, judge, ratio_bound
from bench.dvc_headline import goals as headline_goals
from bench.dvc_runs import load_runs
from bench.dvc_tables import (
    BASES,
    CLOSED_LOOP,
    capacity_table,
    closed_loop_table,
    markdown,
    pair_table,
    prefix_table,
    saturation_table,
)
from tandem_cli.bench import SLO
from tandem_cli.bench.plots import LatencySamples, plot_goodput_vs_rate, plot_latency_cdfs
from tandem_cli.bench.sweep import capacity, equal_load

TARGET_SHARE = 0.90
WORKLOAD_NAMES = ("prefill-heavy", "decode-heavy", "mixed", "shared-prefix", "chat", "batch")
# Issue 20's second SLO set, judged from each point's per-request latencies (slo_samples): a chat that must feel
# instant (the sweep itself runs at --slo, the relaxed set by default).
INTERACTIVE = SLO(ttft=0.5, tpot=0.025)
BATCH_GOAL_TOKENS_S = 24_000.0  # issue 20: output tokens/s of the batch case on 4 GPUs
NO_CACHE = "-nocache"  # bench/dvc_names.py: the same deployment with its prefix cache off
AUTOSCALE = "-autoscale"  # ... and the same deployment as the starting point of the SLO autoscaler
AUTOSCALE_GOAL = 0.90  # issue 14: >= 90% of the best fixed split's goodput on each workload
PREFIX_TTFT_GOAL = 3.0  # issue 14: with a shared 2k-token system prompt, TTFT p50 >= 3x lower with the cache


def share(point: dict) -> float:
    return float(point["goodput"]["share"]) if point["goodput"] else 0.0


def share_points(points: list[dict]) -> list[tuple[float, float]]:
    return [(p["settings"]["rate"], share(p)) for p in points]


def rate_points(run: dict) -> list[dict]:
    """One point per rate, in ascending rate (a refined sweep runs some out of order): the worse of its runs,
    for rates with all of their runs."""
    by_rate: dict[float, list[dict]] = {}
    for point in run["points"]:
        by_rate.setdefault(point["settings"]["rate"], []).append(point)
    complete = [runs for rate, runs in sorted(by_rate.items()) if len(runs) >= run.get("repeats", 1)]
    return [min(runs, key=share) for runs in complete]


def share_at(point: dict, slo: SLO) -> float | None:
    """The share of the point's sent requests that met `slo` (SLO.meets on each succeeded request's TTFT, TPOT
    and e2e); None for a point recorded without them."""
    samples, sent = point.get("slo_samples"), point["counts"]["sent"]
    if samples is None or not sent:
        return None
    return sum(1 for ttft, tpot, e2e in samples if slo.meets(ttft, tpot, e2e)) / sent


def capacity_at(points: list[dict], slo: SLO) -> float | None:
    """capacity() under another SLO set; None when a point lacks its per-request latencies."""
    shares = [share_at(p, slo) for p in points]
    known = [v for v in shares if v is not None]
    if len(known) < len(shares):
        return None
    return capacity([(p["settings"]["rate"], v) for p, v in zip(points, known)], TARGET_SHARE)


def gpu_seconds_per_1k_tokens(point: dict, gpus: int) -> float | None:
    """GPU-seconds spent per 1,000 output tokens at this point (every GPU of the deployment counts)."""
    rate = point.get("output_token_throughput") or 0.0
    return gpus * 1000.0 / rate if rate > 0 else None


def repeat_spread(run: dict) -> float | None:
    """The largest difference in share between two runs of one rate (how noisy the sweep was); None with one run."""
    by_rate: dict[float, list[float]] = {}
    for point in run["points"]:
        by_rate.setdefault(point["settings"]["rate"], []).append(share(point))
    spreads = [max(s) - min(s) for s in by_rate.values() if len(s) > 1]
    return max(spreads) if spreads else None


def tails(point: dict) -> dict:
    return {"ttft_p90": point["ttft"]["p90"], "ttft_p99": point["ttft"]["p99"], "tpot_p99": point["tpot"]["p99"],
            "itl_p99": point["itl"]["p99"], "slo_share": share(point),
            "kv_transfer_mean_s": (point["kv_transfer"] or {}).get("mean_s")}  # fmt: skip


def summarize_closed_loop(name: str, runs: dict[str, dict]) -> dict:
    """A closed-loop workload: each deployment's output tokens/s (the worse of its runs), per GPU too."""
    out: dict = {"workload": name}
    for dep, run in runs.items():
        if not run["points"]:
            continue
        worst = min(run["points"], key=lambda p: p.get("output_token_throughput") or 0.0)
        tokens = worst.get("output_token_throughput") or 0.0
        out[dep] = {"gpus": run["gpus"], "card": run["card"], "concurrency": run["workload_spec"]["concurrency"],
                    "output_tokens_per_s": tokens, "output_tokens_per_s_per_gpu": tokens / run["gpus"],
                    "full_batch_output_tokens_per_s": (worst.get("full_batch") or {}).get("output_tokens_per_s"),
                    "runs": len(run["points"]), "gpu_s_per_1k_tokens": gpu_seconds_per_1k_tokens(worst, run["gpus"]),
                    "every_run_output_tokens_per_s": [p.get("output_token_throughput") or 0.0 for p in run["points"]],
                    "ttft_p90": worst["ttft"]["p90"], "tpot_p99": worst["tpot"]["p99"]}  # fmt: skip
    return out


def summarize_workload(name: str, runs: dict[str, dict], slo: SLO, out_dir: Path) -> dict:
    if name in CLOSED_LOOP:
        return summarize_closed_loop(name, runs)
    out: dict = {"workload": name}
    points = {dep: rate_points(run) for dep, run in runs.items()}
    for dep, run in runs.items():
        cap = capacity(share_points(points[dep]), TARGET_SHARE)
        at_cap = next((p for p in points[dep] if p["settings"]["rate"] == cap), None)
        rates = [p["settings"]["rate"] for p in points[dep]]
        inter = capacity_at(points[dep], INTERACTIVE)
        out[dep] = {
            "gpus": run["gpus"], "capacity_rps": cap, "capacity_rps_per_gpu": cap / run["gpus"], "card": run["card"],
            "repeats": run.get("repeats", 1), "repeat_spread": repeat_spread(run),
            "capacity_rps_interactive": inter,
            # "at least" / "below": the capacity is a bound, the sweep did not reach a miss / started past one
            "capacity_bound": bound(cap, rates), "capacity_bound_interactive": bound(inter, rates),
            "gpu_s_per_1k_tokens_at_capacity": gpu_seconds_per_1k_tokens(at_cap, run["gpus"]) if at_cap else None,
        }  # fmt: skip
    series = {d: [(rate, 100 * s) for rate, s in share_points(p)] for d, p in points.items()}
    plot_goodput_vs_rate(series, out_dir / f"goodput_{name}.png", threshold=100 * TARGET_SHARE, title=name)
    out["saturated"] = saturated_points(points)
    out["scaling"] = scaling(out, runs)
    out["prefix_cache"] = prefix_comparison(points)
    out["autoscaler"] = autoscaler_comparison(out, runs, points)
    out["pair_transports"] = pair_transports(points)
    out["headline"] = headline(out, points)
    out["mode_doubling"] = doubling(out["headline"])
    if not set(BASES) <= set(runs):
        return out
    dis, col = points["disagg"], points["colocated"]
    rate = equal_load(share_points(dis), share_points(col), TARGET_SHARE)
    if rate is None:
        return out
    # Every deployment's point at that rate (a sized one may not have run it).
    at = {d: p for d, ps in points.items() for p in ps if p["settings"]["rate"] == rate}
    out["equal_load_rps"] = rate
    out["at_equal_load"] = {d: tails(p) for d, p in at.items()}
    cap_col = out["colocated"]["capacity_rps"]
    out["capacity_ratio"] = out["disagg"]["capacity_rps"] / cap_col if cap_col else None
    itl_dis, itl_col = at["disagg"]["itl"]["p99"], at["colocated"]["itl"]["p99"]
    out["itl_p99_ratio_colocated_over_disagg"] = itl_col / itl_dis if itl_dis and itl_col else None
    samples = {d: LatencySamples(**{k: tuple(v) for k, v in p["samples"].items()}) for d, p in at.items()}
    plot_latency_cdfs(
        samples, out_dir / f"latency_cdf_{name}.png", slo=slo, title=f"{name} at {rate:g} req/s"
    )
    return out


def saturated_points(points: dict[str, list[dict]]) -> list[dict]:
    """The points at which the `tandem serve` process (router) or a bench client process used SATURATED_CORES
    or more (the point's `cpu`, dvc_cpu.CpuMeter): their latencies include that process's own queueing."""
    rows = []
    for dep, ps in points.items():
        for p in ps:
            hot = {k: v for k, v in p.get("cpu", {}).items() if v >= SATURATED_CORES}
            if hot:
                rows.append({"deployment": dep, "rate": p["settings"]["rate"], **hot})
    return rows


def prefix_comparison(points: dict[str, list[dict]]) -> dict:
    """Each "<dep>-nocache" against "<dep>": TTFT p50 without / with the prefix cache at every rate both ran, and
    the share of prompt tokens the cache served. The goal holds when the ratio is >= PREFIX_TTFT_GOAL at every
    such rate where the cache-less deployment still met the SLO target (past its capacity its queue only grows,
    and any ratio there says nothing about the cache)."""
    result = {}
    for off, off_points in points.items():
        on = off.removesuffix(NO_CACHE)
        if not off.endswith(NO_CACHE) or on not in points:
            continue
        cached = {p["settings"]["rate"]: p for p in points[on]}
        rows = []
        for p in off_points:
            q = cached.get(p["settings"]["rate"])
            if q is None or not p["ttft"]["p50"] or not q["ttft"]["p50"]:
                continue
            use = q.get("prefix_cache") or {}
            rows.append({"rate": p["settings"]["rate"], "ttft_p50_off": p["ttft"]["p50"],
                         "ttft_p50_on": q["ttft"]["p50"], "ratio": p["ttft"]["p50"] / q["ttft"]["p50"],
                         "cached_share": use.get("cached_tokens", 0) / use["prompt_tokens"] if use else None,
                         "off_within_slo": share(p) >= TARGET_SHARE})  # fmt: skip
        judged = [r["ratio"] for r in rows if r["off_within_slo"]]
        result[on] = {"rates": rows, "goal_met": bool(judged) and min(judged) >= PREFIX_TTFT_GOAL}
    return result


def autoscaler_comparison(out: dict, runs: dict[str, dict], points: dict[str, list[dict]]) -> dict:
    """Each "<dep>-autoscale" against the best fixed deployment of its mode on as many GPUs (disagg-1p3d,
    disagg-2p2d and disagg-3p1d for disagg-2p2d-autoscale): capacity over the best one's, and the pools it had at
    each point (how it followed the load)."""
    result = {}
    for dep, run in runs.items():
        if not dep.endswith(AUTOSCALE):
            continue
        mode = dep.split("-")[0]
        fixed = {d: out[d]["capacity_rps"] for d, r in runs.items()
                 if d.split("-")[0] == mode and r["gpus"] == run["gpus"] and not d.endswith((AUTOSCALE, NO_CACHE))}  # fmt: skip
        best = max(fixed, key=lambda d: fixed[d], default=None)
        ratio = out[dep]["capacity_rps"] / fixed[best] if best and fixed[best] else None
        result[dep] = {"best_fixed": best, "fixed_capacity_rps": fixed, "ratio": ratio,
                       "goal_met": ratio is not None and ratio >= AUTOSCALE_GOAL,
                       "pools_by_rate": [(p["settings"]["rate"], p.get("pools")) for p in points[dep]]}  # fmt: skip
    return result


def pair_transports(points: dict[str, list[dict]]) -> dict:
    """Every deployment whose points recorded their pairs' transports (bench/dvc_deployments.Server.pair_totals):
    per rate, the disaggregated attempts by transport and nodes, the mean KV handoff, TTFT p50 and p90 and the
    first -> second token gap p50, so that a "-both" deployment (the router picks cuda_ipc on one node) reads
    beside its nccl and "-ipc" twins (issue 21)."""
    result = {}
    for dep, dep_points in points.items():
        rows = []
        for p in dep_points:
            if not p.get("pairs"):
                continue
            gaps = sorted(p.get("samples", {}).get("first_itl", []))
            rows.append({"rate": p["settings"]["rate"], "pairs": p["pairs"],
                         "kv_handoff_mean_s": (p.get("kv_transfer") or {}).get("mean_s"),
                         "ttft_p50": p["ttft"]["p50"], "ttft_p90": p["ttft"]["p90"],
                         "first_itl_p50": gaps[len(gaps) // 2] if gaps else None, "slo_share": share(p)})  # fmt: skip
        if rows:
            result[dep] = rows
    return result


def scaling(out: dict, runs: dict[str, dict]) -> dict:
    """Each sized deployment's capacity over its 2-GPU base's (colocated-4 over colocated, disagg-3p1d over
    disagg): the "capacity grows with GPUs" check (issue 14: >= 1.8x from 2 to 4 GPUs)."""
    result = {}
    for dep, run in runs.items():
        base = (
            "colocated" if dep.startswith("colocated-") else "disagg" if dep.startswith("disagg-") else None
        )
        if dep.endswith((NO_CACHE, AUTOSCALE)):
            continue
        if base is None or base not in runs or not out[base]["capacity_rps"]:
            continue
        result[dep] = {
            "base": base,
            "gpus": run["gpus"],
            "base_gpus": runs[base]["gpus"],
            "capacity_ratio": out[dep]["capacity_rps"] / out[base]["capacity_rps"],
            "bound": ratio_bound(
                {"bound": out[dep]["capacity_bound"]}, {"bound": out[base]["capacity_bound"]}
            ),
        }
    return result


def goal_checks(rows: list[dict]) -> dict:
    """On prefill-heavy: issue 6's targets (capacity >= 1.5x colocated, p99 ITL >= 2x lower at equal load) and
    issue 14's (a deployment on twice the GPUs serves >= 1.8x its 2-GPU base)."""
    row = next((r for r in rows if r["workload"] == "prefill-heavy"), {})
    ratio, itl = row.get("capacity_ratio"), row.get("itl_p99_ratio_colocated_over_disagg")
    doubled = {dep: s for dep, s in row.get("scaling", {}).items() if s["gpus"] == 2 * s["base_gpus"]}
    grow = {dep: s["capacity_ratio"] for dep, s in doubled.items()}
    return {"goodput_ratio": ratio, "goodput_goal_met": ratio is not None and ratio >= 1.5,
            "itl_p99_ratio": itl, "itl_goal_met": itl is not None and itl >= 2.0,
            # issue 14: twice the GPUs serve >= 1.8x (colocated-4 over colocated, disagg-2p2d/3p1d over disagg)
            "doubling": grow, "doubling_goal_met": {dep: judge({"ratio": s["capacity_ratio"], "bound": s.get("bound")}, 1.8)
                                                 for dep, s in doubled.items()},
            "prefix_ttft_goal_met": {dep: c["goal_met"] for r in rows for dep, c in r.get("prefix_cache", {}).items()},
            "autoscaler_goal_met": {f"{r['workload']}/{dep}": c["goal_met"] for r in rows
                                    for dep, c in r.get("autoscaler", {}).items()},
            # issue 20: the nightly batch case serves >= 24,000 output tokens/s on one 4-GPU node
            "batch_goal_met": {dep: c["output_tokens_per_s"] >= BATCH_GOAL_TOKENS_S for r in rows
                               if r["workload"] in CLOSED_LOOP for dep, c in r.items()
                               if isinstance(c, dict) and c.get("gpus") == 4},
            "headline": headline_goals(rows)}  # fmt: skip


def summarize(slo: SLO, out_dir: Path, include: tuple[Path, ...] = ()) -> None:
    rows = []
    for name in WORKLOAD_NAMES:
        runs = load_runs(name, [out_dir, *include])
        if runs:
            rows.append(summarize_workload(name, runs, slo, out_dir))
    summary = {
        "slo": asdict(slo),
        "target_share": TARGET_SHARE,
        "workloads": rows,
        "goals": goal_checks(rows),
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    rate_rows = [r for r in rows if r["workload"] not in CLOSED_LOOP]
    parts = (
        headline_table(rate_rows),  # issue 20's comparison, when both modes ran on as many GPUs
        doubling_table(rate_rows),
        markdown(rate_rows),
        capacity_table(rate_rows),
        prefix_table(rate_rows),
        pair_table(rate_rows),
        closed_loop_table(rows),
        saturation_table(rate_rows),
    )
    table = "\n\n".join(part for part in parts if part)
    (out_dir / "summary.md").write_text(table + "\n")
    print(table)
    print(json.dumps(summary["goals"]))
