"""Offline throughput on one GPU: Tandem's colocated engine vs transformers' `generate`, against the arithmetic
ceiling (issue "GPU fast path", benchmark 2). Llama-3-8B shape, bf16, random token ids, ignore_eos.

GPU, one command (with the gguf wheel of ../shared/gpu/make-kit.sh on PYTHONPATH, as every command there):

    python3 bench/offline_throughput.py   # [--shapes 128/128,1000/1000,2048/128 --num-prompts 1000,500,500
                                          #  --max-num-seqs 512 --skip-hf --skip-tandem --admit-all --budget-s 540
                                          #  --out PATH: give partial reruns their own file]
    python3 bench/offline_throughput.py --smoke   # the CPU check: tiny model and shapes, seconds
    python3 bench/offline_throughput.py --variants bf16,fp8 --skip-hf   # issue 19's FP8 goals, one command

--variants (a comma list of bench/offline_variants.VARIANTS; default bf16): the engines Tandem runs, each its
own engine (the previous one freed first) on every shape, bf16 first; rows carry "variant". fp8-weights sets
device.quantization fp8, fp8-kv cache.dtype fp8_e4m3, fp8 both; -ahead adds the steps scheduled ahead and
-exact float32 accumulation in the FP8 matmuls (device.fp8_fast_accum false; the others accumulate fast).
Each variant's ceiling counts the bytes it reads (FP8 projections and FP8 K/V at one byte an element; the table
in bench/offline_variants.py) and its FLOPs at the rates they run at: FP8 projections' at the FP8 matmul rate
measured in the same run (8192^3 e4m3), the rest at the bf16 rate. Non-bf16 rows add speedup_vs_bf16 (over this run's complete bf16 row of the shape; -ahead variants
over bf16-ahead's when the run has it, the same scheduling on both sides; "versus" names which); rows with
FP8 weights and KV add the issue's goals: fp8_goal_tok_s (75% of TensorRT-LLM FP8), fraction_of_fp8_goal and
speedup_goal (1.6x bf16). The JSON's "variants" holds each one's model_cost and engine; each variant's engine
and each of its shapes is a job, so a spent --budget-s starts none of the rest.

Order: device rates (2 GiB HBM copy, 8192^3 bf16 and e4m3 matmuls), Tandem on every shape (one engine a variant:
dummy:llama-3-8b, CUDA graphs, cache from the memory planner), then transformers on every shape. Per shape:
- Tandem: N prompts, at most B in the engine at once, B = min(N, --max-num-seqs, sequences whose full length
  fits in the KV cache), topped up as requests finish so the scheduler never preempts (--admit-all adds all N
  at once and lets it preempt). Output tok/s = N * output_len / wall time, split into steps that ran any
  prefill and pure decode steps. Every request must get exactly output_len tokens or the run fails.
- Ceiling: floors.throughput_floor for the same N and B at the measured rates; fraction = tok/s / ceiling.
  The published TensorRT-LLM FP8 H100 numbers, the 60 % bf16 goal and the FP8 goals are stored alongside.
- transformers: LlamaForCausalLM of the same shape, random init made directly in bf16 on the GPU; static
  batches 256,128,64,32,16,8, the largest that runs (OOM caught) is timed for up to 3 batches or 30 s.
Progress on stderr, the table on stdout. bench/results/offline_throughput_<gpu>.json is rewritten after every
job (a timeout keeps what finished; a job cut by the budget has "complete": false); exit status 1 when any job
raised (traceback on stderr, message in the JSON's "errors").
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import floors
from bench import harness as gpu
from bench.offline_drive import PROGRESS_EVERY_S, Shape, concurrency, drive, warm_up
from bench.offline_report import print_table
from bench.offline_variants import (
    BF16,
    FP8_GOAL_TOK_S,
    SPEEDUP_GOAL,
    VARIANTS,
    Variant,
    parse_variants,
    versus_bf16,
)
from bench.step_probe import StepSplit
from model_runtime.config import ModelConfig, SchedulerConfig
from model_runtime.engine import Engine

# TensorRT-LLM, FP8, one H100 (published), and the goal: >= 60 % of it in bf16 on an H100.
REFERENCE_TOK_S = {"128/128": 28312.0, "1000/1000": 15220.0, "2048/128": 3450.0}
GOAL_TOK_S = {"128/128": 17000.0, "1000/1000": 9100.0, "2048/128": 2100.0}
PUBLISHED_HF_H100 = {"128/128": (3557.0, 256), "1000/1000": (921.0, 64), "2048/128": (379.0, 32)}
# --shapes, --num-prompts and --hf-batches when not given
GPU_DEFAULTS = ("128/128,1000/1000,2048/128", "1000,500,500", "256,128,64,32,16,8")
SMOKE_DEFAULTS = ("16/8,24/4", "6,4", "8,4,2")
HF_MAX_BATCHES, HF_TIMED_S = 3, 30.0  # transformers: stop timing new batches after 3 or after 30 s
BENCHMARK = "offline throughput: Tandem colocated engine vs transformers generate vs arithmetic ceiling"
REFERENCE = {
    "source": "TensorRT-LLM, FP8, one H100 (published)",
    "tok_s": REFERENCE_TOK_S,
    "goal": "bf16 on an H100 >= 60% of the reference",
    "goal_tok_s": GOAL_TOK_S,
    "fp8_goal": f"FP8 weights + FP8 KV on an H100 >= 75% of the reference and >= {SPEEDUP_GOAL}x bf16 (same run)",
    "fp8_goal_tok_s": FP8_GOAL_TOK_S,
    "speedup_goal": SPEEDUP_GOAL,
    "transformers_h100_published": {k: {"tok_s": v, "batch": b} for k, (v, b) in PUBLISHED_HF_H100.items()},
}


def parse_shapes(shapes: str, counts: str) -> list[tuple[Shape, int]]:
    """--shapes IN/OUT,... and --num-prompts (one count, or one per shape) -> [(shape, num_prompts)]."""
    pairs = [part.strip().split("/") for part in shapes.split(",")]
    if not all(len(p) == 2 and p[0].isdigit() and p[1].isdigit() and min(map(int, p)) > 0 for p in pairs):
        raise SystemExit(f"--shapes: {shapes!r} is not a list of INPUT/OUTPUT with positive integers")
    numbers = [int(c) for c in counts.split(",")]
    numbers *= len(pairs) if len(numbers) == 1 else 1
    if len(numbers) != len(pairs) or min(numbers) < 1:
        raise SystemExit(f"--num-prompts: one positive count or one per shape ({len(pairs)}), got {counts!r}")
    return [(Shape(int(a), int(b)), n) for (a, b), n in zip(pairs, numbers)]


@dataclass(frozen=True)
class Setup:  # what every job reads
    args: argparse.Namespace
    where: gpu.RunDevice
    rates: gpu.DeviceRates
    model_config: ModelConfig
    cost: floors.ModelCost  # the variant's (transformers: the model dtype's)
    run: gpu.BenchRun
    variant: Variant = BF16  # the engine Tandem's jobs run


# --- Tandem ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TandemRow:
    variant: str
    shape: str
    num_prompts: int
    batch: int  # B: sequences in the engine at once
    complete: bool
    output_tokens: int
    wall_s: float
    output_tok_s: float
    steps: StepSplit
    ceiling: floors.ThroughputFloor
    fraction_of_ceiling: float
    reference_tok_s: float | None
    goal_tok_s: float | None  # the bf16 goal: bf16 rows only
    fraction_of_goal: float | None
    decode_profile: dict | None = None  # --profile-decode: kernels of a few decode steps at the full batch
    prefill_profile: dict | None = None  # --profile-prefill: kernels of a few steps with prompt chunks


def run_tandem_shape(engine: Engine, shape: Shape, num_prompts: int, setup: Setup) -> TandemRow:
    batch, name = concurrency(engine, shape, num_prompts), f"{setup.variant.job_prefix} {shape.key}"
    gpu.log(f"{name}: {num_prompts} prompts, {batch} at once; warming up")
    warm_up(engine, shape)
    vocab, limit = engine.model_config.vocab_size, num_prompts if setup.args.admit_all else batch
    prompts = gpu.random_prompts(num_prompts, shape.input_len, vocab, seed=shape.input_len)
    gpu.synchronize(setup.where.device)
    t0 = time.perf_counter()
    driven = drive(
        engine, shape, prompts, limit, setup.run.deadline, setup.args.profile_decode, name,
        setup.args.profile_prefill,
    )  # fmt: skip
    counts, complete = driven.counts, driven.complete
    wall = time.perf_counter() - t0
    wrong = [(i, c) for i, c in enumerate(counts) if c != shape.output_len]
    if complete and wrong:
        raise gpu.BenchError(
            f"{shape.key}: {len(wrong)} requests without {shape.output_len} tokens: {wrong[:3]}"
        )
    rate = sum(counts) / wall
    ceiling = floors.throughput_floor(
        setup.cost, setup.rates, num_prompts, shape.input_len, shape.output_len, batch
    )
    goal = GOAL_TOK_S.get(shape.key) if setup.variant.baseline else None
    gpu.log(f"{name}: {rate:.0f} tok/s, {rate / ceiling.tokens_per_s:.0%} of the ceiling")
    return TandemRow(
        setup.variant.name, shape.key, num_prompts, batch, complete, sum(counts), wall, rate, driven.split, ceiling,
        rate / ceiling.tokens_per_s, REFERENCE_TOK_S.get(shape.key), goal, rate / goal if goal else None,
        driven.decode_profile, driven.prefill_profile,
    )  # fmt: skip


def tandem_shapes(engine: Engine, setup: Setup, work: list[tuple[Shape, int]]) -> None:
    run, variant, layout = setup.run, setup.variant, engine.layout
    run.doc["variants"][variant.name]["engine"] = {
        "num_blocks": layout.num_blocks, "kv_gib": layout.total_bytes / 2**30, "kv_dtype": layout.dtype
    }  # fmt: skip
    for shape, n in work:
        row = run.job(f"{variant.job_prefix} {shape.key}", partial(run_tandem_shape, engine, shape, n, setup))
        if row is not None:
            versus = versus_bf16(variant, row.shape, row.output_tok_s, run.doc["tandem"])
            run.doc["tandem"].append(dataclasses.asdict(row) | dataclasses.asdict(versus))
            run.save()


def run_tandem(setup: Setup, model: str, work: list[tuple[Shape, int]]) -> None:
    """One variant: its engine on every shape, then the engine freed (the next variant or transformers loads)."""
    a, v, longest = setup.args, setup.variant, max(s.input_len + s.output_len for s, _ in work)
    limits = SchedulerConfig(
        a.max_num_seqs, a.max_num_batched_tokens, max_model_len=longest + 16, async_scheduling=v.ahead
    )
    setup.run.doc["variants"][v.name] = {
        "quantization": v.quantization, "cache_dtype": v.cache_dtype, "fp8_fast_accum": v.fast_accum,
        "model_cost": dataclasses.asdict(setup.cost),
    }  # fmt: skip
    build = partial(
        gpu.build_engine, model, setup.where, limits, a.gpu_memory_utilization,
        quantization=v.quantization, cache_dtype=v.cache_dtype,
        prefill_graph_tokens=a.prefill_graph_tokens, fp8_fast_accum=v.fast_accum,
    )  # fmt: skip
    engine = setup.run.job(f"{v.job_prefix} engine", build)
    if engine is not None:
        tandem_shapes(engine, setup, work)
        engine = None  # the last reference: weights, KV cache and graph pools go before the next engine loads
    gc.collect()
    if setup.where.device.startswith("cuda"):
        torch.cuda.empty_cache()
        gpu.log(f"engine freed: {torch.cuda.memory_allocated() / 2**30:.2f} GiB still allocated")


# --- transformers --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HFRow:
    shape: str
    batch: int  # the largest static batch that ran
    complete: bool
    batches_timed: int
    output_tokens: int
    wall_s: float
    output_tok_s: float
    attempts: tuple[str, ...]  # e.g. "256: predicted OOM", "128: OOM", "64: ran"
    published_h100_tok_s: float | None
    published_h100_batch: int | None


def build_hf_model(mc: ModelConfig, where: gpu.RunDevice):
    """A Llama of the engine model's shape (rope scaling left out: it does not change the work), random init
    made on the target device in the target dtype (no host copy of the weights), warmed up."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    gpu.log(f"building transformers LlamaForCausalLM on {where.device} ({where.dtype})")
    config = LlamaConfig(
        vocab_size=mc.vocab_size, hidden_size=mc.hidden_size, intermediate_size=mc.intermediate_size,
        num_hidden_layers=mc.num_layers, num_attention_heads=mc.num_heads, num_key_value_heads=mc.num_kv_heads,
        head_dim=mc.head_dim, max_position_embeddings=mc.max_position_embeddings, rms_norm_eps=mc.rms_norm_eps,
        tie_word_embeddings=mc.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": mc.rope_theta},
    )  # fmt: skip
    with torch.device(where.device):
        model = AutoModelForCausalLM.from_config(config, dtype=where.torch_dtype).eval()
    generate_once(model, 2, Shape(8, 2), None)
    return model


