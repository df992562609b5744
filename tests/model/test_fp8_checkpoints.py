"""Pre-quantized FP8 checkpoints (weights.quant_config, weights.fp8_source): a tiny random Llama whose projections
the test quantizes itself and writes in the compressed-tensors and fp8 layouts. The engine (device.quantization
left at none: the checkpoint's method is taken) keeps the stored fp8 bytes, and its logits and greedy tokens are
those of transformers' float32 LlamaForCausalLM built from the dequantized weights (fp8 x weight_scale), at TP=1
and TP=2. Each unsupported config, and each tensor that breaks the layout, is refused naming what it is.

Measured (torch 2.13 CPU, float32): logits within 1.6e-5 of transformers' (largest logit 12.5) in each layout;
TP=2 within 1.1e-5 of TP=1; greedy tokens equal for all 48 generated.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

from model_runtime.quantization.apply import resolve_method
from model_runtime.weights import ModelLoadError, load_model_config, load_weights, resolve_model
from tests.model import tp_ranks
from tests.model.reference import assert_greedy_match, hf_greedy
from tests.model.tiny_models import EOS_ID, tiny_hf_model, write_tiny_tokenizer_files

pytestmark = pytest.mark.model

FP8 = torch.float8_e4m3fn
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LOGITS_RTOL = 1e-4  # of the largest logit; the weights are bit-identical, only summation order differs
MAX_NEW = 12
PROMPTS = [[5, 9, 14, 3, 7, 21, 8], [11, 4, 30], [100, 200, 300, 400, 17]]


def _ct(strategy: str, inputs: dict[str, Any] | None, fmt: str) -> dict[str, Any]:
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": False}
    weights |= {"group_size": None, "block_structure": None, "actorder": None, "observer": "minmax"}
    group = {
        "targets": ["Linear"],
        "weights": weights,
        "input_activations": inputs,
        "output_activations": None,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "quantization_status": "compressed",
    }


DYNAMIC_TOKEN = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}
STATIC_TENSOR = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}


@dataclass(frozen=True)
class Layout:
    """How a checkpoint stores its FP8 projections."""

    quantization_config: dict[str, Any]
    per_channel: bool
    scale_shape: Callable[[int], tuple[int, ...]]  # a weight_scale's (and input_scale's) shape, from the rows
    scale_dtype: torch.dtype
    input_scales: bool  # static activation scales written beside the weights


LAYOUTS = {
    "ct-channel": Layout(
        _ct("channel", DYNAMIC_TOKEN, "float-quantized"), True, lambda n: (n, 1), torch.bfloat16, False
    ),
    "ct-tensor": Layout(
        _ct("tensor", STATIC_TENSOR, "naive-quantized"), False, lambda n: (1,), torch.float32, True
    ),
    "fp8-static": Layout(
        {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]},
        False,
        lambda n: (),
        torch.float32,
        True,
    ),
}


def _quantize(
    weight: torch.Tensor, per_channel: bool, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (fp8 [N, K], scale [N, 1] or [1, 1] rounded to scale_dtype): the test's own quantizer."""
    amax = weight.abs().amax(dim=1, keepdim=True) if per_channel else weight.abs().amax().reshape(1, 1)
    scale = (amax / 448.0).clamp(min=1e-12).to(scale_dtype).float()
    return (weight / scale).clamp(-448.0, 448.0).to(FP8), scale


def write_fp8_checkpoint(
    directory: Path,
    layout: str,
    edit: Callable[[dict[str, torch.Tensor], dict[str, Any]], None] | None = None,
) -> tuple[Path, LlamaForCausalLM]:
    """The tiny Llama (seed 0) quantized and written in `layout` into `directory`, and transformers' float32
    model of its dequantized weights. `edit(tensors, config)` may change what is written (not the reference)."""
    form = LAYOUTS[layout]
    model = tiny_hf_model("llama", seed=0, initializer_range=0.4)
    tensors, dequantized = {}, {}
    for name, value in model.state_dict().items():
        module = name.rpartition(".")[0]
        if not module.endswith(PROJECTIONS):
            tensors[name] = dequantized[name] = value
            continue
        q, scale = _quantize(value, form.per_channel, form.scale_dtype)
        tensors[name], dequantized[name] = q, q.float() * scale
        tensors[module + ".weight_scale"] = scale.to(form.scale_dtype).reshape(
            form.scale_shape(value.shape[0])
        )
        if form.input_scales:
            tensors[module + ".input_scale"] = torch.full(form.scale_shape(1), 0.02)
    config = json.loads(model.config.to_json_string()) | {"architectures": ["LlamaForCausalLM"]}
    config["quantization_config"] = json.loads(json.dumps(form.quantization_config))  # a copy to edit
    if edit is not None:
        edit(tensors, config)
    directory.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config), encoding="utf-8")
    write_tiny_tokenizer_files(directory)
    reference = LlamaForCausalLM(model.config).eval()
    reference.load_state_dict(dequantized)
    return directory, reference


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, LlamaForCausalLM]]:
    root = tmp_path_factory.mktemp("fp8")
    return {layout: write_fp8_checkpoint(root / layout, layout) for layout in LAYOUTS}


