"""One engine decode step on the GPU, CUDA graphs vs eager, against the HBM roofline (Llama-3-8B shape, bf16).

    python bench/decode_step.py [--model dummy:llama-3-8b] [--batches 1,8,32,128,256,512] [--contexts 512,2048]
                                [--kernels triton,compile,torch] [--profile]

A step is what the engine runs per decode step minus scheduling: ModelRunner.execute (host inputs, forward,
logits) and the engine's Sampler (greedy), ending in the `.tolist()` the engine does. It is timed with CUDA
events around the whole step, so host work the GPU waits for counts; median over --reps after warm-up.

The KV state is built directly, not by prefills: the cache is filled with random values and each of `batch`
sequences gets `context` cached tokens on blocks drawn from a random permutation of the pool; the step writes
position `context` and reads context + 1 tokens per sequence. Before timing, each configuration checks that the
graph replay's logits equal the eager step's.

Floor of a step = the larger of (weight bytes read + KV bytes read) / HBM bandwidth and the step's FLOPs / matmul
rate, both rates measured in the same run (a large device-to-device copy counting read + write bytes; a bf16
8192^3 matmul). Weight bytes exclude the embedding table (a step reads only its batch's rows); FLOPs are the
layer matmuls, the logits row and attention over the context of every sequence. Configurations whose KV does
not fit next to the weights are skipped. --kernels runs the whole table once per fused-kernel implementation
(model_runtime.fused), on the same weights; --profile adds a kernel breakdown of the graph step at the
smallest and largest batch (first implementation, first context).
Prints a table and writes bench/results/decode_step_<gpu>.json (other models: decode_step_<model>_<gpu>.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.floors import ModelCost
from bench.harness import measure_matmul_tflops
from bench.step_profile import print_profile, profile_step
from model_runtime.attention.triton_backend import TritonAttention
from model_runtime.fused.select import make_fused_ops
from model_runtime.host_batch import build_host_batch
from model_runtime.kv_layout import KVLayout
from model_runtime.model_runner import ModelRunner
from model_runtime.request import Request, SamplingParams, ScheduledChunk, SchedulerOutput
from model_runtime.sampler import Sampler, SamplingTensors
from model_runtime.weights import load_model_config, load_weights, resolve_model

BLOCK_SIZE = 16
DTYPE = torch.bfloat16
HEADROOM = 6 * 2**30  # left free after the cache: graph pool, activations, logits, sampler scratch
TOL = 2e-2  # max |graph - eager| / max |eager| over the logits (bf16)


@dataclass(frozen=True)
class Row:
    kernels: str
    batch: int
    context: int
    weight_bytes: int
    kv_bytes: int
    byte_floor_us: float
    flop_floor_us: float
    roofline_us: float  # the floor: the larger of the two
    graph_us: float
    eager_us: float
    speedup: float
    graph_fraction_of_roofline: float
    eager_fraction_of_roofline: float
    host_inputs_us: float  # build_host_batch alone (CPU), part of both timings
    max_rel_err: float
    greedy_agreement: float


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
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times) / 1e9


def blocks_needed(batch: int, context: int) -> int:
    return batch * -(-(context + 1) // BLOCK_SIZE)


def plan_cache_blocks(configs: list[tuple[int, int]], bytes_per_block: int) -> int:
    """Enough blocks for the largest configuration, or as many as fit beside the weights (null block + 1)."""
    free, _ = torch.cuda.mem_get_info()
    fit = (free - HEADROOM) // bytes_per_block
    return int(min(max(blocks_needed(b, c) for b, c in configs), fit)) + 1


def decode_step(
    batch: int, context: int, num_blocks: int, vocab: int, gen: torch.Generator
) -> SchedulerOutput:
    """`batch` sequences, each with `context` cached tokens on random blocks, each decoding position `context`."""
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    per_seq = blocks_needed(1, context)
    chunks = []
    for i in range(batch):
        prompt = torch.randint(0, vocab, (context + 1,), generator=gen).tolist()
        blocks = perm[i * per_seq : (i + 1) * per_seq]
        request = Request(
            f"seq{i}", prompt, SamplingParams(temperature=0), block_ids=blocks, num_computed_tokens=context
        )
        chunks.append(ScheduledChunk(request, 1, sample=True))
    return SchedulerOutput(tuple(chunks))


class Stepper:
    """One engine decode step: runner + greedy sampler + the host copy of the sampled ids."""

    def __init__(self, runner: ModelRunner, sampler: Sampler, vocab: int) -> None:
        self.runner, self.sampler, self.vocab = runner, sampler, vocab

    def logits(self, out: SchedulerOutput, use_graphs: bool) -> torch.Tensor:
        return self.runner.execute(out, use_graphs=use_graphs)

    def step(self, out: SchedulerOutput, use_graphs: bool) -> list[int]:
        logits = self.runner.execute(out, use_graphs=use_graphs)
        requests = [c.request for c in out.chunks]
        tensors = SamplingTensors.from_params(
            [r.sampling for r in requests], [r.num_output_tokens for r in requests], self.vocab, logits.device
        )
        return self.sampler(logits, tensors).sampled_token_ids.tolist()

    def time_us(self, out: SchedulerOutput, use_graphs: bool, warmup: int, reps: int) -> float:
        for _ in range(warmup):
            self.step(out, use_graphs)
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self.step(out, use_graphs)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return statistics.median(times)


def check_graph_equals_eager(stepper: Stepper, out: SchedulerOutput) -> tuple[float, float]:
    """(max |graph - eager| / max |eager|, fraction of equal greedy tokens); raises past TOL."""
    graphs = stepper.runner.graphs
    assert graphs is not None
    before = graphs.num_replays
    eager = stepper.logits(out, use_graphs=False)
    graph = stepper.logits(out, use_graphs=True)
    if graphs.num_replays != before + 1:
        raise SystemExit(f"batch {len(out.chunks)}: the graph step did not replay a CUDA graph")
    err = float((graph - eager).abs().max() / eager.abs().max().clamp_min(1e-6))
    agree = float((graph.argmax(-1) == eager.argmax(-1)).float().mean())
    if not err < TOL:
        raise SystemExit(f"batch {len(out.chunks)}: graph logits differ from eager (rel err {err:.2e})")
    return err, agree


def host_inputs_us(out: SchedulerOutput, runner: ModelRunner, reps: int = 20) -> float:
    build_host_batch(out, BLOCK_SIZE, runner.block_tables)
    t0 = time.perf_counter()
    for _ in range(reps):
        build_host_batch(out, BLOCK_SIZE, runner.block_tables)
    return (time.perf_counter() - t0) / reps * 1e6


def bench_one(stepper: Stepper, batch: int, context: int, floor: tuple[int, float, float], args, gen) -> Row:
    runner = stepper.runner
    out = decode_step(batch, context, runner.layout.num_blocks, stepper.vocab, gen)
    err, agree = check_graph_equals_eager(stepper, out)
    graph_us = stepper.time_us(out, True, args.warmup, args.reps)
    eager_us = stepper.time_us(out, False, args.warmup, args.reps)
    weight_bytes, bw_gbps, tflops = floor
    kv_bytes = batch * (context + 1) * runner.layout.bytes_per_token
    byte_floor_us = (weight_bytes + kv_bytes) / (bw_gbps * 1e3)
    flops = ModelCost.from_config(runner.config, 2).decode_step_flops(batch, context + 1)
    flop_floor_us = flops / (tflops * 1e6)
    roofline_us = max(byte_floor_us, flop_floor_us)
    return Row(
        kernels=runner.model.ops.name,
        batch=batch,
        context=context,
        weight_bytes=weight_bytes,
        kv_bytes=kv_bytes,
        byte_floor_us=byte_floor_us,
        flop_floor_us=flop_floor_us,
        roofline_us=roofline_us,
        graph_us=graph_us,
        eager_us=eager_us,
        speedup=eager_us / graph_us,
        graph_fraction_of_roofline=roofline_us / graph_us,
        eager_fraction_of_roofline=roofline_us / eager_us,
        host_inputs_us=host_inputs_us(out, runner),
        max_rel_err=err,
        greedy_agreement=agree,
    )


def weight_bytes_read(runner: ModelRunner) -> int:
    """Every parameter a step reads in full: all but the embedding table, unless it doubles as the head."""
    model = runner.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.embed_tokens.weight
    return total - (embed.numel() * embed.element_size() if model.lm_head is not None else 0)


def fused_ops(kernels: str):
    """A model_runtime.fused name, or "triton:cublas": the Triton kernels with every projection on cuBLAS
    (the A/B for the small-M weight-streaming matmul)."""
    if kernels == "triton:cublas":
        from model_runtime.fused.triton_ops import TritonOps

        return TritonOps(small_m_matmul=False)
    return make_fused_ops(kernels, "cuda")


def load_model(model: str):
    source = resolve_model(model)
    mc = load_model_config(source)
    return mc, load_weights(source, mc, DTYPE, "cuda")


def build_runner(
    mc, weights, configs: list[tuple[int, int]], max_num_seqs: int, kernels: str
) -> tuple[ModelRunner, float]:
    """A runner over shared weights (bf16) with `kernels`, a cache sized for the configurations, graphs
    captured; (runner, start-up seconds: capture, and compilation for --kernels compile)."""
    probe = KVLayout(mc.num_layers, mc.num_kv_heads, mc.head_dim, BLOCK_SIZE, 2, "bfloat16")
    layout = dataclasses.replace(probe, num_blocks=plan_cache_blocks(configs, probe.bytes_per_block))
    max_context = max(c for _, c in configs)
    t0 = time.perf_counter()
    runner = ModelRunner(
        mc,
        weights,
        layout,
        "cuda",
        TritonAttention(),
        max_context + 1,
        max_num_seqs=max_num_seqs,
        ops=fused_ops(kernels),
    )
    torch.cuda.synchronize()
    start_s = time.perf_counter() - t0
    runner.kv_cache.normal_(generator=torch.Generator(device="cuda").manual_seed(0))
    return runner, start_s


def print_table(rows: list[Row], header: str) -> None:
    print()
    print(header)
    print(
        f"{'kernels':>8} {'batch':>5} {'ctx':>5} {'floor us':>9} {'bound':>5} {'graph us':>9} {'eager us':>9} "
        f"{'speedup':>7} {'graph %':>7} {'eager %':>7} {'host us':>8} {'rel err':>8}"
    )
    for r in rows:
        bound = "flops" if r.flop_floor_us > r.byte_floor_us else "bytes"
        print(
            f"{r.kernels:>8} {r.batch:>5} {r.context:>5} {r.roofline_us:>9.0f} {bound:>5} {r.graph_us:>9.0f} "
            f"{r.eager_us:>9.0f} "
            f"{r.speedup:>6.2f}x {100 * r.graph_fraction_of_roofline:>6.0f}% "
            f"{100 * r.eager_fraction_of_roofline:>6.0f}% {r.host_inputs_us:>8.0f} {r.max_rel_err:>8.1e}"
        )
    print(
        "floor = max((weights + KV read) / HBM copy rate, FLOPs / matmul rate); % = floor / step time; "
        "host = build_host_batch"
    )


def write_json(rows: list[Row], meta: dict, args) -> Path:
    import triton

    gpu_slug = re.sub(r"[^a-z0-9]+", "-", meta["gpu"].lower()).strip("-")
    model_slug = (
        "" if args.model == "dummy:llama-3-8b" else re.sub(r"[^a-z0-9.]+", "-", args.model.lower()) + "_"
    )
    default = Path(__file__).parent / "results" / f"decode_step_{model_slug}{gpu_slug}.json"
    path = Path(args.out) if args.out else default
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "benchmark": "one engine decode step (runner + greedy sampler), CUDA graphs vs eager, vs HBM roofline",
        **meta,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "settings": {
            "dtype": "bfloat16",
            "block_size": BLOCK_SIZE,
            "warmup": args.warmup,
            "reps": args.reps,
            "timing": "median of CUDA-event-timed whole steps (host input building and the final .tolist() included)",
        },
        "rows": [dataclasses.asdict(r) for r in rows],
    }
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def run_kernels(
    kernels: str, mc, weights, configs, args, rates: tuple[float, float], meta: dict
) -> list[Row]:
    """Every configuration with one fused-kernel implementation; fills meta[kernels] (start-up, profiles)."""
    batches = sorted({b for b, _ in configs})
    runner, start_s = build_runner(mc, weights, configs, max(batches), kernels)
    graphs = runner.graphs
    assert graphs is not None
    stepper = Stepper(runner, Sampler("cuda", seed=0), runner.config.vocab_size)
    floor = (weight_bytes_read(runner), *rates)
    gen = torch.Generator().manual_seed(0)
    rows: list[Row] = []
    info: dict[str, Any] = {"runner_start_s": start_s, "num_graphs": len(graphs.sizes), "skipped": []}
    info["graph_pool_mib"] = graphs.pool_bytes / 2**20
    meta.setdefault("per_kernels", {})[kernels] = info
    for batch, context in configs:
        if blocks_needed(batch, context) > runner.layout.usable_blocks:
            info["skipped"].append({"batch": batch, "context": context})
            print(f"[{kernels}] batch {batch} ctx {context}: skipped, its KV does not fit", flush=True)
            continue
        rows.append(bench_one(stepper, batch, context, floor, args, gen))
        r = rows[-1]
        print(
            f"[{kernels}] batch {batch} ctx {context}: graph {r.graph_us:.0f} us, eager {r.eager_us:.0f} us "
            f"({100 * r.graph_fraction_of_roofline:.0f}% / {100 * r.eager_fraction_of_roofline:.0f}% of floor)",
            flush=True,
        )
    if args.profile:
        info["profiles"] = profiles(stepper, configs[0][1], [min(batches), max(batches)], gen)
    del stepper, runner, graphs
    torch.cuda.empty_cache()
    return rows


def profiles(stepper: Stepper, context: int, batches: list[int], gen) -> dict:
    out = {}
    for batch in batches:
        if blocks_needed(batch, context) > stepper.runner.layout.usable_blocks:
            continue
        step = decode_step(batch, context, stepper.runner.layout.num_blocks, stepper.vocab, gen)
        p = profile_step(functools.partial(stepper.step, step, True))
        print_profile(f"[{stepper.runner.model.ops.name}] graph step, batch {batch}, ctx {context}", p)
        out[f"batch{batch}_ctx{context}"] = dataclasses.asdict(p)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="dummy:llama-3-8b")
    parser.add_argument("--batches", default="1,8,32,128,256,512")
    parser.add_argument("--contexts", default="512,2048")
    parser.add_argument(
        "--kernels",
        default="triton",
        help="fused-op implementations, comma-separated (triton, triton:cublas, torch, compile)",
    )
    parser.add_argument("--profile", action="store_true", help="kernel breakdown of the graph step")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument(
        "--out", default=None, help="JSON path (default bench/results/decode_step_<gpu>.json)"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/decode_step.py needs a CUDA GPU")
    gpu = torch.cuda.get_device_name()
    batches = [int(b) for b in args.batches.split(",")]
    configs = [(b, int(c)) for c in args.contexts.split(",") for b in batches]
    bw = copy_bandwidth_gbps()
    tflops = measure_matmul_tflops("cuda", DTYPE, 8192)
    print(f"{gpu}: HBM copy {bw:.0f} GB/s, bf16 matmul {tflops:.0f} TFLOP/s", flush=True)
    mc, weights = load_model(args.model)
    meta = {"gpu": gpu, "model": args.model, "hbm_copy_gbps": bw, "matmul_tflops": tflops}
    rows: list[Row] = []
    for kernels in args.kernels.split(","):
        rows += run_kernels(kernels, mc, weights, configs, args, (bw, tflops), meta)
        write_json(rows, meta, args)
    header = f"{args.model} on {gpu}: HBM copy {bw:.0f} GB/s, bf16 matmul {tflops:.0f} TFLOP/s"
    print_table(rows, header)
    print(f"wrote {write_json(rows, meta, args)}")


if __name__ == "__main__":
    main()
