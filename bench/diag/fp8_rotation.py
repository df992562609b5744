"""Does an offline orthogonal rotation of the residual stream bring SmolLM2-135M's FP8 perplexity nearer float32
(issue 19's 1%)? CPU, about five minutes.

    PYTHONPATH=. python3 bench/diag/fp8_rotation.py

The rotation (as QuaRot does before integer quantization): fold every RMSNorm gain into the projections after
it, then turn the residual stream by an orthogonal Q. The embedding becomes E Q, the projections that read the
stream W diag(g) Q (qkv, gate_up), those that write it Q^T W (o_proj, down), and the lm_head (E diag(g_final)) Q,
untied from the embedding. In exact arithmetic nothing changes (the unquantized row checks it); the hope was
that spreading outlier channels over all of them helps the per-token activation and per-row weight scales. Q is
a random orthogonal matrix (QR of a Gaussian, 576 is not a power of two); FP8 is `quantization: fp8` computed as
a Hopper computes it (fp8.emulate_scaled_mm: activations rounded per token).

Measured (2026-11-29, torch 2.13 CPU), change of perplexity against float32 on tests/model/test_fp8_weights.TEXT
(205 tokens) and tests/model/lighthouse.txt (890, windows of 480): float32 23.528 / 25.010; fp8 +2.80% / +3.70%;
rotated fp8, seeds 0, 1, 2: +9.02 / +13.03 / +12.91% and +6.79 / +7.43 / +9.21%; rotated, unquantized, -0.00% /
+0.00%. Worse, by a
wide margin: e4m3's error is relative to each element, so a small weight or activation already gets a small
error, and the rotation gives every element an error the size of its row's typical one. Folding the gains alone
was worse too (+3.3-3.5%, docs/architecture.md). The way to the 1% stays finer scales (quantization:
fp8_group), not incoherence.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from model_runtime.attention.torch_ref import TorchAttention
from model_runtime.config import DeviceConfig, EngineConfig, ModelConfig
from model_runtime.kv_layout import KVLayout
from model_runtime.llm import LLM
from model_runtime.model_runner import ModelRunner
from model_runtime.quantization.apply import quantize_weights
from model_runtime.quantization.fp8 import emulate_scaled_mm
from model_runtime.weights import ModelSource, load_model_config, load_weights, resolve_model
from tests.model import tp_ranks
from tests.model.test_fp8_weights import TEXT

LONG_TEXT = (Path(__file__).resolve().parents[2] / "tests" / "model" / "lighthouse.txt").read_text()
WINDOW = 480
SEEDS = (0, 1, 2)


def random_orthogonal(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))


def rotate(weights: dict[str, torch.Tensor], num_layers: int, q: torch.Tensor) -> None:
    """The residual stream turned by q (float64 arithmetic), norm gains folded; adds an untied lm_head."""
    embed, gain = weights["embed_tokens.weight"].double(), weights["norm.weight"].double()
    weights["lm_head.weight"] = ((embed * gain) @ q).float()
    weights["embed_tokens.weight"] = (embed @ q).float()
    weights["norm.weight"] = torch.ones_like(weights["norm.weight"])
    for i in range(num_layers):
        p = f"layers.{i}."
        for norm, reader in (("input_norm", "qkv"), ("post_attn_norm", "gate_up")):
            g = weights[p + norm + ".weight"].double()
            weights[p + reader + ".weight"] = ((weights[p + reader + ".weight"].double() * g) @ q).float()
            weights[p + norm + ".weight"] = torch.ones_like(weights[p + norm + ".weight"])
        for writer in ("o_proj", "down"):
            weights[p + writer + ".weight"] = (q.T @ weights[p + writer + ".weight"].double()).float()


def build(
    source: ModelSource,
    model: ModelConfig,
    quantization: str,
    q: torch.Tensor | None,
    dtype: torch.dtype = torch.float32,
) -> ModelRunner:
    """A CPU runner of the model in `dtype` (weights, activations and cache), quantized as asked (FP8 computed
    as a Hopper computes it), its residual stream turned by q when given."""
    weights = load_weights(source, model, dtype, "cpu", None)
    if q is not None:
        rotate(weights, model.num_layers, q)
        model = dataclasses.replace(model, tie_word_embeddings=False)
    quantize_weights(weights, quantization)
    layout = KVLayout(
        model.num_layers,
        model.num_kv_heads,
        model.head_dim,
        tp_ranks.BLOCK_SIZE,
        256,
        str(dtype).split(".")[-1],
    )
    runner = ModelRunner(model, weights, layout, "cpu", TorchAttention(), 512, quantization=quantization)
    if quantization != "none":
        emulate_scaled_mm(runner.model)
    return runner


def perplexity(runner: ModelRunner, ids: list[int]) -> float:
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, WINDOW):
        chunk = ids[start : start + WINDOW + 1]
        logits = runner.execute_batch(tp_ranks.prefill_then_decode([chunk])[0])[:-1]
        nll += F.cross_entropy(logits, torch.tensor(chunk[1:]), reduction="sum").item()
        count += len(chunk) - 1
    return math.exp(nll / count)


def smollm2_and_texts() -> tuple[ModelSource, ModelConfig, dict[str, list[int]]]:
    """The embedded SmolLM2-135M's source and config, and the two texts' token ids ("short": the test's fixed
    text, "long": lighthouse.txt)."""
    source = resolve_model("smollm2-135m-instruct")
    model = load_model_config(source)
    tokenizer = LLM(
        config=EngineConfig(model="smollm2-135m-instruct", device=DeviceConfig(device="cpu"))
    ).tokenizer
    return source, model, {"short": tokenizer.encode(TEXT), "long": tokenizer.encode(LONG_TEXT)}


def main() -> None:
    source, model, texts = smollm2_and_texts()
    base = {name: perplexity(build(source, model, "none", None), ids) for name, ids in texts.items()}
    print(f"float32: {base}", flush=True)
    rows = [("fp8", "fp8", None), ("rotated, unquantized", "none", random_orthogonal(model.hidden_size, 0))]
    rows += [(f"rotated fp8, seed {s}", "fp8", random_orthogonal(model.hidden_size, s)) for s in SEEDS]
    for name, quantization, q in rows:
        t0 = time.perf_counter()
        runner = build(source, model, quantization, q)
        change = {k: f"{perplexity(runner, ids) / base[k] - 1:+.2%}" for k, ids in texts.items()}
        print(f"{name}: {change} ({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
