"""Quantized weights, applied to a built model from outside (the model file knows nothing of them).

`DeviceConfig.quantization` picks the method; today `fp8` (model_runtime.quantization.fp8): the projection
weights stored as float8 e4m3 with one float32 scale per output channel.
"""

from model_runtime.quantization.fp8 import (
    FP8_MAX,
    FP8Linear,
    dequantize_fp8,
    quantize_fp8,
    quantize_projection_weights,
    use_fp8_projections,
)

__all__ = [
    "FP8_MAX",
    "FP8Linear",
    "dequantize_fp8",
    "quantize_fp8",
    "quantize_projection_weights",
    "use_fp8_projections",
]
