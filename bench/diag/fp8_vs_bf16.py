"""SmolLM2-135M's FP8 perplexity against bf16, the reference issue 19 names, with bfloat16 activations as a GPU
runs them (CPU, about a minute).

    PYTHONPATH=. python3 bench/diag/fp8_vs_bf16.py

tests/model/test_fp8_weights.py and the other diags here measure against float32 activations. This builds the
model in bfloat16 (weights, activations, cache), with and without `quantization: fp8` computed as a Hopper
computes it (fp8.emulate_scaled_mm: weights e4m3 per row, activations rounded to e4m3 per token from their
bfloat16 values), and prints both texts' perplexities against float32 and FP8's against bf16.

Texts: the test's fixed text, tests/model/lighthouse.txt and tests/model/millrace.txt (original prose, written
for this: a longer, expository text), each in windows of 480 tokens. Measured (2026-11-29, torch 2.13 CPU,
aa0548a), 205 / 890 / 1,972 tokens:

    float32                  23.528          25.010          31.445
    bf16                     +0.57%          -0.14%          +0.23%      (against float32)
    fp8 (bf16 activations)   +0.83%          +3.34%          +1.05%
    fp8 against bf16         +0.26%          +3.49%          +0.82%      pooled over 3,067 tokens: +1.55%

Within the issue's 1% on two texts of three, not on the lighthouse story nor pooled (docs/architecture.md's
quality note: on texts this short, one rounding against another moves perplexity by a point or two).

Measured again (2026-11-29, an AMD EPYC CPU with AVX2 and no AVX-512, ea91f22; float32 the same to the digits
above), as the code stands (activation rows multiplied by their scale's reciprocal since 321d529) and with the
division of aa0548a put back for the run:

    bf16                     +0.55%          +0.07%          -0.19%      (against float32: the CPU's bf16 differs)
    fp8 against bf16         +0.92%          +2.94%          +2.06%      pooled +2.24%
    ... rows divided         +2.98%          +2.76%          +1.28%      pooled +1.82%

So the measure moves by about half a point with the CPU and with a rounding change that alters a few codes in a
million; neither reaches 1%.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from bench.diag.fp8_rotation import build, perplexity, smollm2_and_texts
from model_runtime.config import DeviceConfig, EngineConfig
from model_runtime.llm import LLM

MILLRACE = (Path(__file__).resolve().parents[2] / "tests" / "model" / "millrace.txt").read_text()


def main() -> None:
    source, model, texts = smollm2_and_texts()
    tokenizer = LLM(
        config=EngineConfig(model="smollm2-135m-instruct", device=DeviceConfig(device="cpu"))
    ).tokenizer
    texts["millrace"] = tokenizer.encode(MILLRACE)
    ppl = {
        name: {text: perplexity(build(source, model, q, None, dtype), ids) for text, ids in texts.items()}
        for name, q, dtype in (
            ("float32", "none", torch.float32),
            ("bf16", "none", torch.bfloat16),
            ("fp8 (bf16 activations)", "fp8", torch.bfloat16),
        )
    }
    print(f"perplexity ({', '.join(f'{k} {len(v)} tokens' for k, v in texts.items())})")
    for name, row in ppl.items():
        cells = "  ".join(
            f"{text} {value:.3f} ({value / ppl['float32'][text] - 1:+.2%})" for text, value in row.items()
        )
        print(f"  {name:<24} {cells}")
    fp8, bf16 = ppl["fp8 (bf16 activations)"], ppl["bf16"]
    print("  fp8 against bf16:        " + "  ".join(f"{t} {fp8[t] / bf16[t] - 1:+.2%}" for t in texts))
    counts = {t: len(ids) - 1 for t, ids in texts.items()}  # the tokens each text predicts

    def pooled(
        row: dict[str, float],
    ) -> float:  # one perplexity over every predicted token of the three texts
        return math.exp(sum(math.log(row[t]) * n for t, n in counts.items()) / sum(counts.values()))

    print(
        f"  pooled over {sum(counts.values())} tokens: fp8 against bf16 {pooled(fp8) / pooled(bf16) - 1:+.2%}"
    )


if __name__ == "__main__":
    main()