def generate_once(model, batch: int, shape: Shape, deadline: gpu.Deadline | None) -> tuple[int, float, bool]:
    """One static batch through generate(): (new tokens, seconds, every row got output_len tokens)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class OutOfTime(StoppingCriteria):  # the budget's hard stop, and a progress line every 10 s
        next_log = time.monotonic() + PROGRESS_EVERY_S

        def __call__(self, input_ids, scores, **kwargs):
            if time.monotonic() >= self.next_log:
                self.next_log += PROGRESS_EVERY_S
                gpu.log(
                    f"transformers {shape.key} batch {batch}: {input_ids.shape[1] - shape.input_len} tokens"
                )
            stop = deadline is not None and deadline.must_stop()
            return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)

    device = next(model.parameters()).device
    ids = torch.randint(3, model.config.vocab_size, (batch, shape.input_len), device=device)
    gpu.synchronize(str(device))
    t0 = time.perf_counter()
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=shape.output_len,
        min_new_tokens=shape.output_len, do_sample=False, pad_token_id=0,
        stopping_criteria=StoppingCriteriaList([OutOfTime()]),
    )  # fmt: skip
    gpu.synchronize(str(device))
    seconds, new = time.perf_counter() - t0, out.shape[1] - shape.input_len
    if new != shape.output_len and not (deadline is not None and deadline.must_stop()):
        raise gpu.BenchError(f"transformers {shape.key}: {new} new tokens, not {shape.output_len}")
    return batch * new, seconds, new == shape.output_len


def hf_predicted_to_fit(setup: Setup, batch: int, shape: Shape) -> bool:
    """False when the final KV plus one layer's prefill activations exceed free memory (saves an OOM try)."""
    if not setup.where.device.startswith("cuda"):
        return True
    mc = setup.model_config
    kv = batch * (shape.input_len + shape.output_len) * setup.cost.kv_bytes_per_token
    per_token = (4 * mc.hidden_size + 2 * mc.q_size + 3 * mc.intermediate_size) * setup.where.dtype_bytes
    free = torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    return kv + batch * shape.input_len * per_token < free


