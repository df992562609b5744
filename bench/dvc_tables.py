"""bench/disagg_vs_colocated.py's summary as Markdown: one table per question (capacities, closed-loop
throughput, KV handoffs per pair, prefix-cache TTFT, saturated processes, the headline by workload), built from
the rows bench/dvc_summary computes."""

from __future__ import annotations

from bench.dvc_cpu import process_label

BASES = ("disagg", "colocated")  # the two 2-GPU configs: sized variants compare with these
CLOSED_LOOP = ("batch",)  # one closed-loop run per deployment: output tokens/s, no rates


def saturation_table(rows: list[dict]) -> str:
    lines = ["| workload | deployment | rate (req/s) | saturated process (cores) |", "|---|---|---|---|"]
    for row in rows:
        for hot in row.get("saturated", []):
            procs = ", ".join(f"{process_label(k)} {v:.2f}" for k, v in hot.items() if k.endswith("_cores"))
            lines.append(f"| {row['workload']} | {hot['deployment']} | {hot['rate']:g} | {procs} |")
    return "\n".join(lines) if len(lines) > 2 else ""


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