@torch.inference_mode()
def _reference_logits(model: LlamaForCausalLM, prompts: list[list[int]]) -> np.ndarray:
    """transformers' logits in the order of tp_ranks.prefill_then_decode's two steps: every prompt row, then
    each prompt's decode row (its last token fed again)."""
    full = [model(torch.tensor([p + p[-1:]])).logits[0] for p in prompts]
    rows = [f[: len(p)] for f, p in zip(full, prompts)] + [f[len(p) :] for f, p in zip(full, prompts)]
    return torch.cat(rows).numpy()


def _our_logits(steps: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    return np.concatenate([logits for _, logits in steps])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fp8_checkpoint_loads_as_stored_and_matches_transformers(checkpoints, layout: str) -> None:
    path, reference = checkpoints[layout]
    source = resolve_model(str(path))
    assert source.fp8 is not None and resolve_method("none", source) == "fp8"
    weights = load_weights(source, load_model_config(source), torch.float32)
    stored = reference.state_dict()
    raw = load_file(str(path / "model.safetensors"))
    attn = "model.layers.1.self_attn."
    fused = torch.cat([raw[attn + p + ".weight"] for p in ("q_proj", "k_proj", "v_proj")])
    assert weights["layers.1.qkv.weight"].dtype == FP8
    assert torch.equal(weights["layers.1.qkv.weight"].view(torch.uint8), fused.view(torch.uint8))
    dequant = weights["layers.1.o_proj.weight"].float() * weights["layers.1.o_proj.weight_scale"][:, None]
    assert torch.equal(dequant, stored[attn + "o_proj.weight"])
    assert weights["embed_tokens.weight"].dtype == torch.float32

    batches = tp_ranks.prefill_then_decode(PROMPTS)
    ours = _our_logits(tp_ranks.step_outputs(None, str(path), batches)[0])
    ref = _reference_logits(reference, PROMPTS)
    err, scale = np.abs(ours - ref).max(), np.abs(ref).max()
    print(f"{layout}: logits off transformers' by {err:.2e} (largest {scale:.3f})")
    assert err <= LOGITS_RTOL * scale


def test_fp8_checkpoint_greedy_tokens_match_transformers(checkpoints) -> None:
    path, reference = checkpoints["ct-channel"]
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 4, 9, 23)]
    tokens, *_ = tp_ranks.greedy_tokens(None, str(path), prompts, MAX_NEW)
    for i, (prompt, ours) in enumerate(zip(prompts, tokens)):
        ref = hf_greedy(reference, prompt, MAX_NEW, EOS_ID)
        assert_greedy_match(ours[: len(ref.token_ids)], ref, f"prompt {i}")


def test_fp8_checkpoint_under_tensor_parallelism_matches_one_device(checkpoints) -> None:
    """Per-channel scales are cut with q/k/v and gate/up rows and kept whole for o_proj and down (column cuts);
    per-tensor ones are repeated per row first."""
    batches = tp_ranks.prefill_then_decode(PROMPTS)
    layouts = ["ct-channel", "fp8-static"]
    checks = [("steps", str(checkpoints[layout][0]), batches) for layout in layouts]
    ranks = tp_ranks.run_ranks(tp_ranks.run_checks, 2, checks)
    for i, layout in enumerate(layouts):
        one = _our_logits(tp_ranks.step_outputs(None, checks[i][1], batches)[0])
        two = [_our_logits(rank[i][0]) for rank in ranks]
        np.testing.assert_array_equal(two[0], two[1])
        err, scale = np.abs(two[0] - one).max(), np.abs(one).max()
        print(f"{layout}: TP=2 logits off TP=1 by {err:.2e} (largest {scale:.3f})")
        assert err <= LOGITS_RTOL * scale