def run_hf_shape(model, shape: Shape, setup: Setup) -> HFRow:
    """Largest static batch that runs, timed over up to HF_MAX_BATCHES batches (1 on CPU) or HF_TIMED_S."""
    attempts, max_batches = [], 1 if setup.where.device == "cpu" else HF_MAX_BATCHES
    for batch in [int(b) for b in setup.args.hf_batches.split(",")]:
        if not hf_predicted_to_fit(setup, batch, shape):
            attempts.append(f"{batch}: predicted OOM")
            continue
        gpu.log(f"transformers {shape.key}: batch {batch}")
        tokens, wall, timed, complete = 0, 0.0, 0, True
        try:
            while complete and timed < max_batches and (timed == 0 or wall < HF_TIMED_S):
                new, seconds, complete = generate_once(model, batch, shape, setup.run.deadline)
                tokens, wall, timed = tokens + new, wall + seconds, timed + 1
        except torch.OutOfMemoryError:
            attempts.append(f"{batch}: OOM")
        else:
            attempts.append(f"{batch}: ran")
            published = PUBLISHED_HF_H100.get(shape.key, (None, None))
            return HFRow(
                shape.key, batch, complete, timed, tokens, wall, tokens / wall, tuple(attempts), *published
            )
        gc.collect()  # outside the except clause: the exception's frames no longer pin the batch's tensors
        torch.cuda.empty_cache()
    raise gpu.BenchError(f"transformers {shape.key}: no batch ran ({', '.join(attempts)})")


