"""Block-copy kernels between two GPUs of one node: how fast can SMs move scattered KV blocks over NVLink?

The cuda_ipc transport pulls a request's blocks from the sender's cache into the receiver's with one Triton
kernel (kv_transfer.block_copy), and the nccl transport gathers and scatters through staging buffers with the
same kernel. This script times that kernel's shapes in one process that sees both GPUs (peer access enabled:
the same NVLink reads and writes as a mapped IPC handle), against the copy engines moving one contiguous
buffer of the same size between the same two GPUs (the raw baseline of bench/kv_transfer.py's "ipc" column).

Variants (Llama-3-8B layout: a (layer, K|V, block) chunk is 32 KiB; scattered block ids on both sides):
- `loop`: one program per chunk, 2,048 elements per step (the kernel as committed before this script);
- `whole`: one program per chunk, the whole chunk in one load and one store (all of it in flight at once);
- `unroll4`: one program per chunk, four 2,048-element loads issued before their stores;
- `persist-N`: N programs, each looping over chunks (fewer SMs busy: room for NCCL beside it);
each `pull` (launched on the destination GPU, reading the peer) and `push` (launched on the source, writing the
peer), plus `local` (both caches on one GPU: the HBM rate the nccl transport's gather and scatter get).

Usage: python bench/block_copy.py [--tokens 2048,8192] [--reps 20] [--out FILE]; prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import re
import sys
import time

os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.harness import median_seconds  # noqa: E402
from kv_transfer import block_copy  # noqa: E402
from kv_transfer.gpu_ops import transfer_stream  # noqa: E402
from model_runtime.kv_layout import KVLayout  # noqa: E402

SPARE_BLOCKS = 64


def _variant_kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["src_ids", "dst_ids", "num_blocks", "total"])
    def kernel(
        src, dst, src_ids, dst_ids, num_blocks, total, s0, s1, s2, d0, d1, d2, chunk,
        STEP: tl.constexpr, UNROLL: tl.constexpr, PERSIST: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        step = tl.num_programs(0) if PERSIST else total
        for c in range(pid, total, step):
            plane = c // num_blocks
            i = c % num_blocks
            layer = (plane // 2).to(tl.int64)
            kv = (plane % 2).to(tl.int64)
            s = tl.load(src_ids + i).to(tl.int64)
            d = tl.load(dst_ids + i).to(tl.int64)
            src_base = src + layer * s0 + kv * s1 + s * s2
            dst_base = dst + layer * d0 + kv * d1 + d * d2
            for start in range(0, chunk, STEP * UNROLL):
                offs = start + tl.arange(0, STEP)
                x0 = tl.load(src_base + offs, mask=offs < chunk)
                if UNROLL > 1:
                    x1 = tl.load(src_base + offs + STEP, mask=offs + STEP < chunk)
                    x2 = tl.load(src_base + offs + 2 * STEP, mask=offs + 2 * STEP < chunk)
                    x3 = tl.load(src_base + offs + 3 * STEP, mask=offs + 3 * STEP < chunk)
                tl.store(dst_base + offs, x0, mask=offs < chunk)
                if UNROLL > 1:
                    tl.store(dst_base + offs + STEP, x1, mask=offs + STEP < chunk)
                    tl.store(dst_base + offs + 2 * STEP, x2, mask=offs + 2 * STEP < chunk)
                    tl.store(dst_base + offs + 3 * STEP, x3, mask=offs + 3 * STEP < chunk)

    return kernel


def variants(chunk: int, sms: int) -> dict[str, dict]:
    whole = 1 << (chunk - 1).bit_length()
    out = {
        "loop": dict(STEP=2048, UNROLL=1, PERSIST=False, num_warps=4),
        "whole-w4": dict(STEP=whole, UNROLL=1, PERSIST=False, num_warps=4),
        "whole-w8": dict(STEP=whole, UNROLL=1, PERSIST=False, num_warps=8),
        "whole-w16": dict(STEP=whole, UNROLL=1, PERSIST=False, num_warps=16),
        "unroll4": dict(STEP=2048, UNROLL=4, PERSIST=False, num_warps=4),
    }
    for mult in (1, 2, 4, 8):
        out[f"persist-{mult * sms}"] = dict(STEP=whole, UNROLL=1, PERSIST=True, num_warps=8, grid=mult * sms)
    return out


def layout_for(tokens: int) -> KVLayout:
    return KVLayout(
        num_layers=32, num_kv_heads=8, head_dim=128, block_size=16,
        num_blocks=-(-tokens // 16) + SPARE_BLOCKS, dtype="bfloat16",
    )  # fmt: skip


def timed(fn, device: torch.device, reps: int, warmup: int, stream=None) -> float:
    """Median seconds of fn's GPU work, timed by events on `stream` (default: the device's current one)."""
    with torch.cuda.device(device), torch.cuda.stream(stream or torch.cuda.current_stream(device)):
        return median_seconds(fn, str(device), warmup, reps)


def enable_peer(a: int, b: int) -> None:
    from cupy.cuda import runtime  # type: ignore[import-not-found]

    for dev, peer in ((a, b), (b, a)):
        runtime.setDevice(dev)
        try:
            runtime.deviceEnablePeerAccess(peer)
        except runtime.CUDARuntimeError as exc:  # already enabled
            if "ALREADY" not in str(exc).upper():
                raise


def run(args) -> dict:
    gpus = torch.cuda.device_count()
    if gpus < 2:
        raise SystemExit("needs two GPUs")
    d0, d1 = torch.device("cuda", 0), torch.device("cuda", 1)
    enable_peer(0, 1)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kernel = _variant_kernel()
    rows = []
    for tokens in args.tokens:
        rows.append(one_size(tokens, kernel, sms, args, d0, d1))
        torch.cuda.empty_cache()
    return dict(rows=rows)


def one_size(tokens: int, kernel, sms: int, args, d0: torch.device, d1: torch.device) -> dict:
    layout = layout_for(tokens)
    n = -(-tokens // 16)
    nbytes = n * layout.bytes_per_block
    gen = torch.Generator(device=d0).manual_seed(tokens)
    src = torch.randn(layout.cache_shape, generator=gen, device=d0).to(torch.bfloat16)
    dst = torch.zeros(layout.cache_shape, dtype=torch.bfloat16, device=d1)
    local = torch.zeros(layout.cache_shape, dtype=torch.bfloat16, device=d0)
    rng = random.Random(tokens)
    src_list = rng.sample(range(1, layout.num_blocks), n)
    dst_list = rng.sample(range(1, layout.num_blocks), n)
    ids = {dev: (torch.tensor(src_list, device=dev), torch.tensor(dst_list, device=dev)) for dev in (d0, d1)}
    flat_src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=d0)
    flat_dst = torch.empty(nbytes, dtype=torch.uint8, device=d1)
    row: dict = dict(tokens=tokens, bytes=nbytes)
    row["ce_peer_s"] = timed(lambda: flat_dst.copy_(flat_src, non_blocking=True), d1, args.reps, 3)
    print(f"{tokens:6d} tokens {nbytes / 2**20:6.0f} MiB  ce peer copy {nbytes / row['ce_peer_s'] / 1e9:7.1f} GB/s",
          flush=True)  # fmt: skip
    row["committed_pull_s"] = timed(lambda: block_copy.copy_blocks(src, dst, *ids[d1]), d1, args.reps, 3)
    expect = src.index_select(2, ids[d0][0]).to(d1)
    if not torch.equal(dst.index_select(2, ids[d1][1]), expect):
        raise SystemExit("committed kernel: wrong bytes")
    row["launch_us"] = launch_cost(src, dst, ids[d1], transfer_stream(d1))
    print(f"{tokens:6d} tokens  host time per launch: {row['launch_us']} us", flush=True)
    rows, row_len = block_copy._rows(src.shape)
    chunk = rows * row_len  # one block of one layer's K (or V), contiguous
    total = layout.num_layers * 2 * n
    for name, cfg in variants(chunk, sms).items():
        cfg = dict(cfg)
        grid = (cfg.pop("grid", total),)
        warps = cfg.pop("num_warps")
        for mode, launch_dev, a, b, ids_dev in (
            ("pull", d1, src, dst, d1),
            ("push", d0, src, dst, d0),
            ("local", d0, src, local, d0),
        ):
            b.zero_()

            def go(a=a, b=b, ids_dev=ids_dev, grid=grid, warps=warps, cfg=cfg):
                sa, sb = a.stride(), b.stride()
                kernel[grid](a, b, *ids[ids_dev], n, total, sa[0], sa[1], sa[2], sb[0], sb[1], sb[2], chunk,
                             num_warps=warps, **cfg)  # fmt: skip

            seconds = timed(go, launch_dev, args.reps, 3)
            got = b.index_select(2, ids[b.device][1])
            if not torch.equal(got, expect.to(b.device)):
                raise SystemExit(f"{name} {mode}: wrong bytes")
            row[f"{name}_{mode}_s"] = seconds
            print(f"{tokens:6d} tokens  {name:12s} {mode:5s} {nbytes / seconds / 1e9:7.1f} GB/s", flush=True)
    return row


def launch_cost(src: torch.Tensor, dst: torch.Tensor, ids, stream, calls: int = 300) -> float:
    """Host microseconds of one copy_blocks call on a transfer stream (a one-block copy, so the GPU never
    holds the queue up): what a transfer thread spends per launch."""
    one = (ids[0][:1], ids[1][:1])
    with torch.cuda.device(dst.device), torch.cuda.stream(stream):
        for _ in range(20):
            block_copy.copy_blocks(src, dst, *one)
        stream.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            block_copy.copy_blocks(src, dst, *one)
        seconds = (time.perf_counter() - start) / calls
        stream.synchronize()
    return round(seconds * 1e6, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="2048,8192")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    args.tokens = [int(t) for t in args.tokens.split(",")]
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA GPUs")
    started = time.time()
    result = run(args)
    gpu = torch.cuda.get_device_name(0)
    result["meta"] = dict(gpu=gpu, gpus=torch.cuda.device_count(), torch=torch.__version__, reps=args.reps,
                          seconds=round(time.time() - started, 1),
                          method="median of CUDA-event times after 3 warm-ups; GB/s = request bytes / time")  # fmt: skip
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    out = pathlib.Path(args.out or ROOT / "bench" / "results" / f"block_copy_{slug}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
