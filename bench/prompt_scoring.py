"""What scoring prompts costs (SamplingParams.prompt_logprobs, the OpenAI API's echo with logprobs): prompt
tokens per second for a batch of prompts with max_tokens 1, plain and scored, on one engine in one run, against
the FLOP floor. Llama-3-8B shape (dummy:llama-3-8b), bf16, CUDA graphs on.

GPU, one command (a minute or two, most of it the engine's start-up):

    python3 bench/prompt_scoring.py                       # 64 prompts of 1024 tokens, top 0, 1 and 5
    python3 bench/prompt_scoring.py --ahead               # the engine scheduling ahead, as workers run it
    python3 bench/prompt_scoring.py --smoke               # the CPU check: tiny model, seconds

Each variant (plain: no scores; top-N: prompt_logprobs N) runs --reps times after one untimed warm-up run, every
run fresh random prompts (prefix caching is off), all added at once and stepped until the last finishes; the
median run's prompt tokens / wall seconds is reported with its ratio to plain's. Floor: the batch's FLOPs at
the bf16 matmul rate measured in the same run (8192^3): the prompts through every layer, causal attention, one
logits row each, plus for a scored variant a logits row per scored token (2 x hidden x vocab); fraction =
floor / median. Scoring's own cost beyond those FLOPs: log_softmax, the target's logprob and the top-n over
every scored row (float32, vocab wide), in slices of 256 rows (model_runtime.prompt_scores).
Prints a table (stdout), progress (stderr), and rewrites bench/results/prompt_scoring_<gpu>.json after each
variant. Exit status 1 when a variant raised (traceback on stderr, message in the JSON's "errors").
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import floors
from bench import harness as gpu
from model_runtime.config import SchedulerConfig
from model_runtime.engine import Engine
from model_runtime.request import SamplingParams

BENCHMARK = "prompt tokens/s with and without prompt logprobs, one engine, against the FLOP floor"


@dataclass(frozen=True)
class ScoringRow:
    variant: str  # "plain" or "top-N"
    prompt_logprobs: int | None
    num_prompts: int
    prompt_len: int
    reps: int
    median_s: float
    tokens_per_s: float  # prompt tokens / median seconds
    floor_s: float
    fraction_of_floor: float
    vs_plain: float | None  # this variant's tokens/s over plain's (None for plain itself)


def run_batch(engine: Engine, prompts: list[list[int]], scored: int | None, tag: str) -> float:
    """Seconds from adding every prompt to the last one's first (and only) token; checks every scored request
    got a score for each prompt token after its first."""
    sampling = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=scored)
    gpu.synchronize(str(engine.device))
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, sampling)
    got: dict[str, int] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.prompt_logprobs is not None:
                got[out.request_id] = sum(s is not None for s in out.prompt_logprobs)
    seconds = time.perf_counter() - t0
    if scored is not None and sorted(got.values()) != [len(p) - 1 for p in prompts]:
        raise gpu.BenchError(f"{tag}: scores missing ({len(got)} requests scored of {len(prompts)})")
    return seconds


def run_variant(
    engine: Engine,
    scored: int | None,
    args: argparse.Namespace,
    rates: gpu.DeviceRates,
    cost: floors.ModelCost,
) -> ScoringRow:
    name = "plain" if scored is None else f"top-{scored}"
    vocab = engine.model_config.vocab_size
    seed = 1000 * (1 + (scored if scored is not None else -1))
    run_batch(engine, gpu.random_prompts(args.num_prompts, args.prompt_len, vocab, seed), scored, f"{name}-w")
    times = [
        run_batch(
            engine, gpu.random_prompts(args.num_prompts, args.prompt_len, vocab, seed + 1 + r), scored, name
        )
        for r in range(args.reps)
    ]
    median = statistics.median(times)
    tokens = args.num_prompts * args.prompt_len
    flops = args.num_prompts * cost.prefill_flops(args.prompt_len)
    if scored is not None:
        flops += args.num_prompts * (args.prompt_len - 1) * 2 * cost.head_params
    floor = cost.compute_s(rates, flops, tokens)
    return ScoringRow(
        name, scored, args.num_prompts, args.prompt_len, args.reps, median, tokens / median, floor,
        floor / median, None,
    )  # fmt: skip


def print_table(doc: dict) -> None:
    mode = "scheduled ahead" if doc["settings"]["ahead"] else "synchronous"
    print(f"\n{doc['gpu']}: {doc['model']}, {doc['settings']['num_prompts']} prompts of "
          f"{doc['settings']['prompt_len']} tokens, max_tokens 1, {mode}")  # fmt: skip
    print(f"{'variant':<8} {'median s':>9} {'prompt tok/s':>13} {'of floor':>9} {'x plain':>8}")
    for row in doc["rows"]:
        ratio = "-" if row["vs_plain"] is None else f"{row['vs_plain']:.3f}"
        print(
            f"{row['variant']:<8} {row['median_s']:>9.3f} {row['tokens_per_s']:>13,.0f} "
            f"{row['fraction_of_floor']:>9.0%} {ratio:>8}"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="default dummy:llama-3-8b (smoke: a tiny HF model)")
    p.add_argument("--num-prompts", type=int, help="prompts per run (default 64; smoke 4)")
    p.add_argument("--prompt-len", type=int, help="tokens per prompt (default 1024; smoke 40)")
    p.add_argument("--top", default="0,1,5", help="the scored variants' prompt_logprobs, comma-separated")
    p.add_argument("--reps", type=int, default=3, help="timed runs per variant (after one warm-up)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="the step budget (default 2048)")
    p.add_argument(
        "--ahead",
        action="store_true",
        help="schedule steps ahead (scheduler.async_scheduling), as workers do",
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.90)
    p.add_argument("--budget-s", type=float, default=500.0, help="stop starting variants after this")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, short prompts, float32, no graphs")
    p.add_argument("--out", help="JSON path (default bench/results/prompt_scoring_<gpu>.json)")
    args = p.parse_args(argv)
    args.num_prompts = args.num_prompts or (4 if args.smoke else 64)
    args.prompt_len = args.prompt_len or (40 if args.smoke else 1024)
    try:
        args.tops = [int(n) for n in args.top.split(",") if n.strip()]
    except ValueError:
        raise SystemExit(f"--top: comma-separated integers in [0, 20], got {args.top!r}") from None
    if (
        args.num_prompts < 1
        or args.prompt_len < 2
        or args.reps < 1
        or not all(0 <= n <= 20 for n in args.tops)
    ):
        raise SystemExit("--num-prompts, --reps >= 1, --prompt-len >= 2, --top values in [0, 20]")
    return args


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    opened = gpu.open_run("prompt_scoring", BENCHMARK, args)
    run, where, model = opened.run, opened.where, opened.model
    cost = floors.ModelCost.from_config(opened.config, where.dtype_bytes)
    run.doc.update(model=model, model_cost=dataclasses.asdict(cost), rows=[])
    rates = run.measure_rates(where)
    limits = SchedulerConfig(
        min(args.num_prompts, 256),
        args.max_num_batched_tokens,
        max_model_len=args.prompt_len + 16,
        async_scheduling=args.ahead,
    )
    build = partial(gpu.build_engine, model, where, limits, args.gpu_memory_utilization)
    engine = run.job("engine", build)
    plain = None
    for scored in (None, *args.tops):
        if engine is None:  # the engine job failed or was skipped (recorded)
            break
        name = "plain" if scored is None else f"top-{scored}"
        row = run.job(name, partial(run_variant, engine, scored, args, rates, cost))
        if row is None:
            continue
        if scored is None:
            plain = row
        elif plain is not None:
            row = dataclasses.replace(row, vs_plain=row.tokens_per_s / plain.tokens_per_s)
        run.doc["rows"].append(dataclasses.asdict(row))
        run.save()
        gpu.log(f"{name}: {row.tokens_per_s:,.0f} prompt tok/s, {row.fraction_of_floor:.0%} of the floor")
    print_table(run.doc)
    run.finish()
    return run.path


if __name__ == "__main__":
    main()
