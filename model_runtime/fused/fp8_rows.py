"""Activations quantized per token for an FP8 projection, and the torch reference that makes them.

    QuantizedRows(codes [T, K] float8_e4m3fn, scales [T, 1] float32),   row t ~ codes[t] * scales[t]
    scales[t] = max(max_k |x[t, k]| / 448, tiny)      codes[t, k] = e4m3(clamp(x[t, k] * (1 / scales[t]), +-448))

The codes multiply by the scale's reciprocal (float32, correctly rounded, one per row) rather than divide each
element by the scale: a division is a sequence of instructions per element, and it bound the fused SiLU kernel
(one H200, 8,192 x 14,336: 223 us dividing, 147 us multiplying, against a 140 us floor for its bytes; run 78).
A code differs from the divided one where the two float32 quotients straddle an e4m3 rounding boundary: 4.5
codes in a million, one step each (bench/fused_rows.py measured it on the GPU before the change). Every producer
of these rows (the torch ops here, act_quant's kernel, the fused norm and SiLU kernels) uses the multiply, so
their bytes stay equal.

An FP8 projection on Hopper (quantization.fp8.FP8Linear, the torch._scaled_mm path) takes its input in this
form. The kernel that produces the input (RMSNorm before qkv and gate_up, SiLU-and-multiply before down) can
write it directly (FusedOps.*_fp8), which saves the projection a separate quantization pass over the activations
(model_runtime.quantization.act_quant): one launch and a read and a write of the whole activation per
projection. Either way the codes are the same bytes: the activation is rounded to the model dtype first, as the
unfused path stores it, and then quantized by this arithmetic.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from model_runtime.weights.canonical import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE


class QuantizedRows(NamedTuple):
    codes: torch.Tensor  # [T, K] float8_e4m3fn
    scales: torch.Tensor  # [T, 1] float32


def quantize_rows_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (codes [T, K] e4m3, scales [T, 1] float32): each token's row max onto 448, in torch ops (the
    reference for the kernels that do this in one pass)."""
    scales = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=FP8_MIN_SCALE)
    return (x.float() * (1.0 / scales)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scales
