"""Small-M matmuls of the Llama-3-8B projections on the GPU: cuBLAS (F.linear) vs the Triton weight-streaming
kernel (model_runtime.fused.skinny_matmul), against the HBM floor (weight bytes / copy rate measured in the
same run). Each timed as 20 back-to-back calls inside a CUDA graph (launch overhead excluded), median of reps;
the calls rotate over enough copies of the weight (>= 256 MiB) that none is still in L2 (50 MiB on an H100)
when it is read again, as in a model where every layer has its own weights.

    python bench/skinny_matmul.py [--rows 1,8,16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import measure_copy_gbps
from model_runtime.fused.skinny_matmul import skinny_matmul

SHAPES = {
    "qkv": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
INNER = 20


def graph_time_us(fn, weights: list[torch.Tensor], reps: int = 10) -> float:
    for w in weights:
        fn(w)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(INNER):
            fn(weights[i % len(weights)])
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / INNER)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", default="1,8,16")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    bw = measure_copy_gbps("cuda", 2 << 30)
    rows_out = []
    for name, (n, k) in SHAPES.items():
        copies = max(1, -(-(256 << 20) // (n * k * 2)))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        w = weights[0]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x.float(), w.float())
            got = skinny_matmul(x, w).float()
            err = float((got - ref).abs().max() / ref.abs().max())
            floor = n * k * 2 / (bw * 1e3)
            cublas = graph_time_us(lambda w, x=x: F.linear(x, w), weights)
            triton_us = graph_time_us(lambda w, x=x: skinny_matmul(x, w), weights)
            row = {
                "shape": name,
                "n": n,
                "k": k,
                "m": m,
                "floor_us": floor,
                "cublas_us": cublas,
                "triton_us": triton_us,
                "rel_err": err,
            }
            rows_out.append(row)
            print(
                f"{name:>8} M={m:<3} floor {floor:7.1f} us  cublas {cublas:7.1f} ({floor / cublas:4.0%})  "
                f"triton {triton_us:7.1f} ({floor / triton_us:4.0%})  err {err:.1e}",
                flush=True,
            )
    doc = {"gpu": torch.cuda.get_device_name(), "hbm_copy_gbps": bw, "rows": rows_out}
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
