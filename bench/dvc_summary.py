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

from bench.dvc_cpu import SATURATED_CORES, process_label
from bench.dvc_headline import bound, doubling, doubling_table, headline, headline_table, judge, ratio_bound
from bench.dvc_headline import goals as headline_goals
from tandem_cli.bench import SLO
from tandem_cli.bench.plots import LatencySamples, plot_goodput_vs_rate, plot_latency_cdfs
from tandem_cli.bench.sweep import capacity, equal_load

TARGET_SHARE = 0.90
BASES = ("disagg", "colocated")  # the two 2-GPU configs: sized variants compare with these
WORKLOAD_NAMES = ("prefill-heavy", "decode-heavy", "mixed", "shared-prefix", "chat", "batch")
CLOSED_LOOP = ("batch",)  # one closed-loop run per deployment: output tokens/s, no rates
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


def saturation_table(rows: list[dict]) -> str:
    lines = ["| workload | deployment | rate (req/s) | saturated process (cores) |", "|---|---|---|---|"]
    for row in rows:
        for hot in row.get("saturated", []):
            procs = ", ".join(f"{process_label(k)} {v:.2f}" for k, v in hot.items() if k.endswith("_cores"))
            lines.append(f"| {row['workload']} | {hot['deployment']} | {hot['rate']:g} | {procs} |")
    return "\n".join(lines) if len(lines) > 2 else ""


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


