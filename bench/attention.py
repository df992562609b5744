"""Decode attention on the GPU: Triton paged kernel vs the HBM roofline, Llama-3-8B shapes.

    python bench/attention.py [--batches 1,8,32] [--contexts 512,2048] [--segments N] [--tile-n N]
                              [--kv-dtypes bf16,fp8]

One layer: 32 query heads, 8 KV heads, head_dim 128, bf16, block size 16, every sequence at the full context,
block tables a random permutation of the pool. For each (batch, context) it checks the kernel against the torch
reference on a few sequences, then times it with CUDA events (CUDA-graph replays of `--inner` back-to-back
calls, so launch overhead is excluded; median over `--reps`). Roofline = KV bytes read / HBM bandwidth, the
bandwidth measured in the same run by a large device-to-device copy (read + write bytes). For context, the
same batch through torch SDPA (FlashAttention, enable_gqa) on a dense, contiguous KV copy.
`--kv-dtypes bf16,fp8` also runs every point with an FP8 cache (cache.dtype fp8_e4m3: e4m3 codes and a bfloat16
scale per token and KV head inside the blocks, model_runtime.kv_quant); its roofline counts the bytes it reads,
one per element plus two per token and head, and its row carries the speedup over the bf16 row of the same point.
`--group G` sets the query heads per KV head (32 query heads at 4; 8 is a Llama-3-70B rank at TP=4).
Prints a table and writes bench/results/attention_<gpu-name>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model_runtime.attention.base import AttentionMetadata
from model_runtime.attention.decode_plan import DecodeTuning
from model_runtime.attention.torch_ref import paged_attention_ref
from model_runtime.attention.triton_backend import TritonAttention
from model_runtime.kv_quant import fp8_pages

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
DTYPE = torch.bfloat16
# bf16, or e4m3 codes + per-token-head scales; fp8raw: an ablation
KV_DTYPES = ("bf16", "fp8", "fp8raw")
SCALE = HEAD_DIM**-0.5
CHECK_SEQS = 4
TOL = 1e-2


@dataclass(frozen=True)
class Row:
    batch: int
    context: int
    num_segments: int
    kv_bytes: int
    triton_us: float
    roofline_us: float
    fraction_of_roofline: float
    achieved_gbps: float
    sdpa_dense_us: float | None
    max_rel_err: float
    kv_dtype: str = "bf16"
    speedup_vs_bf16: float | None = None


def time_graph(fn, inner: int, reps: int) -> float:
    """Median microseconds of one call of fn, from CUDA-graph replays of `inner` calls timed by CUDA events."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    for _ in range(2):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / inner)
    del graph
    return statistics.median(times)


def copy_bandwidth_gbps(nbytes: int = 2 << 30, reps: int = 20) -> float:
    """HBM bandwidth as read + write bytes of a device-to-device copy, median over reps."""
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * nbytes / statistics.median(times) / 1e9


def build(batch: int, context: int, gen: torch.Generator, group: int, fp8: bool = False):
    """A paged pool holding exactly `batch` sequences of `context` tokens, in scattered blocks, and `group`
    query heads per KV head; with `fp8` the pool holds e4m3 codes of the same values and the scales come back
    too (else None)."""
    per_seq = -(-context // BLOCK)
    num_blocks = batch * per_seq + 1
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    scales = None
    if fp8:
        k_cache, v_cache, scales = fp8_pages(k_cache, v_cache)
    perm = torch.randperm(num_blocks - 1, generator=gen).to("cuda") + 1
    tables = perm.view(batch, per_seq).to(torch.int32).contiguous()
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, KV_HEADS * group, HEAD_DIM, device="cuda", dtype=DTYPE)
    return q, k_cache, v_cache, tables, seq_lens, scales


def _pages(cache: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """A zero null block followed by `cache`'s pages `ids` ([N, B, ...]), in cache's dtype (FP8 pages copied as
    bytes)."""
    raw = cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache
    pages = torch.cat([torch.zeros_like(raw[:1]), raw[ids]])
    return pages.view(cache.dtype)


def check(out: torch.Tensor, q, k_cache, v_cache, tables, context: int, scales=None) -> float:
    """Relative error of the first CHECK_SEQS sequences against the fp32 torch reference (which reads an FP8
    pool through its scales)."""
    n = min(CHECK_SEQS, q.shape[0])
    used = tables[:n].long()  # copy just their pages into a small pool: block i+1 <- used[i]
    sub_k, sub_v = (_pages(cache, used.flatten()) for cache in (k_cache, v_cache))
    sub_scales = None
    if scales is None:
        sub_k, sub_v = sub_k.float(), sub_v.float()
    else:
        sub_scales = torch.stack([_pages(scales[i], used.flatten()) for i in (0, 1)])
    sub_tables = torch.arange(1, used.numel() + 1, device=q.device, dtype=torch.int32).view_as(used)
    meta = AttentionMetadata(
        slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=q.device),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=q.device),
        seq_lens=torch.full((n,), context, dtype=torch.int32, device=q.device),
        block_tables=sub_tables,
        query_lens_host=[1] * n,
        seq_lens_host=[context] * n,
        max_query_len=1,
        max_seq_len=context,
    )
    ref = paged_attention_ref(q[:n].float(), sub_k, sub_v, meta, SCALE, sub_scales)
    err = float((out[:n].float() - ref).abs().max() / ref.abs().max())
    if not err < TOL:
        raise SystemExit(f"kernel disagrees with the reference at context {context}: rel err {err:.3e}")
    return err


