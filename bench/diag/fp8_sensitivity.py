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
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from contextlib import contextmanager

from bench.diag.fp8_rotation import LONG_TEXT, build, perplexity
from model_runtime.config import DeviceConfig, EngineConfig
from model_runtime.llm import LLM
from model_runtime.model_runner import ModelRunner
from model_runtime.weights import load_model_config, resolve_model
from tests.model.test_fp8_weights import TEXT

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
    source = resolve_model("smollm2-135m-instruct")
    model = load_model_config(source)
    tokenizer = LLM(
        config=EngineConfig(model="smollm2-135m-instruct", device=DeviceConfig(device="cpu"))
    ).tokenizer
    texts = {"short": tokenizer.encode(TEXT), "long": tokenizer.encode(LONG_TEXT)}
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
        if hasattr(module, "round_activations"):
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
