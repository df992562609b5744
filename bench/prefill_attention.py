"""Prefill attention kernels on the GPU, one Llama-3-8B layer (32 query heads, 8 KV heads, head_dim 128, bf16),
causal: which kernel should packed prefill call?

    python bench/prefill_attention.py [--lens 2048,4096,8192] [--packed 8x1024]

Candidates, each checked against a float32 reference on the first 256 queries before it is timed:
    fa2_varlen     torch.ops.aten._flash_attention_forward over packed sequences (the packed-prefill varlen path)
    sdpa_flash     SDPA, FlashAttention backend, enable_gqa (one dense sequence)
    sdpa_cudnn     SDPA, cuDNN backend, K/V repeated to 32 heads (one dense sequence)
    sdpa_cudnn_gqa SDPA, cuDNN backend, enable_gqa (where the backend accepts it)
Median over --reps of CUDA-event-timed calls after warm-up; TFLOP/s counts the causal half (2 matmuls of
T(T+1)/2 query-key pairs per head). Prints a table and writes bench/results/prefill_attention_<gpu>.json.

--first-calls N: what a prompt length never seen before costs. cuDNN's SDPA builds an execution plan per shape
(torch caches it by sequence length), FlashAttention-2 takes lengths as arguments. For N lengths between 1024
and 4096 that no earlier call used, the wall time of the first call (host included, synchronized) against a
second call at the same length, per kernel.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HQ, HKV, D = 32, 8, 128
SCALE = D**-0.5
CHECK_ROWS = 256


def time_ms(fn: Callable[[], object], reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def causal_flops(lens: list[int]) -> float:
    return sum(4 * HQ * D * n * (n + 1) / 2 for n in lens)


def reference_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: int) -> torch.Tensor:
    """float32 causal attention of the first `rows` queries of one sequence ([T, H, D] layout)."""
    kk = k.float().repeat_interleave(HQ // HKV, dim=1).transpose(0, 1)[:, :rows]
    vv = v.float().repeat_interleave(HQ // HKV, dim=1).transpose(0, 1)[:, :rows]
    qq = q.float().transpose(0, 1)[:, :rows]
    o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=SCALE)
    return o.transpose(0, 1)


def candidates(q, k, v, lens: list[int]) -> dict[str, Callable[[], torch.Tensor]]:
    """Each returns [T, HQ, D] for the packed input (dense candidates only when there is one sequence)."""
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    m = max(lens)

    def fa2() -> torch.Tensor:
        return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, m, m, 0.0, True, False, scale=SCALE)[
            0
        ]

    out = {"fa2_varlen": fa2}
    if len(lens) > 1:
        return out
    qd, kd, vd = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    kr, vr = (x.repeat_interleave(HQ // HKV, dim=1) for x in (kd, vd))

    def sdpa(
        backend: SDPBackend, kk: torch.Tensor, vv: torch.Tensor, gqa: bool
    ) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            with sdpa_kernel([backend]):
                o = F.scaled_dot_product_attention(qd, kk, vv, is_causal=True, scale=SCALE, enable_gqa=gqa)
            return o.squeeze(0).transpose(0, 1)

        return run

    out["sdpa_flash"] = sdpa(SDPBackend.FLASH_ATTENTION, kd, vd, True)
    out["sdpa_cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION, kr, vr, False)
    out["sdpa_cudnn_gqa"] = sdpa(SDPBackend.CUDNN_ATTENTION, kd, vd, True)
    return out


def bench_case(lens: list[int], reps: int) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(sum(lens))
    t = sum(lens)
    q = torch.randn(t, HQ, D, device="cuda", generator=gen).to(torch.bfloat16)
    k = torch.randn(t, HKV, D, device="cuda", generator=gen).to(torch.bfloat16)
    v = torch.randn(t, HKV, D, device="cuda", generator=gen).to(torch.bfloat16)
    ref = reference_rows(q, k, v, min(CHECK_ROWS, lens[0]))
    rows = []
    for name, fn in candidates(q, k, v, lens).items():
        row: dict[str, object] = {"kernel": name, "lens": lens}
        try:
            got = fn()[: ref.shape[0]].float()
            err = float((got - ref).abs().max() / ref.abs().max())
            if not err < 2e-2:
                raise RuntimeError(f"wrong result: rel err {err:.2e}")
            ms = time_ms(fn, reps)
            row.update(ms=ms, tflops=causal_flops(lens) / ms / 1e9, rel_err=err)
        except Exception as exc:  # a backend that refuses these shapes is a result, not a crash
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def first_calls(count: int) -> list[dict]:
    """--first-calls: per kernel, the first and the second call at `count` lengths new to the process."""
    lengths = [1024 + 37 * i + 1 for i in range(count)]  # odd, and none of the timed cases' lengths
    rows = []
    for kernel in ("sdpa_cudnn_gqa", "fa2_varlen"):
        first: list[float] = []
        second: list[float] = []
        for n in lengths:
            shift = (
                1 if kernel == "fa2_varlen" else 0
            )  # lengths apart per kernel, though their caches are too
            q = torch.randn(n + shift, HQ, D, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(n + shift, HKV, D, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(n + shift, HKV, D, device="cuda", dtype=torch.bfloat16)
            fn = candidates(q, k, v, [n + shift])[kernel]
            for times in (first, second):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) * 1e3)
        row = {
            "kernel": kernel, "lengths": count,
            "first_ms_median": statistics.median(first), "first_ms_max": max(first),
            "second_ms_median": statistics.median(second), "second_ms_max": max(second),
        }  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lens", default="2048,4096,8192")
    p.add_argument("--packed", default="8x1024", help="NxL: N sequences of L tokens in one varlen call")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument(
        "--first-calls", type=int, default=0, help="N new lengths: first call vs second (see above)"
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/prefill_attention.py needs a CUDA GPU")
    gpu = torch.cuda.get_device_name()
    cases = [[int(n)] for n in args.lens.split(",")]
    n, length = (int(x) for x in args.packed.split("x"))
    cases.append([length] * n)
    rows = [r for lens in cases for r in bench_case(lens, args.reps)]
    first = first_calls(args.first_calls) if args.first_calls else []  # after the cases: libraries loaded
    print(f"\n{gpu}, torch {torch.__version__}")
    for r in rows:
        shape = f"{len(r['lens'])}x{r['lens'][0]}"
        result = f"{r['ms']:8.2f} ms {r['tflops']:6.0f} TFLOP/s" if "ms" in r else r["error"]
        print(f"{shape:>8} {r['kernel']:>15} {result}")
    for r in first:
        print(
            f"{r['lengths']} new lengths {r['kernel']:>15}: first call {r['first_ms_median']:.2f} ms median "
            f"({r['first_ms_max']:.2f} max), second {r['second_ms_median']:.2f} ms ({r['second_ms_max']:.2f})"
        )
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    path = (
        Path(args.out) if args.out else Path(__file__).parent / "results" / f"prefill_attention_{slug}.json"
    )
    doc = {"gpu": gpu, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "rows": rows}
    doc["first_calls"] = first
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