def dense_sdpa_us(q, k_cache, v_cache, tables, context: int, args) -> float | None:
    """The same attention through SDPA on a contiguous [B, Hkv, S, D] copy (no paging)."""
    try:
        k = k_cache[tables.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
        v = v_cache[tables.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    except torch.OutOfMemoryError:
        return None
    qd = q.unsqueeze(2)  # [B, Hq, 1, D]
    us = time_graph(
        lambda: F.scaled_dot_product_attention(qd, k, v, scale=SCALE, enable_gqa=True), args.inner, args.reps
    )
    return us


def bench_one(
    batch: int, context: int, bw_gbps: float, args, gen: torch.Generator, kv_dtype: str = "bf16"
) -> Row:
    if kv_dtype == "fp8raw":
        return bench_raw_codes(batch, context, bw_gbps, args, gen)
    fp8 = kv_dtype == "fp8"
    q, k_cache, v_cache, tables, seq_lens, scales = build(batch, context, gen, args.group, fp8=fp8)
    tuning = DecodeTuning(
        tile_n=args.tile_n,
        num_warps=args.num_warps,
        num_stages=args.num_stages,
        fp8_tile_n=args.fp8_tile_n,
        fp8_num_stages=args.fp8_num_stages,
        fp8_max_registers=args.fp8_max_registers or None,
    )
    backend = TritonAttention(num_segments=args.segments, tuning=tuning)
    segments = backend.segments_for(batch, KV_HEADS, q.device)
    out = backend.decode(q, k_cache, v_cache, tables, seq_lens, SCALE, scales)
    err = check(out, q, k_cache, v_cache, tables, context, scales)
    us = time_graph(
        lambda: backend.decode(q, k_cache, v_cache, tables, seq_lens, SCALE, scales), args.inner, args.reps
    )
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * k_cache.element_size()
    if scales is not None:  # and each token's scales, one per KV head
        kv_bytes += 2 * batch * context * KV_HEADS * scales.element_size()
    dense = None
    if not args.no_sdpa and scales is None:  # SDPA reads 16-bit K/V only
        dense = dense_sdpa_us(q, k_cache, v_cache, tables, context, args)
    return timed_row(batch, context, segments, kv_bytes, us, bw_gbps, dense, err, kv_dtype)


def timed_row(
    batch: int, context: int, segments: int, kv_bytes: int, us: float, bw_gbps: float,
    dense: float | None, err: float, kv_dtype: str,
) -> Row:  # fmt: skip
    """A Row from a timing: the roofline is the KV bytes at the measured copy bandwidth."""
    roof_us = kv_bytes / (bw_gbps * 1e9) * 1e6
    return Row(
        batch, context, segments, kv_bytes, us, roof_us, roof_us / us, kv_bytes / us / 1e3, dense, err, kv_dtype
    )  # fmt: skip


def bench_raw_codes(batch: int, context: int, bw_gbps: float, args, gen: torch.Generator) -> Row:
    """An ablation, not attention: the FP8 pool's codes read as float16 pairs (head dim 64, float16 queries) by
    the 16-bit kernel at the FP8 tile. It reads the same bytes, from the same pages and strides, as the FP8
    kernel, without converting codes or applying scales: how fast this access pattern alone can go. Its output
    is meaningless and not checked."""
    _, k_cache, v_cache, tables, seq_lens, _ = build(batch, context, gen, args.group, fp8=True)
    k16, v16 = k_cache.view(torch.float16), v_cache.view(torch.float16)  # [N, B, H, D/2]
    q = torch.randn(batch, KV_HEADS * args.group, HEAD_DIM // 2, device="cuda", dtype=torch.float16)
    tuning = DecodeTuning(tile_n=args.fp8_tile_n, num_warps=args.num_warps, num_stages=args.fp8_num_stages)
    backend = TritonAttention(num_segments=args.segments, tuning=tuning)
    segments = backend.segments_for(batch, KV_HEADS, q.device)
    us = time_graph(lambda: backend.decode(q, k16, v16, tables, seq_lens, SCALE), args.inner, args.reps)
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM  # one byte a code; no scales read
    return timed_row(batch, context, segments, kv_bytes, us, bw_gbps, None, 0.0, "fp8raw")


def print_table(rows: list[Row], bw_gbps: float, gpu: str, group: int) -> None:
    print(
        f"\n{gpu}: decode attention, Llama-3-8B layer ({KV_HEADS * group}/{KV_HEADS} heads, D 128, bf16 queries, "
        f"block {BLOCK}); "
        f"HBM copy {bw_gbps:.0f} GB/s"
    )
    print(
        f"{'kv':>8} {'batch':>6} {'ctx':>6} {'segs':>5} {'KV MB':>9} {'triton us':>10} {'roof us':>9} "
        f"{'% roof':>7} {'GB/s':>7} {'x bf16':>7} {'sdpa dense us':>14}"
    )
    for r in rows:
        dense = f"{r.sdpa_dense_us:14.1f}" if r.sdpa_dense_us is not None else f"{'-':>14}"
        speedup = f"{r.speedup_vs_bf16:6.2f}x" if r.speedup_vs_bf16 is not None else f"{'-':>7}"
        print(
            f"{r.kv_dtype:>8} {r.batch:>6} {r.context:>6} {r.num_segments:>5} {r.kv_bytes / 1e6:>9.1f} "
            f"{r.triton_us:>10.1f} {r.roofline_us:>9.1f} {100 * r.fraction_of_roofline:>6.1f}% "
            f"{r.achieved_gbps:>7.0f} {speedup} {dense}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", default="1,8,32,64,128,256")
    parser.add_argument("--contexts", default="512,2048,8192")
    parser.add_argument("--segments", type=int, default=None, help="fixed split-KV count (default: auto)")
    parser.add_argument("--tile-n", type=int, default=DecodeTuning.tile_n)
    parser.add_argument("--fp8-tile-n", type=int, default=DecodeTuning.fp8_tile_n, help="with an FP8 cache")
    parser.add_argument("--num-warps", type=int, default=DecodeTuning.num_warps)
    parser.add_argument("--num-stages", type=int, default=DecodeTuning.num_stages)
    parser.add_argument("--fp8-num-stages", type=int, default=DecodeTuning.fp8_num_stages, help="FP8 cache")
    parser.add_argument(
        "--fp8-max-registers",
        type=int,
        default=DecodeTuning.fp8_max_registers,
        help="the FP8 kernel's maxnreg (0: the compiler's choice)",
    )
    parser.add_argument("--inner", type=int, default=10, help="calls per timed graph replay")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--no-sdpa", action="store_true", help="skip the dense SDPA comparison")
    parser.add_argument("--group", type=int, default=Q_HEADS // KV_HEADS, help="query heads per KV head")
    parser.add_argument(
        "--kv-dtypes",
        default="bf16",
        help="bf16, fp8, or both (bf16,fp8); fp8raw: an ablation reading the FP8 codes as float16 pairs",
    )
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/attention_<gpu>.json)")
    args = parser.parse_args()
    kv_dtypes = args.kv_dtypes.split(",")
    if not kv_dtypes or any(d not in KV_DTYPES for d in kv_dtypes):
        raise SystemExit(f"--kv-dtypes: a comma list of {', '.join(KV_DTYPES)}, got {args.kv_dtypes!r}")
    if not torch.cuda.is_available():
        raise SystemExit("bench/attention.py needs a CUDA GPU")
    gpu = torch.cuda.get_device_name()
    gen = torch.Generator().manual_seed(0)
    bw = copy_bandwidth_gbps()
    rows = []
    for batch in map(int, args.batches.split(",")):
        for context in map(int, args.contexts.split(",")):
            point: dict[str, Row] = {}
            for kv_dtype in kv_dtypes:
                r = bench_one(batch, context, bw, args, gen, kv_dtype)
                base = point.get("bf16")
                if base is not None and kv_dtype != "bf16":
                    r = dataclasses.replace(r, speedup_vs_bf16=base.triton_us / r.triton_us)
                point[kv_dtype] = r
                rows.append(r)
                torch.cuda.empty_cache()  # the last config's pool is garbage now
                print(
                    f"{kv_dtype} batch {batch} ctx {context}: {r.triton_us:.1f} us "
                    f"({100 * r.fraction_of_roofline:.0f}% of roofline), err {r.max_rel_err:.1e}",
                    flush=True,
                )
    print_table(rows, bw, gpu, args.group)
    write_json(rows, bw, gpu, args)


def write_json(rows: list[Row], bw_gbps: float, gpu: str, args) -> None:
    import triton

    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    path = Path(args.out) if args.out else Path(__file__).parent / "results" / f"attention_{slug}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "benchmark": "decode attention (Triton paged split-KV) vs HBM roofline",
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "shape": {
            "q_heads": KV_HEADS * args.group,
            "kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "block_size": BLOCK,
            "dtype": "bfloat16",
            "kv_dtypes": args.kv_dtypes,
        },
        "settings": {
            "segments": args.segments or "auto",
            "tile_n": args.tile_n,
            "fp8_tile_n": args.fp8_tile_n,
            "fp8_num_stages": args.fp8_num_stages,
            "fp8_max_registers": args.fp8_max_registers,
            "num_warps": args.num_warps,
            "num_stages": args.num_stages,
            "inner": args.inner,
            "reps": args.reps,
            "timing": "median of CUDA-event-timed CUDA-graph replays",
        },
        "hbm_copy_gbps": bw_gbps,
        "rows": [dataclasses.asdict(r) for r in rows],
    }
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
