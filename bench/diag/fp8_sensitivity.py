"""Which of SmolLM2-135M's FP8 projections cost its perplexity (issue 19's 1%)? CPU, a few minutes.

    PYTHONPATH=. python3 bench/diag/fp8_sensitivity.py

FP8 here is `quantization: fp8` computed as a Hopper computes it (fp8.emulate_scaled_mm: weights e4m3 with a
scale per output row, activations rounded to e4m3 per token). Each row of the output puts some projections back
to float32 (the unquantized model's own modules, swapped in) and measures the perplexity again, on
tests/model/test_fp8_weights.TEXT (205 tokens) and tests/model/lighthouse.txt (890, windows of 480), as a change
against float32:

- fp8: every projection FP8; fp8, weights only: the activations left unrounded;
- by kind: one kind (qkv, o_proj, gate_up, down) float32 in every layer;
- by layer: every projection of one layer float32 (the `--top` layers that recover the most, and the least);
- the best layers together: the first 1, 2 and 4 of that ranking float32 at once.

What a row recovers is what that part costs; a part that recovers most of the gap is where an exemption (a
layer kept in the model dtype, as checkpoints' `ignore` lists do) would buy the most quality for the least speed.
It also prints each projection kind's relative weight error, per-row scales (fp8) against per-64-group scales
(fp8_group).

Measured (2026-11-29, torch 2.13 CPU, 321d529; float32 perplexity 23.53 / 25.01):

    fp8                                      short +2.85%  long +3.97%
    fp8, weights only                        short +0.99%  long +2.52%
    qkv / o_proj / gate_up / down float32    short +3.01 / +3.91 / +0.56 / +1.00%   long +2.74 / +4.12 / +2.42 / +2.54%
    one layer float32, the best six          layer 29: +0.08 / +2.96%, 3: +0.17 / +3.51%, 6: +1.63 / +2.71%,
                                             7: +0.85 / +4.08%, 0: +1.41 / +3.54%, 5: +1.86 / +3.21%
    layers [3, 29] / [3, 6, 7, 29] float32   short -1.34 / -0.97%   long +2.29 / +2.50%
    weight error (RMS, relative)             per row 2.62-2.64%, per 64-group 2.49-2.51%, every kind;
                                             0.03-0.04% of the weights below e4m3's normal range per row

No exemption recovers the gap on both texts: putting o_proj back in float32 makes both worse, layers 3 and 29
together take the short text below float32 and leave the long one at +2.3%. Changes of this size move the two
texts' perplexities by one to two points in either direction, as a different rounding of the same weights
would: on 205 and 890 tokens, a perplexity change of a percent is within what one rounding against another
decides. And the rounding error is e4m3's own: 3 significand bits put about 2.5% RMS on every weight whatever
the scale's granularity (per-64-group scales, which measured +0.86% on the long text, round the weights only 5%
better than per-row ones), so no choice of scales or exempt layers makes per-token FP8 reliably close to 1% on
this 135M model; a model this small is also where quantization costs the most.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from bench.diag.fp8_rotation import build, perplexity, smollm2_and_texts
from model_runtime.config import ModelConfig
from model_runtime.model_runner import ModelRunner
from model_runtime.quantization.fp8 import FP8Linear, dequantize_fp8, quantize_fp8, quantize_fp8_groups
from model_runtime.weights import ModelSource, load_weights

KINDS = {"qkv": "attn", "o_proj": "attn", "gate_up": "mlp", "down": "mlp"}


@contextmanager
def float32_parts(fp8: ModelRunner, base: ModelRunner, parts: list[tuple[int, str]]) -> Iterator[None]:
    """fp8's projections (layer, kind) replaced by base's float32 modules for the duration."""
    saved = []
    for layer, kind in parts:
        block = f"layers.{layer}.{KINDS[kind]}"
        target, source = fp8.model.get_submodule(block), base.model.get_submodule(block)
        saved.append((target, kind, getattr(target, kind)))
        setattr(target, kind, getattr(source, kind))
    try:
        yield
    finally:
        for target, kind, module in saved:
            setattr(target, kind, module)


def weight_errors(source: ModelSource, model: ModelConfig) -> None:
    """Relative RMS error of the FP8 weights, per-row against per-group scales, and the share of weights that
    per-row scales put below e4m3's smallest normal value (2^-6 of the scale)."""
    weights = load_weights(source, model, torch.float32, "cpu", None)
    print(
        "weight error (RMS, relative to the weights'), by kind: per-row scales, per-64-group scales, subnormal share"
    )
    for kind in KINDS:
        err_row = err_group = norm = 0.0
        below = count = 0
        for i in range(model.num_layers):
            w = weights[f"layers.{i}.{kind}.weight"]  # canonical names: no attn / mlp level
            codes, scale = quantize_fp8(w)
            err_row += float(((w - dequantize_fp8(codes, scale, torch.float32)) ** 2).sum())
            err_group += float(((w - dequantize_fp8(*quantize_fp8_groups(w), torch.float32)) ** 2).sum())
            norm += float((w**2).sum())
            below += int((w.abs() < scale[:, None] * 2**-6).sum())
            count += w.numel()
        print(
            f"  {kind:<8} {(err_row / norm) ** 0.5:.2%}  {(err_group / norm) ** 0.5:.2%}  {below / count:.4%}"
        )


