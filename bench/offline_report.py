"""The table bench/offline_throughput.py prints last, from its JSON document: a block of rows per variant against
its ceiling, its goal, bf16 and the references, then where a decode step's wall time went."""

from __future__ import annotations

from bench.offline_variants import SPEEDUP_GOAL, VARIANTS


def print_table(doc: dict) -> None:
    """One block of rows per variant; %goal: the 60% goal on bf16 rows, the FP8 goal on fp8 rows."""
    hf, dtype = {r["shape"]: r for r in doc["transformers"]}, doc["settings"]["dtype"]
    print(f"\noffline throughput on {doc['gpu']} ({dtype}), output tokens/s")
    heads = ("tandem", "ceiling", "%ceil", "%goal", "x bf16", "trt-llm", "hf", "hf bs")
    print(f"{'shape':>10} " + " ".join(f"{h:>7}" for h in heads) + " done")
    for name in doc["variants"] or [None]:  # None: --skip-tandem, transformers only
        rows = {r["shape"]: r for r in doc["tandem"] if r["variant"] == name}
        print(VARIANTS[name].describe(dtype) if name else "transformers only")
        for shape in dict.fromkeys([*rows, *hf]):
            t, h = rows.get(shape, {}), hf.get(shape, {})
            goal = t.get("fraction_of_goal") or t.get("fraction_of_fp8_goal")
            cells = (
                f"{t.get('output_tok_s', 0):.0f}", f"{t.get('ceiling', {}).get('tokens_per_s', 0):.0f}",
                f"{t.get('fraction_of_ceiling', 0):.0%}", f"{goal:.0%}" if goal else "-",
                f"{t['speedup_vs_bf16']:.2f}x" if t.get("speedup_vs_bf16") else "-",
                f"{doc['reference']['tok_s'].get(shape, 0):.0f}", f"{h.get('output_tok_s', 0):.0f}", f"{h.get('batch', 0)}",
            )  # fmt: skip
            print(f"{shape:>10} " + " ".join(f"{c:>7}" for c in cells) + f" {t.get('complete', '-')}")
    print(
        "ceiling: prefill FLOPs at the measured matmul rates + decode steps at max(FLOPs, weight + KV bytes),"
    )
    print(
        "  the bytes in the variant's format (FP8 weights and KV: one byte an element), FP8 projections' FLOPs"
        " at the FP8 rate"
    )
    print(
        f"goal: bf16 60% of TensorRT-LLM FP8 on one H100 (trt-llm); FP8 weights + KV 75% of it and {SPEEDUP_GOAL}x bf16"
    )
    print("x bf16: over this run's bf16 row; -ahead variants over bf16-ahead's when it ran")
    settings = doc["settings"]
    if settings.get("profile_decode") or settings.get("profile_prefill"):
        print(
            "profiled: the torch profiler's hooks stay in the process after its steps and slow what follows "
            "(one H200, run 75: 10-17% fewer tok/s); compare these rates only with other profiled runs"
        )
    print_decode_split(doc["tandem"])
    for key in ("skipped", "errors"):
        if doc[key]:
            print(f"{key}: {doc[key]}")


def print_decode_split(rows: list[dict]) -> None:
    """Where a decode step's wall time went (GPU runs only): the GPU's share and the host work it waited for.
    Steps scheduled ahead run their host work while the GPU computes, so their rows show wall and GPU only."""
    timed = [r for r in rows if r["steps"].get("decode_gpu_s") and r["steps"]["decode_steps"]]
    if not timed:
        return
    print(
        "decode steps, ms per step: wall = GPU (first launch to sampler) + host the GPU waited for; idle = the "
        "GPU's wait before each launch; wall p50 / p90 / max of single steps"
    )
    head = ("wall", "gpu", "schedule", "post", "idle", "p50", "p90", "max")
    print(f"{'variant':>12} {'shape':>10} {'batch':>6} " + " ".join(f"{h:>8}" for h in head))
    for r in timed:
        s, n = r["steps"], r["steps"]["decode_steps"]
        per_step = ("decode_s", "decode_gpu_s", "decode_schedule_s", "decode_post_s", "decode_gpu_idle_s")
        cells = [f"{1e3 * s.get(k, 0.0) / n:.2f}" for k in per_step]
        cells += [
            f"{1e3 * s.get(k, 0.0):.2f}"
            for k in ("decode_wall_p50_s", "decode_wall_p90_s", "decode_wall_max_s")
        ]
        if VARIANTS[r["variant"]].ahead:
            cells[2:4] = ["-", "-"]  # overlapped with the GPU: not split
        print(f"{r['variant']:>12} {r['shape']:>10} {r['batch']:>6} " + " ".join(f"{c:>8}" for c in cells))
    print_prompt_split(rows)


def print_prompt_split(rows: list[dict]) -> None:
    """Steps with prompt chunks: wall per step against the GPU span of those that sampled (GPU runs only)."""
    timed = [r for r in rows if r["steps"].get("prefill_timed_steps") and r["steps"]["prefill_steps"]]
    if not timed:
        return
    print(
        "steps with prompt chunks, ms per step: wall of all; GPU and idle of those that sampled (timed); "
        "inputs = from the step before's sampler to this step's inputs on the device"
    )
    head = ("steps", "timed", "wall", "gpu", "idle", "inputs")
    print(f"{'variant':>12} {'shape':>10} " + " ".join(f"{h:>8}" for h in head))
    for r in timed:
        s = r["steps"]
        n, k = s["prefill_steps"], s["prefill_timed_steps"]
        cells = [str(n), str(k), f"{1e3 * s['prefill_s'] / n:.2f}"]
        keys = ("prefill_gpu_s", "prefill_gpu_idle_s", "prefill_input_wait_s")
        cells += [f"{1e3 * s.get(key, 0.0) / k:.2f}" for key in keys]
        print(f"{r['variant']:>12} {r['shape']:>10} " + " ".join(f"{c:>8}" for c in cells))