def _set(path: str, value: Any) -> Callable[[dict[str, torch.Tensor], dict[str, Any]], None]:
    def edit(_tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
        *parents, key = path.split(".")
        node = config["quantization_config"]
        for parent in parents:
            node = node[parent]
        node[key] = value

    return edit


W = "config_groups.group_0.weights"
BAD_CONFIGS = [
    ("ct-channel", _set(f"{W}.num_bits", 4), "weights.num_bits 4"),
    ("ct-channel", _set(f"{W}.type", "int"), "weights.type 'int'"),
    ("ct-channel", _set(f"{W}.strategy", "group"), "weights.strategy 'group'"),
    ("ct-channel", _set(f"{W}.symmetric", False), "weights.symmetric False"),
    ("ct-channel", _set(f"{W}.dynamic", True), "weights.dynamic True"),
    (
        "ct-channel",
        _set("config_groups.group_0.input_activations.num_bits", 4),
        "input_activations.num_bits 4",
    ),
    ("ct-channel", _set("format", "pack-quantized"), "format 'pack-quantized'"),
    ("ct-channel", _set("kv_cache_scheme", {"num_bits": 8, "type": "float"}), "kv_cache_scheme"),
    ("fp8-static", _set("weight_block_size", [128, 128]), "weight_block_size [128, 128]"),
    ("fp8-static", _set("activation_scheme", "smooth"), "activation_scheme 'smooth'"),
    ("fp8-static", _set("quant_method", "awq"), "quant_method 'awq'"),
]


@pytest.mark.parametrize(("layout", "edit", "field"), BAD_CONFIGS, ids=[f for _, _, f in BAD_CONFIGS])
def test_an_unsupported_quantization_config_is_refused_naming_the_field(
    tmp_path, layout, edit, field
) -> None:
    path, _ = write_fp8_checkpoint(tmp_path / "m", layout, edit)
    with pytest.raises(ModelLoadError, match=f"quantization_config.*{re.escape(field)}"):
        resolve_model(str(path))


def _unquantized(module: str) -> Callable[[dict[str, torch.Tensor], dict[str, Any]], None]:
    def edit(tensors: dict[str, torch.Tensor], _config: dict[str, Any]) -> None:
        scale = tensors.pop(module + ".weight_scale")
        tensors.pop(module + ".input_scale", None)
        tensors[module + ".weight"] = tensors[module + ".weight"].float() * scale.float()

    return edit


def _add(name: str, value: torch.Tensor) -> Callable[[dict[str, torch.Tensor], dict[str, Any]], None]:
    return lambda tensors, _config: tensors.__setitem__(name, value)


def _fp8_lm_head(tensors: dict[str, torch.Tensor], _config: dict[str, Any]) -> None:
    tensors["lm_head.weight"], tensors["lm_head.weight_scale"] = _quantize(
        tensors["lm_head.weight"], False, torch.float32
    )


def _no_quantization_config(tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """FP8 weights with neither scales nor a quantization_config: loading them would drop their scale."""
    del config["quantization_config"]
    for name in [n for n in tensors if n.endswith("_scale")]:
        del tensors[name]


BAD_TENSORS = [
    (
        "ct-channel",
        _unquantized("model.layers.0.self_attn.k_proj"),
        "model.layers.0.self_attn.k_proj.weight is not quantized",
    ),
    (
        "fp8-static",
        _unquantized("model.layers.1.mlp.up_proj"),
        "model.layers.1.mlp.up_proj.weight is not quantized",
    ),
    (
        "ct-tensor",
        _fp8_lm_head,
        "lm_head.weight is stored as F8_E4M3; only the attention and MLP projections may be FP8",
    ),
    (
        "ct-tensor",
        _add("model.layers.0.self_attn.q_proj.weight_scale", torch.ones(64, 1)),
        "q_proj.weight_scale has shape [64, 1]",
    ),
    (
        "fp8-static",
        _add("model.layers.0.self_attn.k_scale", torch.ones(())),
        "self_attn.k_scale: FP8 KV-cache scales",
    ),
    ("ct-channel", _no_quantization_config, "stored as torch.float8_e4m3fn, expected torch.float32"),
]


@pytest.mark.parametrize(("layout", "edit", "message"), BAD_TENSORS, ids=[m for _, _, m in BAD_TENSORS])
def test_a_tensor_that_breaks_the_fp8_layout_is_refused_naming_it(tmp_path, layout, edit, message) -> None:
    path, _ = write_fp8_checkpoint(tmp_path / "m", layout, edit)
    source = resolve_model(str(path))
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        load_weights(source, load_model_config(source), torch.float32)


def test_a_method_other_than_the_checkpoints_is_refused(checkpoints) -> None:
    source = resolve_model(str(checkpoints["ct-tensor"][0]))
    assert resolve_method("fp8", source) == "fp8"
    with pytest.raises(ModelLoadError, match=r"device\.quantization: 'int8' conflicts"):
        resolve_method("int8", source)
    # fp8_group would have to quantize the stored FP8 weights again: refused, naming the way out
    with pytest.raises(ModelLoadError, match=r"device\.quantization: fp8_group needs weights stored in bf16"):
        resolve_method("fp8_group", source)
