"""The quantization method of `DeviceConfig.quantization`, applied to the weights and to the model built for them.

build_runner:  method = resolve_method(configured, source)                        (a pre-quantized checkpoint's own)
               weights = load_weights(...); quantize_weights(weights, method)     (before the KV cache is sized)
ModelRunner:   model built on meta; quantize_model(model, method, ...); model.load_weights(weights)
"""

from __future__ import annotations

import logging

import torch

from model_runtime.models.llama import LlamaForCausalLM
from model_runtime.quantization.fp8 import quantize_projection_weights, use_fp8_projections
from model_runtime.weights import ModelLoadError, ModelSource

log = logging.getLogger(__name__)


def resolve_method(configured: str, source: ModelSource) -> str:
    """The method the runner builds with. A pre-quantized FP8 checkpoint (`source.fp8`) brings its own, as vLLM
    takes the method from a checkpoint's quantization_config: `none` (the default) follows it, with a log line,
    `fp8` agrees with it, any other method conflicts and is refused. Otherwise `configured` (`fp8` on a model
    stored in bf16 or fp32 quantizes it at load)."""
    if source.fp8 is None or configured == "fp8":
        return configured
    if configured == "fp8_group":
        raise ModelLoadError(
            f"device.quantization: fp8_group needs weights stored in bf16 or fp32; {source.spec} is stored in "
            f"FP8 ({source.fp8.method}) with its own scales: use none or fp8"
        )
    if configured != "none":
        raise ModelLoadError(
            f"device.quantization: {configured!r} conflicts with {source.spec}, whose weights are stored in FP8 "
            f"({source.fp8.method}); use none or fp8"
        )
    log.info("%s is pre-quantized (%s): loading its FP8 weights as stored", source.spec, source.fp8.method)
    return "fp8"


def quantize_weights(weights: dict[str, torch.Tensor], method: str) -> None:
    """Quantize canonical `weights` in place ("none": leave them; projections already FP8 are kept)."""
    if method in ("fp8", "fp8_group"):
        quantize_projection_weights(weights, grouped=method == "fp8_group")
    elif method != "none":
        raise ValueError(f"device.quantization: {method!r} is not none, fp8 or fp8_group")


def quantize_model(
    model: LlamaForCausalLM,
    method: str,
    device: torch.device,
    dtype: torch.dtype,
    fast_accum: bool = False,
) -> None:
    """Give `model` (weights not yet loaded) the modules that hold `method`'s weights; `dtype`: the model's;
    `fast_accum`: device.fp8_fast_accum (the FP8 matmuls' accumulation on Hopper)."""
    if method in ("fp8", "fp8_group"):
        use_fp8_projections(model, device, dtype, grouped=method == "fp8_group", fast_accum=fast_accum)
    elif method != "none":
        raise ValueError(f"device.quantization: {method!r} is not none, fp8 or fp8_group")
