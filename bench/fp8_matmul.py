"""FP8 projections on the GPU, piece by piece: where an FP8Linear's time goes against the bf16 matmul it replaces
(issue 19). Llama-3-8B's four projections (qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336) at
decode batches and prefill chunk sizes.

    python3 bench/fp8_matmul.py [--tokens 1,32,128,256,512,2048,8192] [--reps 20] [--out PATH]
    python3 bench/fp8_matmul.py --smoke      # CPU: checks every variant's numbers, times nothing

Per (projection, tokens), CUDA-event-timed CUDA-graph replays of 10 back-to-back calls (median of --reps):
- bf16: F.linear with the bf16 weight (the baseline, measured in the same run); bf16_skinny: the bf16 engine's
  weight-streaming kernel at up to 16 tokens (fused/skinny_matmul.py);
- fp8: FP8Linear.forward from bf16 activations as the engine runs o_proj (the activation quantization kernel, then
  the matmul: the weight-streaming FP8 kernel at up to 16 tokens, torch._scaled_mm above);
- fp8_rows: the same from activations already quantized (what the fused norms and SiLU give qkv, gate_up and
  down); rows_scaled_mm: torch._scaled_mm from them at every size (the path before the FP8 kernel at <= 16);
- fp8_group: the same for `quantization: fp8_group` (group quantization kernel + the Triton group GEMM);
- fp8 torch-quant: the same with the activations quantized by torch ops (five kernels; the earlier path);
- quant: the activation quantization kernel alone; scaled_mm: torch._scaled_mm alone (codes made beforehand);
- scaled_mm fast-accum: the same with use_fast_accum=True (Hopper's faster, less exact FP8 accumulation);
- bw_1x128 / bw_128x128: torch._scaled_mm with block scales (activations per 128 channels; weights per row and
  128 channels, or per 128 x 128 block), where the torch build takes them (speed only, unit scales).
Floors: the weight's bytes at the HBM copy rate measured in the same run (bf16: 2 bytes an element, FP8: 1) and
the FLOPs at the matmul rate measured in the same run (bf16: 8192^3 bf16; FP8: 8192^3 e4m3 through
torch._scaled_mm with fast accumulation).
Each FP8 output is checked against the bf16 product (relative error printed). On the GPU the accumulation alone
is measured too: scaled_mm with float32 promotion and with fast accumulation (device.fp8_fast_accum, the engine's
default) against the float32 product of the same e4m3 operands and scales ("accum err"). Writes
bench/results/fp8_matmul_<gpu>.json and prints a table.
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import harness as gpu
from bench.attention import time_graph
from model_runtime.fused.skinny_matmul import MAX_ROWS, skinny_matmul
from model_runtime.quantization.fp8 import (
    FP8Linear,
    quantize_fp8,
    quantize_fp8_groups,
    quantize_rows_torch,
    scaled_mm_linear,
    scaled_mm_rows,
)

PROJECTIONS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
TOKENS = "1,4,8,16,32,128,256,512,2048,8192"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def variants(x: torch.Tensor, w: torch.Tensor, fp8: FP8Linear, grouped: FP8Linear) -> dict:
    """name -> a call with no arguments; every call is shape-static and host-sync-free (CUDA graphs)."""
    codes, scales = fp8._quantize(x)
    calls = {
        "bf16": partial(F.linear, x, w),
        "fp8": partial(fp8.forward, x),
        "fp8_group": partial(grouped.forward, x),
        "fp8_torch_quant": partial(
            scaled_mm_linear, x, fp8.weight, fp8.weight_scale, None, quantize_rows_torch
        ),
        "quant": partial(fp8._quantize, x),
    }
    if x.is_cuda:
        # The engine's paths from QuantizedRows (what the fused norms and SiLU hand the projections): at up to
        # MAX_ROWS tokens the weight-streaming kernel, and the torch._scaled_mm path it replaced there.
        calls["fp8_rows"] = partial(fp8._rows, codes, scales)
        calls["rows_scaled_mm"] = partial(scaled_mm_rows, codes, scales, fp8.weight, fp8.weight_scale, None,
                                          x.dtype, fp8.fast_accum)  # fmt: skip
        if x.shape[0] <= MAX_ROWS:
            calls["bf16_skinny"] = partial(skinny_matmul, x, w)  # the bf16 engine's path at these sizes
        mm = partial(torch._scaled_mm, codes, fp8.weight.t(), scale_a=scales,
                     scale_b=fp8.weight_scale.unsqueeze(0), out_dtype=x.dtype, use_fast_accum=False)  # fmt: skip
        calls["scaled_mm"] = mm
        calls["scaled_mm_fast_accum"] = partial(mm, use_fast_accum=True)
        calls.update(blockwise_calls(x, fp8.weight))
    return calls


def accumulation_errors(x: torch.Tensor, fp8: FP8Linear, calls: dict) -> dict:
    """scaled_mm with float32 promotion ("exact") and with fast accumulation ("fast") against the float32
    product of the same e4m3 codes and scales: what the accumulation alone adds (the exact one's is the bfloat16
    output's rounding). Relative Frobenius error, and the largest error of one output over the output's RMS."""
    codes, scales = fp8._quantize(x)
    ref = (codes.float() * scales) @ (fp8.weight.float() * fp8.weight_scale[:, None]).t()
    rms = ref.pow(2).mean().sqrt()
    errs = {}
    pairs = [("exact", calls["scaled_mm"]), ("fast", calls["scaled_mm_fast_accum"])]
    if x.shape[0] <= MAX_ROWS:
        pairs.append(("skinny", calls["fp8_rows"]))  # the weight-streaming kernel's float32 sums
    for key, call in pairs:
        diff = call().float() - ref
        errs[key] = float(diff.norm() / ref.norm())
        errs[f"{key}_max_over_rms"] = float(diff.abs().max() / rms)
    return errs


def blockwise_calls(x: torch.Tensor, weight: torch.Tensor) -> dict:
    """torch._scaled_mm with block scales, where this torch build and card take them: activations per (token,
    128 channels) against weights per (row, 128 channels) ("bw_1x128") or per 128 x 128 block ("bw_128x128").
    The scales are ones (speed only); a recipe the build refuses is left out, its error logged once."""
    m, k = x.shape
    n = weight.shape[0]
    if k % 128 or n % 128 or m % 4:
        return {}
    codes = x.to(FP8)
    a_scale = torch.ones(k // 128, m, device=x.device).t()  # [M, K/128], M-major as cuBLAS wants it
    recipes = {
        "bw_1x128": torch.ones(k // 128, n, device=x.device).t(),  # [N, K/128]
        "bw_128x128": torch.ones(n // 128, k // 128, device=x.device),
    }
    calls = {}
    for name, b_scale in recipes.items():
        call = partial(
            torch._scaled_mm, codes, weight.t(), scale_a=a_scale, scale_b=b_scale, out_dtype=x.dtype
        )
        try:
            call()
        except (RuntimeError, ValueError, NotImplementedError) as e:
            if name not in _REFUSED:
                _REFUSED[name] = str(e).splitlines()[0][:200]
                gpu.log(f"{name}: refused by this torch build: {_REFUSED[name]}")
            continue
        calls[name] = call
    return calls


FP8 = torch.float8_e4m3fn
_REFUSED: dict[str, str] = {}


def measure(name: str, n: int, k: int, tokens: int, rates: gpu.DeviceRates, args: argparse.Namespace) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(tokens * 7 + n)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x = torch.randn(tokens, k, device=device, generator=gen).to(dtype)
    w = (torch.randn(n, k, device=device, generator=gen) * 0.02).to(dtype)
    # fast_accum as the engine builds it on a GPU (device.fp8_fast_accum's default)
    fp8 = FP8Linear(k, n, bias=False, scaled_mm=device == "cuda", fast_accum=device == "cuda").to(device)
    q, scale = quantize_fp8(w)
    fp8.weight.data, fp8.weight_scale.data = q, scale
    grouped = FP8Linear(k, n, bias=False, scaled_mm=device == "cuda", grouped=True).to(device)
    grouped.weight.data, grouped.weight_scale.data = quantize_fp8_groups(w)
    calls = variants(x, w, fp8, grouped)
    ref = calls["bf16"]()
    row: dict = {"projection": name, "n": n, "k": k, "tokens": tokens,
                 "err_vs_bf16": {v: rel_err(calls[v](), ref) for v in ("fp8", "fp8_group", "fp8_torch_quant")}}  # fmt: skip
    if device == "cuda":
        row["accum_err"] = accumulation_errors(x, fp8, calls)
        row["us"] = {v: time_graph(call, 10, args.reps) for v, call in calls.items()}
        flops = 2 * tokens * n * k
        row["floor_us"] = {
            "bf16": max(2 * n * k / rates.bytes_per_s, flops / rates.flops_per_s) * 1e6,
            "fp8": max(n * k / rates.bytes_per_s, rates.compute_s(0.0, flops)) * 1e6,
        }
        row["fp8_speedup"] = row["us"]["bf16"] / row["us"]["fp8"]
    return row


def print_table(rows: list[dict], gpu_name: str, rates: gpu.DeviceRates) -> None:
    print(f"\n{gpu_name}: FP8 projections vs bf16 (us per call; HBM {rates.hbm_gbps:.0f} GB/s, "
          f"bf16 matmul {rates.matmul_tflops:.0f} TFLOP/s, FP8 {rates.fp8_matmul_tflops:.0f})")  # fmt: skip
    cols = (
        "bf16",
        "bf16_skinny",
        "fp8",
        "fp8_rows",
        "rows_scaled_mm",
        "fp8_group",
        "quant",
        "scaled_mm",
        "scaled_mm_fast_accum",
        "bw_1x128",
        "bw_128x128",
    )
    print(
        f"{'proj':>8} {'T':>5} "
        + " ".join(f"{c[:12]:>12}" for c in cols)
        + f" {'fp8 floor':>9} {'x bf16':>6}"
    )
    for r in rows:
        us = r.get("us", {})
        cells = " ".join(f"{us[c]:>12.1f}" if c in us else f"{'-':>12}" for c in cols)
        floor = r.get("floor_us", {}).get("fp8")
        tail = f" {floor:>9.1f} {r['fp8_speedup']:>5.2f}x" if floor else ""
        errs, acc = r["err_vs_bf16"], r.get("accum_err")
        accum = f"  accum err exact {acc['exact']:.5f} fast {acc['fast']:.5f}" if acc else ""
        accum += f" skinny {acc['skinny']:.5f}" if acc and "skinny" in acc else ""
        print(
            f"{r['projection']:>8} {r['tokens']:>5} {cells}{tail}  err {errs['fp8']:.3f} group {errs['fp8_group']:.3f}"
            + accum
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default=TOKENS)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, checks only")
    p.add_argument("--out")
    args = p.parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        p.error("needs a CUDA GPU (or --smoke)")
    tokens = [int(t) for t in ("1,4" if args.smoke else args.tokens).split(",")]
    projections = {"qkv": (96, 64), "down": (64, 160)} if args.smoke else PROJECTIONS
    rates = gpu.DeviceRates(0.0, 0.0)
    if device == "cuda":
        rates = gpu.DeviceRates(
            gpu.measure_copy_gbps(device, 2 << 30),
            gpu.measure_matmul_tflops(device, torch.bfloat16, 8192),
            gpu.measure_fp8_matmul_tflops(device, 8192),
        )
    rows = []
    for name, (n, k) in projections.items():
        for t in tokens:
            rows.append(measure(name, n, k, t, rates, args))
            gpu.log(f"{name} x {t} tokens done")
    gpu_name = gpu.device_name(device)
    doc = {"benchmark": "FP8 projections vs bf16", "gpu": gpu_name, "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "hbm_gbps": rates.hbm_gbps,
           "matmul_tflops": rates.matmul_tflops, "fp8_matmul_tflops": rates.fp8_matmul_tflops, "rows": rows,
           "blockwise_refused": _REFUSED}  # fmt: skip
    path = Path(args.out) if args.out else gpu.result_path(None, "fp8_matmul", device, args.smoke)
    gpu.write_json_atomic(path, doc)
    print_table(rows, gpu_name, rates)
    print(f"wrote {path}")
    bad = [r for r in rows if max(r["err_vs_bf16"]["fp8"], r["err_vs_bf16"]["fp8_group"]) > 0.08]
    if bad:
        print(f"FP8 output off the bf16 product by more than 8%: {bad}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