def changes(runner: ModelRunner, texts: dict[str, list[int]], base: dict[str, float]) -> dict[str, float]:
    return {name: perplexity(runner, ids) / base[name] - 1 for name, ids in texts.items()}


def show(label: str, change: dict[str, float]) -> None:
    cells = "  ".join(f"{name} {value:+.2%}" for name, value in change.items())
    print(f"  {label:<40} {cells}", flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--top", type=int, default=6)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    source, model, texts = smollm2_and_texts()
    weight_errors(source, model)
    base_runner = build(source, model, "none", None)
    base = {name: perplexity(base_runner, ids) for name, ids in texts.items()}
    print(f"float32 perplexity: {base}  ({len(texts['short'])} / {len(texts['long'])} tokens)")
    fp8 = build(source, model, "fp8", None)
    if any(
        getattr(fp8.model.get_submodule(f"layers.{i}.mlp"), "fp8_rows", False)
        for i in range(model.num_layers)
    ):
        raise SystemExit("the FP8 model takes fused FP8 rows: swapping a projection would break its input")
    full = changes(fp8, texts, base)
    show("fp8", full)
    weights_only = build(source, model, "fp8", None)
    for module in weights_only.model.modules():
        if isinstance(module, FP8Linear):
            module.round_activations = False
    show("fp8, weights only", changes(weights_only, texts, base))
    del weights_only
    print("one kind float32 in every layer:")
    for kind in KINDS:
        with float32_parts(fp8, base_runner, [(i, kind) for i in range(model.num_layers)]):
            show(f"{kind} float32", changes(fp8, texts, base))
    print("one layer float32 (every projection of it):")
    by_layer = {}
    for i in range(model.num_layers):
        with float32_parts(fp8, base_runner, [(i, kind) for kind in KINDS]):
            by_layer[i] = changes(fp8, texts, base)
    ranked = sorted(by_layer, key=lambda i: by_layer[i]["short"] + by_layer[i]["long"])
    for i in ranked[: args.top]:
        show(f"layer {i} float32", by_layer[i])
    print("  ...")
    for i in ranked[-2:]:
        show(f"layer {i} float32", by_layer[i])
    print("the best layers together:")
    for n in (1, 2, 4):
        layers = sorted(ranked[:n])
        with float32_parts(fp8, base_runner, [(i, kind) for i in layers for kind in KINDS]):
            show(f"layers {layers} float32", changes(fp8, texts, base))
    print(f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
