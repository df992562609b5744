"""CPU offline throughput: Tandem's engine vs transformers' generate on the embedded SmolLM2, same run, same prompts.

    .venv/bin/python bench/cpu_offline.py [--max-tokens 32] [--out bench/results/cpu_offline.json]

Greedy, fixed output length (ignore_eos), batch 1 and 16. Reports output tokens per second (generated tokens /
wall time including prefill) and checks that the greedy tokens agree before timing counts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from model_runtime.config import CacheConfig, DeviceConfig, EngineConfig
from model_runtime.llm import LLM
from model_runtime.request import PromptInput, SamplingParams
from model_runtime.weights.source import embedded_model_path

PROMPTS = [
    "The history of the printing press begins",
    "Explain how a transistor works:",
    "A recipe for bread:",
    "The three laws of motion are",
]


def batch_prompts(llm: LLM, size: int) -> list[list[int]]:
    return [llm.tokenizer.encode(PROMPTS[i % len(PROMPTS)]) for i in range(size)]


def time_tandem(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    inputs = [PromptInput(token_ids=tuple(p)) for p in prompts]
    llm.generate(inputs[:1], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(inputs, params)
    return time.perf_counter() - start, [o.token_ids for o in outs]


@torch.inference_mode()
def time_transformers(model, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    # Left-pad to one batch, as a transformers user would.
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    model.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=2, do_sample=False, pad_token_id=0)
    start = time.perf_counter()
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    elapsed = time.perf_counter() - start
    return elapsed, [row[width:].tolist() for row in out]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--out", default="bench/results/cpu_offline.json")
    args = parser.parse_args()
    llm = LLM(config=EngineConfig(cache=CacheConfig(num_blocks=1024), device=DeviceConfig(device="cpu")))
    path = embedded_model_path()
    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    rows = []
    for size in (int(b) for b in args.batches.split(",")):
        prompts = batch_prompts(llm, size)
        t_ours, ours = time_tandem(llm, prompts, args.max_tokens)
        t_ref, theirs = time_transformers(ref, prompts, args.max_tokens)
        same = sum(a[:8] == b[:8] for a, b in zip(ours, theirs))
        tokens = size * args.max_tokens
        rows.append(
            {
                "batch": size,
                "output_tokens": tokens,
                "tandem_tok_s": tokens / t_ours,
                "transformers_tok_s": tokens / t_ref,
                "speedup": t_ref / t_ours,
                "first8_tokens_agree": f"{same}/{size}",
            }
        )
    result = {
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "max_tokens": args.max_tokens,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'batch':>5} {'tandem tok/s':>13} {'transformers tok/s':>19} {'speedup':>8} {'agree':>6}")
    for r in rows:
        print(
            f"{r['batch']:>5} {r['tandem_tok_s']:>13.1f} {r['transformers_tok_s']:>19.1f} {r['speedup']:>8.2f} "
            f"{r['first8_tokens_agree']:>6}"
        )


if __name__ == "__main__":
    main()
