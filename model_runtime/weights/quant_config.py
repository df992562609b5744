"""A Hugging Face checkpoint's `quantization_config` (config.json) -> `FP8Checkpoint`, or a refusal naming the key.

Two layouts of pre-quantized FP8 weights are read (both store `<proj>.weight` as float8_e4m3fn beside a
`<proj>.weight_scale`, weight = fp8 x scale):

    quant_method "compressed-tensors"   (llm-compressor; format float-quantized or naive-quantized)
        config_groups.<g>.weights: {num_bits: 8, type: float, symmetric: true, strategy: tensor | channel}
        weight_scale [1] or [] (tensor), [N, 1] (channel); input_activations (8-bit float, static or dynamic)
        may add `<proj>.input_scale`; `ignore` lists modules left unquantized (lm_head)
    quant_method "fp8"                   (vLLM / AutoFP8 / transformers' FP8)
        activation_scheme static | dynamic; weight_scale per tensor ([] or [1]); ignored_layers or
        modules_to_not_convert; weight_block_size (block-wise scales) is refused

Everything else is refused here, before a tensor is read: other bit widths, int types, group or block
strategies, asymmetric or dynamic weights, a KV-cache scheme (its stored scales would be dropped), sparsity or
transforms, an unknown method. What the tensors themselves must be is checked by `fp8_source.FP8CheckpointSource`.
This module does not import torch (the router resolves models for their tokenizer alone).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model_runtime.weights.errors import ModelLoadError

KEY = "quantization_config"
CT_FORMATS = ("float-quantized", "naive-quantized")
WEIGHT_STRATEGIES = ("tensor", "channel")
ACTIVATION_SCHEMES = ("static", "dynamic")


@dataclass(frozen=True)
class FP8Checkpoint:
    """A checkpoint whose projections are stored as float8_e4m3fn with `weight_scale`s."""

    method: str  # "compressed-tensors" | "fp8"
    strategies: frozenset[str]  # the weight scales' granularities the config allows: tensor, channel
    ignore: tuple[str, ...] = ()  # modules the config leaves unquantized (for error messages)


def read_fp8_checkpoint(config: dict[str, Any], where: Path) -> FP8Checkpoint | None:
    """The FP8 layout of a config.json's `quantization_config`; None when there is none (a plain checkpoint)."""
    raw = config.get(KEY)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{where}: {KEY} must be an object, got {raw!r}")
    method = raw.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(raw, where)
    if method == "fp8":
        return _fp8(raw, where)
    raise ModelLoadError(
        f"{where}: {KEY}.quant_method {method!r} is not supported (pre-quantized checkpoints: "
        "compressed-tensors or fp8 with FP8 weights)"
    )


def _compressed_tensors(raw: dict[str, Any], where: Path) -> FP8Checkpoint:
    _require(raw, "format", CT_FORMATS, where)
    for key in ("kv_cache_scheme", "transform_config"):
        if raw.get(key):
            raise ModelLoadError(f"{where}: {KEY}.{key} {raw[key]!r} is not supported")
    sparsity = raw.get("sparsity_config")
    if sparsity and (not isinstance(sparsity, dict) or sparsity.get("format") != "dense"):
        raise ModelLoadError(f"{where}: {KEY}.sparsity_config {sparsity!r} is not supported (only dense)")
    groups = raw.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ModelLoadError(f"{where}: {KEY}.config_groups must be a non-empty object, got {groups!r}")
    strategies = frozenset(_group_strategy(name, group, where) for name, group in groups.items())
    return FP8Checkpoint("compressed-tensors", strategies, _names(raw, "ignore", where))


def _group_strategy(name: str, group: Any, where: Path) -> str:
    """A config group's weight strategy, once its weights and activations are ones FP8Linear can hold."""
    at = f"{KEY}.config_groups.{name}"
    if not isinstance(group, dict):
        raise ModelLoadError(f"{where}: {at} must be an object, got {group!r}")
    if group.get("format") is not None:
        _require(group, "format", CT_FORMATS, where, at)
    weights = group.get("weights")
    if not isinstance(weights, dict):
        raise ModelLoadError(f"{where}: {at}.weights must be an object, got {weights!r}")
    at_w = f"{at}.weights"
    _require(weights, "num_bits", (8,), where, at_w)
    _require(weights, "type", ("float",), where, at_w)
    _require(weights, "symmetric", (True,), where, at_w)
    _require(weights, "strategy", WEIGHT_STRATEGIES, where, at_w)
    for key in ("dynamic", "group_size", "block_structure"):
        if weights.get(key):
            raise ModelLoadError(f"{where}: {at_w}.{key} {weights[key]!r} is not supported (must be unset)")
    inputs = group.get("input_activations")
    if inputs is not None:
        # FP8Linear quantizes activations per token at run time; any 8-bit float scheme is one it can stand in
        # for. Another width or an int type would be a different model.
        at_in = f"{at}.input_activations"
        if not isinstance(inputs, dict):
            raise ModelLoadError(f"{where}: {at_in} must be an object, got {inputs!r}")
        _require(inputs, "num_bits", (8,), where, at_in)
        _require(inputs, "type", ("float",), where, at_in)
    if group.get("output_activations") is not None:
        raise ModelLoadError(f"{where}: {at}.output_activations is not supported (must be null)")
    return str(weights["strategy"])


def _fp8(raw: dict[str, Any], where: Path) -> FP8Checkpoint:
    if raw.get("weight_block_size") is not None:
        raise ModelLoadError(
            f"{where}: {KEY}.weight_block_size {raw['weight_block_size']!r}: block-wise FP8 scales are not "
            "supported (only one scale per tensor or per output channel)"
        )
    _require(raw, "activation_scheme", ACTIVATION_SCHEMES, where)
    if raw.get("kv_cache_scheme"):
        raise ModelLoadError(f"{where}: {KEY}.kv_cache_scheme {raw['kv_cache_scheme']!r} is not supported")
    ignore = _names(raw, "ignored_layers", where) or _names(raw, "modules_to_not_convert", where)
    return FP8Checkpoint("fp8", frozenset({"tensor"}), ignore)


def _require(raw: dict[str, Any], key: str, allowed: tuple[object, ...], where: Path, at: str = KEY) -> None:
    value = raw.get(key)
    # `True == 1`, so compare types too: num_bits true or symmetric 1 are not what they look like.
    if not any(value == ok and type(value) is type(ok) for ok in allowed):
        shown = " or ".join(repr(ok) for ok in allowed)
        raise ModelLoadError(f"{where}: {at}.{key} {value!r} is not supported (must be {shown})")


def _names(raw: dict[str, Any], key: str, where: Path) -> tuple[str, ...]:
    value = raw.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ModelLoadError(f"{where}: {KEY}.{key} must be a list of module names, got {value!r}")
    return tuple(value)
