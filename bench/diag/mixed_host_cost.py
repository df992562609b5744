"""Host time of one layer's eager attention in a step with a prompt chunk, op by op (one GPU).

A step whose prompt chunks replay the piecewise prefill graphs (model_runtime.prefill_graphs) still runs each
layer's attention from Python. bench/ttft.py --profile showed such a step host-bound: a 128-token chunk over a
cached 2,048-token prefix beside one decode took 19 ms of wall time for 8 ms of kernels (one H200). This times,
without synchronizing, how long the host takes to enqueue each piece of that layer's attention, so the costly
ones are named: the whole TritonAttention.forward with the decode row in the paged decode kernel, the same with
the decode row attended in the chunk's call over its gathered context (device.decode_gather_tokens), then the
parts one by one, and for scale an empty CUDA graph replay and a bare torch op. (Its first run, machine D in
bench/results/mixed_steps_nvidia-h200/calls.md, also timed the dropped split of long prefixes.)

    python3 bench/diag/mixed_host_cost.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from model_runtime.attention.packed_prefill import group_kv
from model_runtime.attention.triton_backend import TritonAttention
from model_runtime.attention.triton_store import store_kv_triton
from tests.gpu.test_attention_gpu import paged_inputs

REPS = 200


def host_us(fn: Callable[[], object]) -> float:
    """Median host time of one call in us, the GPU drained every 20 calls so the launch queue never fills."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    times = []
    for i in range(REPS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if i % 20 == 19:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return 1e6 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out")
    args = p.parse_args()
    seq_lens, query_lens = [129, 2048 + 128], [1, 128]  # one decode, then the chunk (the scheduler's order)
    q, k, v, kc, vc, whole = paged_inputs(3, seq_lens, query_lens, 8, 4, 128, 16, torch.bfloat16)
    gathered = paged_inputs(3, seq_lens, query_lens, 8, 4, 128, 16, torch.bfloat16, 8192)[5]
    backend = TritonAttention()
    plan = whole.mixed
    assert plan is not None and plan.cached is not None and gathered.mixed is not None
    assert gathered.mixed.decode_rows is None, "the decode row joined the cached group"
    group = plan.cached
    rows = {}
    rows["forward, decode kernel"] = host_us(lambda: backend.forward(q, k, v, kc, vc, whole, 0.088))
    rows["forward, decode gathered"] = host_us(lambda: backend.forward(q, k, v, kc, vc, gathered, 0.088))
    rows["store_kv_triton"] = host_us(lambda: store_kv_triton(k, v, kc, vc, whole.slot_mapping))
    seqs = plan.decode_seqs
    assert seqs is not None and plan.decode_rows is not None
    bt, sl = whole.block_tables.index_select(0, seqs), whole.seq_lens.index_select(0, seqs)
    q1 = q[:1]
    rows["decode (2 Triton launches)"] = host_us(lambda: backend.decode(q1, kc, vc, bt, sl, 0.088))
    rows["decode's 2 index_selects"] = host_us(
        lambda: (whole.block_tables.index_select(0, seqs), whole.seq_lens.index_select(0, seqs))
    )
    qc = group.rows.take(q)
    rows["group_kv (gather K and V)"] = host_us(lambda: group_kv(k, v, kc, vc, group))
    kk, vv = group_kv(k, v, kc, vc, group)
    rows["FlashAttention-2 varlen call"] = host_us(lambda: backend.prefill(qc, kk, vv, group, 0.088))
    rows["torch.empty_like"] = host_us(lambda: torch.empty_like(q))
    x = torch.zeros(16, device="cuda")
    rows["x.add_(1) (a bare op)"] = host_us(lambda: x.add_(1))
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x.add_(1)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        x.add_(1)
    rows["CUDA graph replay (one op)"] = host_us(graph.replay)
    print(f"{torch.cuda.get_device_name()}, host time per call (median of {REPS}, us):")
    for name, us in rows.items():
        print(f"  {us:8.1f}  {name}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "host_us": rows}, f, indent=1)


if __name__ == "__main__":
    main()
