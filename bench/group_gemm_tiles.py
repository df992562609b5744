"""Tile and layout experiments for the fp8_group GEMM (model_runtime.quantization.group_gemm), on the GPU.

    python3 bench/group_gemm_tiles.py [--tokens 300,2048,8192] [--reps 10]
    python3 bench/group_gemm_tiles.py --smoke      # CPU (TRITON_INTERPRET=1): checks each variant's numbers

The production kernel loads weight tiles [BLOCK_N, GROUP] and transposes them for the dot. Variants here:
- tiles: (BLOCK_M, BLOCK_N, warps, stages) other than the production choice;
- "kn": the weight stored transposed once ([K, N], N contiguous) and loaded as [GROUP, BLOCK_N] tiles, no
  transpose in the loop.
Each variant's output is checked against the production kernel's (relative error < 1e-2) and timed by CUDA
graph replay against the bf16 matmul of the same shape in the same run. Llama-3-8B's gate_up (28672 x 4096)
and down (4096 x 14336). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model_runtime.quantization.fp8 import GROUP, quantize_fp8_groups
from model_runtime.quantization.group_gemm import group_matmul, quantize_groups

SHAPES = {"gate_up": (28672, 4096), "down": (4096, 14336)}
TILES = [(64, 128, 4, 4), (128, 128, 8, 4), (128, 256, 8, 3), (64, 256, 8, 4), (128, 64, 4, 4)]


@triton.jit
def _group_mm_variant(
    a_ptr, sa_ptr, w_ptr, sw_ptr, c_ptr, M, N, K,
    stride_am, stride_sam, stride_wa, stride_wb, stride_swn, stride_cm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr, KN: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, GROUP)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for g in range(0, tl.cdiv(K, GROUP)):
        k = g * GROUP + rk
        a = tl.load(a_ptr + rm.to(tl.int64)[:, None] * stride_am + k[None, :], mask=m_ok[:, None], other=0.0)
        if KN:  # weight [K, N]: a [GROUP, BLOCK_N] tile, N contiguous
            w = tl.load(
                w_ptr + k.to(tl.int64)[:, None] * stride_wa + rn[None, :], mask=n_ok[None, :], other=0.0
            )
            part = tl.dot(a, w)
        else:  # weight [N, K], transposed in the loop (production)
            w = tl.load(
                w_ptr + rn.to(tl.int64)[:, None] * stride_wa + k[None, :], mask=n_ok[:, None], other=0.0
            )
            part = tl.dot(a, tl.trans(w))
        sa = tl.load(sa_ptr + rm * stride_sam + g, mask=m_ok, other=0.0)
        sw = tl.load(sw_ptr + rn * stride_swn + g, mask=n_ok, other=0.0)
        acc += part * (sa[:, None] * sw[None, :])
    c = c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def variant(codes, scales, weight, weight_kn, weight_scale, tile, kn: bool) -> torch.Tensor:
    block_m, block_n, warps, stages = tile
    m, k = codes.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=torch.bfloat16, device=codes.device)
    w = weight_kn if kn else weight
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _group_mm_variant[grid](
        codes, scales, w, weight_scale, out, m, n, k,
        codes.stride(0), scales.stride(0), w.stride(0), w.stride(1), weight_scale.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, GROUP=GROUP, KN=kn, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="300,2048,8192")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default="bench/results/group_gemm_tiles.json")
    args = p.parse_args()
    if args.smoke and os.environ.get("TRITON_INTERPRET") != "1":
        p.error("--smoke runs the kernels under TRITON_INTERPRET=1")
    device = "cpu" if args.smoke else "cuda"
    shapes = {"tiny": (96, 256)} if args.smoke else SHAPES
    tokens = [8] if args.smoke else [int(t) for t in args.tokens.split(",")]
    tiles = [(16, 32, 1, 1)] if args.smoke else TILES
    if not args.smoke:
        from bench.attention import time_graph
    rows, gen = [], torch.Generator(device=device).manual_seed(0)
    for name, (n, k) in shapes.items():
        w = (torch.randn(n, k, device=device, generator=gen) * 0.02).to(torch.bfloat16)
        wq, ws = quantize_fp8_groups(w)
        wq_kn = wq.t().contiguous()
        for t in tokens:
            x = torch.randn(t, k, device=device, generator=gen).to(torch.bfloat16)
            codes, scales = quantize_groups(x) if not args.smoke else _torch_groups(x)
            ref = group_matmul(codes, scales, wq, ws, None, torch.bfloat16)
            calls = {"production": partial(group_matmul, codes, scales, wq, ws, None, torch.bfloat16)}
            for tile in tiles:
                for kn in (False, True):
                    calls[f"{'kn' if kn else 'nk'} {tile}"] = partial(
                        variant, codes, scales, wq, wq_kn, ws, tile, kn
                    )
            row: dict = {"proj": name, "tokens": t, "us": {}, "err": {}}
            for label, call in calls.items():
                out = call()
                row["err"][label] = float((out.float() - ref.float()).norm() / ref.float().norm())
                if row["err"][label] > 1e-2:
                    raise SystemExit(
                        f"{name} x {t} {label}: off the production kernel by {row['err'][label]:.2e}"
                    )
                if not args.smoke:
                    row["us"][label] = time_graph(call, 5, args.reps)
            if not args.smoke:
                row["us"]["bf16"] = time_graph(partial(F.linear, x, w), 5, args.reps)
                best = min((v, key) for key, v in row["us"].items() if key != "bf16")
                print(f"{name} x {t}: bf16 {row['us']['bf16']:.1f} us, production {row['us']['production']:.1f}, "
                      f"best {best[1]} {best[0]:.1f}", flush=True)  # fmt: skip
                for label, us in sorted(row["us"].items(), key=lambda kv: kv[1]):
                    print(f"    {us:9.1f} us  {label}")
            rows.append(row)
    doc = {"benchmark": "fp8_group GEMM tiles and weight layout", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu", "rows": rows}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}")
    return 0


def _torch_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from model_runtime.quantization.fp8 import quantize_groups_torch

    return quantize_groups_torch(x)


if __name__ == "__main__":
    raise SystemExit(main())
