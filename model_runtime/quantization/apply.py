"""The quantization method of `DeviceConfig.quantization`, applied to the weights and to the model built for them.

build_runner:  weights = load_weights(...); quantize_weights(weights, method)     (before the KV cache is sized)
ModelRunner:   model built on meta; quantize_model(model, method, ...); model.load_weights(weights)
"""

from __future__ import annotations

import torch

from model_runtime.models.llama import LlamaForCausalLM
from model_runtime.quantization.fp8 import quantize_projection_weights, use_fp8_projections


def quantize_weights(weights: dict[str, torch.Tensor], method: str) -> None:
    """Quantize canonical `weights` in place ("none": leave them)."""
    if method == "fp8":
        quantize_projection_weights(weights)
    elif method != "none":
        raise ValueError(f"device.quantization: {method!r} is not none or fp8")


def quantize_model(model: LlamaForCausalLM, method: str, device: torch.device, dtype: torch.dtype) -> None:
    """Give `model` (weights not yet loaded) the modules that hold `method`'s weights; `dtype`: the model's."""
    if method == "fp8":
        use_fp8_projections(model, device, dtype)
    elif method != "none":
        raise ValueError(f"device.quantization: {method!r} is not none or fp8")