def run_transformers(setup: Setup, work: list[tuple[Shape, int]]) -> None:
    model = setup.run.job("transformers model", lambda: build_hf_model(setup.model_config, setup.where))
    for shape, _ in work if model is not None else []:
        row = setup.run.job(f"transformers {shape.key}", partial(run_hf_shape, model, shape, setup))
        if row is not None:
            setup.run.doc["transformers"].append(dataclasses.asdict(row))
            setup.run.save()
            gpu.log(f"transformers {row.shape}: {row.output_tok_s:.0f} tok/s at batch {row.batch}")


# --- main ----------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="default dummy:llama-3-8b (smoke: a tiny HF model)")
    p.add_argument("--shapes", help="INPUT/OUTPUT,... (default 128/128,1000/1000,2048/128)")
    p.add_argument("--num-prompts", help="one count or one per shape (default 1000,500,500)")
    p.add_argument("--max-num-seqs", type=int, default=512, help="engine sequence limit (512: largest graph)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument(
        "--prefill-graph-tokens",
        type=int,
        help="steps with prompt chunks of up to this many tokens replay the piecewise prefill graphs "
        "(device.prefill_graph_tokens; default the engine's 1024, 0: eager; capped at the step budget)",
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.90)
    p.add_argument("--admit-all", action="store_true", help="add all prompts at once (scheduler may preempt)")
    p.add_argument("--hf-batches", help="descending static batches to try (default 256,128,64,32,16,8)")
    p.add_argument(
        "--variants",
        default="bf16",
        help=f"Tandem engines, a comma list of {','.join(VARIANTS)} (default bf16)",
    )
    p.add_argument("--skip-hf", action="store_true", help="run only Tandem")
    p.add_argument("--skip-tandem", action="store_true", help="run only transformers (mind --out)")
    p.add_argument("--budget-s", type=float, default=540.0, help="start no new job after this many seconds")
    p.add_argument(
        "--profile-decode", action="store_true", help="kernel breakdown of 5 decode steps per shape (GPU)"
    )
    p.add_argument(
        "--profile-prefill",
        action="store_true",
        help="kernel breakdown of 3 steps with prompt chunks per shape, mid-run (GPU)",
    )
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, tiny shapes, float32, no graphs")
    p.add_argument("--out", help="JSON path (default bench/results/offline_throughput_<gpu>.json)")
    args = p.parse_args(argv)
    for flag in ("profile_decode", "profile_prefill"):
        if args.smoke and getattr(args, flag):
            p.error(f"--{flag.replace('_', '-')}: the profiler's CUDA timing needs a GPU (drop --smoke)")
    if args.prefill_graph_tokens is not None and args.prefill_graph_tokens < 0:
        p.error(f"--prefill-graph-tokens: must be >= 0, got {args.prefill_graph_tokens}")
    defaults = SMOKE_DEFAULTS if args.smoke else GPU_DEFAULTS
    args.shapes, args.num_prompts = args.shapes or defaults[0], args.num_prompts or defaults[1]
    args.hf_batches = args.hf_batches or defaults[2]
    return args


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    work, variants = parse_shapes(args.shapes, args.num_prompts), parse_variants(args.variants)
    opened = gpu.open_run("offline_throughput", BENCHMARK, args)
    run, where, model, mc = opened.run, opened.where, opened.model, opened.config
    run.doc.update(model=model, reference=REFERENCE, variants={}, tandem=[], transformers=[])
    rates = run.measure_rates(where)
    setup = Setup(args, where, rates, mc, floors.ModelCost.from_config(mc, where.dtype_bytes), run)
    run.doc["model_cost"] = dataclasses.asdict(setup.cost)
    run.save()
    for variant in [] if args.skip_tandem else variants:
        cost = variant.cost(mc, where.dtype_bytes)
        run_tandem(dataclasses.replace(setup, variant=variant, cost=cost), model, work)
    if not args.skip_hf:
        run_transformers(setup, work)
    print_table(run.doc)
    run.finish()
    return run.path


if __name__ == "__main__":
    main()
