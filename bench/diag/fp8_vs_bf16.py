"""SmolLM2-135M's FP8 perplexity against bf16, the reference issue 19 names, with bfloat16 activations as a GPU
runs them (CPU, under a minute).

    PYTHONPATH=. python3 bench/diag/fp8_vs_bf16.py

tests/model/test_fp8_weights.py and the other diags here measure against float32 activations. This builds the
model in bfloat16 (weights, activations, cache), with and without `quantization: fp8` computed as a Hopper
computes it (fp8.emulate_scaled_mm: weights e4m3 per row, activations rounded to e4m3 per token from their
bfloat16 values), and prints both texts' perplexities against float32 and FP8's against bf16.

Measured (2026-11-29, torch 2.13 CPU, 02c2673): float32 23.528 / 25.010 (205 / 890 tokens); bf16 +0.57% /
-0.14%; FP8 +0.83% / +3.34% against float32, so **+0.26% / +3.49% against bf16**: within the issue's 1% on the
test's short text, not on the longer one (docs/architecture.md's quality note: on texts this short, one rounding
against another moves perplexity by a point or two).
"""

from __future__ import annotations

import torch

from bench.diag.fp8_rotation import build, perplexity, smollm2_and_texts


def main() -> None:
    source, model, texts = smollm2_and_texts()
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


if __name__ == "__main__":
    main()