def pair_table(rows: list[dict]) -> str:
    lines = ["| workload | deployment | rate (req/s) | pairs | KV handoff mean (ms) | TTFT p50 / p90 (ms) | "
             "first -> second token p50 (ms) | within SLO |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.1f}"

    for row in rows:
        for dep, points in row.get("pair_transports", {}).items():
            for r in points:
                pairs = ", ".join(f"{k} x{n}" for k, n in r["pairs"].items())
                lines.append(
                    f"| {row['workload']} | {dep} | {r['rate']:g} | {pairs} | {ms(r['kv_handoff_mean_s'])} | "
                    f"{ms(r['ttft_p50'])} / {ms(r['ttft_p90'])} | {ms(r['first_itl_p50'])} | {r['slo_share']:.0%} |"
                )
    return "\n".join(lines) if len(lines) > 2 else ""


def prefix_table(rows: list[dict]) -> str:
    lines = ["| deployment | rate (req/s) | TTFT p50 cache off (ms) | cache on (ms) | ratio | prompt tokens cached |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for row in rows:
        for dep, comparison in row.get("prefix_cache", {}).items():
            for r in comparison["rates"]:
                cached = "-" if r["cached_share"] is None else f"{r['cached_share']:.0%}"
                mark = "" if r["off_within_slo"] else " (cache off past capacity)"
                lines.append(
                    f"| {dep} | {r['rate']:g}{mark} | {r['ttft_p50_off'] * 1e3:.0f} | "
                    f"{r['ttft_p50_on'] * 1e3:.0f} | {r['ratio']:.1f}x | {cached} |"
                )
    return "\n".join(lines) if len(lines) > 2 else ""


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


def capacity_table(rows: list[dict]) -> str:
    """Every deployment's capacity (at --slo and at INTERACTIVE), per GPU, the ratio to its 2-GPU base, and the
    GPU-seconds it spends per 1,000 output tokens at its capacity."""
    lines = [
        "| workload | deployment | GPUs | capacity (req/s) | per GPU | vs 2-GPU base | interactive (req/s) | "
        "GPU-s / 1k output tokens at capacity |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        for dep, cap in row.items():
            if not isinstance(cap, dict) or "capacity_rps" not in cap:
                continue
            ratio = row.get("scaling", {}).get(dep, {}).get("capacity_ratio")
            inter, gpu_s = cap.get("capacity_rps_interactive"), cap.get("gpu_s_per_1k_tokens_at_capacity")
            mark = {None: "", "at least": ">= ", "below": "below lowest rate: "}
            lines.append(
                f"| {row['workload']} | {dep} | {cap['gpus']} | {mark[cap.get('capacity_bound')]}"
                f"{cap['capacity_rps']} | {cap['capacity_rps_per_gpu']:.2f} | "
                f"{'-' if ratio is None else f'{ratio:.2f}x'} | "
                f"{'-' if inter is None else mark[cap.get('capacity_bound_interactive')] + str(inter)} | "
                f"{'-' if gpu_s is None else f'{gpu_s:.2f}'} |"
            )
    return "\n".join(lines)


def closed_loop_table(rows: list[dict]) -> str:
    """Closed-loop workloads (batch): output tokens/s per deployment."""
    lines = []
    for row in rows:
        if row["workload"] not in CLOSED_LOOP:
            continue
        for dep, r in row.items():
            if isinstance(r, dict) and "output_tokens_per_s" in r:
                full = r.get("full_batch_output_tokens_per_s")
                lines.append(
                    f"| {row['workload']} | {dep} | {r['gpus']} | {r['concurrency']} | "
                    f"{r['output_tokens_per_s']:,.0f} | {'-' if full is None else f'{full:,.0f}'} | "
                    f"{r['output_tokens_per_s_per_gpu']:,.0f} | {r['ttft_p90'] * 1e3:.0f} / {r['tpot_p99'] * 1e3:.0f} | "
                    f"{every_run(r)} |"
                )
    if not lines:
        return ""
    head = ["| workload | deployment | GPUs | in flight | output tokens/s | while the batch was full | per GPU | "
            "TTFT p90 / TPOT p99 (ms) | every run, in order |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    return "\n".join(head + lines)


def every_run(row: dict) -> str:
    """Each run's output tokens/s in the order they ran (rounds, then repeats), so an A/B shows its spread."""
    return " / ".join(f"{t:,.0f}" for t in row.get("every_run_output_tokens_per_s", [])) or "-"


def markdown(rows: list[dict]) -> str:
    lines = ["| workload | disagg cap. (req/s/GPU) | colocated cap. (req/s/GPU) | ratio | equal load | "
             "ITL p99 disagg / coloc (ms) | TTFT p99 disagg / coloc (ms) | KV transfer (ms) |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.0f}"

    for r in rows:
        if not set(BASES) & set(r):
            continue  # neither 2-GPU base ran: the headline table covers the sized deployments
        d, c, eq = r.get("disagg", {}), r.get("colocated", {}), r.get("at_equal_load", {})
        ratio = r.get("capacity_ratio")
        dt, ct = eq.get("disagg", {}), eq.get("colocated", {})
        lines.append(
            f"| {r['workload']} | {d.get('capacity_rps_per_gpu', '-')} | {c.get('capacity_rps_per_gpu', '-')} | "
            f"{'-' if ratio is None else f'{ratio:.2f}x'} | {r.get('equal_load_rps', '-')} req/s | "
            f"{ms(dt.get('itl_p99'))} / {ms(ct.get('itl_p99'))} | {ms(dt.get('ttft_p99'))} / "
            f"{ms(ct.get('ttft_p99'))} | {ms(dt.get('kv_transfer_mean_s'))} |"
        )
    return "\n".join(lines) if len(lines) > 2 else ""


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


def load_runs(name: str, dirs: list[Path]) -> dict[str, dict]:
    """Every deployment's results file for workload `name` in `dirs` (the first is --out, the rest --include).
    A deployment found in two of them is one sweep split over device calls when both files ran the same
    commit, card, workload, SLO and config (apart from the router's ports and paths) at different rates: its
    points are merged, in rate order. Anything else is refused rather than one file silently chosen."""
    runs: dict[str, dict] = {}
    seen: dict[str, Path] = {}
    for d in dirs:
        for path in sorted(d.glob(f"*_{name}.json")):
            dep = path.name.split("_")[0]
            run = json.loads(path.read_text())
            if dep in seen:
                why = _unmergeable(runs[dep], run)
                if why:
                    raise ValueError(
                        f"{dep} {name} is in both {seen[dep]} and {path} ({why}); include one of them"
                    )
                runs[dep] = {
                    **runs[dep],
                    "points": sorted([*runs[dep]["points"], *run["points"]], key=_point_key),
                }
                continue
            seen[dep], runs[dep] = path, run
    return runs


# A sweep's identity: what must agree for two files' points to be one sweep's.
_SWEEP_KEYS = ("commit", "card", "gpus", "workload_spec", "slo", "repeats")
# Router settings each call picks afresh (free ports, a temporary file_sd path).
_ROUTER_ADDRESSES = ("port", "http_port", "metrics_port", "metrics_file_sd")


def _unmergeable(a: dict, b: dict) -> str:
    """Why two results files of one deployment and workload are not parts of one sweep ("" when they are)."""
    for key in _SWEEP_KEYS:
        if a.get(key) != b.get(key):
            return f"different {key}"
    if _config_sans_addresses(a) != _config_sans_addresses(b):
        return "different config"
    rates_a, rates_b = ({p["settings"].get("rate") for p in r["points"]} for r in (a, b))
    if rates_a & rates_b:
        return f"both ran {sorted(rates_a & rates_b)} req/s"
    return ""


def _config_sans_addresses(run: dict) -> dict:
    config = dict(run.get("config") or {})
    router = {k: v for k, v in (config.get("router") or {}).items() if k not in _ROUTER_ADDRESSES}
    return {**config, "router": router}


def _point_key(point: dict) -> tuple[float, int, int]:
    return (point["settings"].get("rate") or 0.0, point.get("round") or 0, point.get("repeat") or 0)


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
