"""The FP8 KV cache (cache.dtype fp8_e4m3): what a stored byte means, and where its scale comes from.

    stored  = e4m3(k / scale)           scale: one float32 per (layer, K|V, KV head, channel), a power of two
    read    = stored * scale            (exact: a power-of-two scale only moves the exponent)

The scales come from the weights, not from traffic, so every worker that loads the same weights derives the
same ones (a prefill and a decode worker must: the KV bytes travel as they are), whatever it serves and
however its ranks are split. They bound what the layer can write. The attention input is RMSNorm's output
x_hat = x / rms(x) * g, with ||x / rms(x)||_2 <= sqrt(hidden), so by Cauchy-Schwarz channel j of K or V is at
most

    bound_j = sqrt(hidden) * ||W_j * g||_2 + |b_j|          (W_j: the projection's row j, b: its bias)

and rotary embedding mixes channels j and j + D/2 of a key by a rotation, so both get sqrt(bound_j^2 +
bound_{j+D/2}^2). A scale is the power of two at or above bound * MARGIN / 448 (448: e4m3's largest value), so
no key or value saturates (MARGIN covers the rounding of a 16-bit forward pass). The bound is loose (measured on
SmolLM2: the largest key a text produced is a few tens of times below it), which costs nothing in relative
precision: e4m3 keeps 3 mantissa bits at every exponent, and its normal range spans 2^15, so values far below
the bound stay normal.

Per-channel scales cost the kernels nothing: a key's scale folds into the query (q . (k8 * s) = (q * s) . k8)
and a value's into the output (sum_t p_t v8_t * s = s * sum_t p_t v8_t).
"""

from __future__ import annotations

import hashlib
import math

import torch

from model_runtime.config import ModelConfig
from model_runtime.kv_layout import FP8_KV_DTYPE
from model_runtime.weights.canonical import FP8_DTYPE, FP8_MAX

MARGIN = 1.0625  # above the exact bound: a bf16 forward pass rounds a little past it
CACHE_DTYPE_NAMES = {"fp8_e4m3": FP8_KV_DTYPE}  # cache.dtype -> KVLayout.dtype (others are the same name)


def layout_dtype(cache_dtype: str | None, model_dtype: str) -> str:
    """KVLayout.dtype for `cache.dtype` (None: the model's)."""
    if cache_dtype is None:
        return model_dtype
    return CACHE_DTYPE_NAMES.get(cache_dtype, cache_dtype)


def fp8_kv_scales(weights: dict[str, torch.Tensor], config: ModelConfig) -> torch.Tensor:
    """[num_layers, 2, num_kv_heads, head_dim] float32 scales (K, V) on the weights' device, from canonical
    `weights` (a tensor-parallel rank's own: its rows are its heads). FP8 projection weights count as the values
    they stand for (weight * weight_scale)."""
    sqrt_hidden = math.sqrt(config.hidden_size)
    q_size, kv_size = config.q_size, config.kv_size
    per_layer = []
    for i in range(config.num_layers):
        prefix = f"layers.{i}"
        gain = weights[f"{prefix}.input_norm.weight"].double()
        rows = weights[f"{prefix}.qkv.weight"][q_size : q_size + 2 * kv_size]
        scale = weights.get(f"{prefix}.qkv.weight_scale")
        w = rows.double() if scale is None else rows.double() * scale[q_size:].double()[:, None]
        bound = torch.linalg.vector_norm(w * gain, dim=1) * sqrt_hidden
        bias = weights.get(f"{prefix}.qkv.bias")
        if bias is not None:
            bound = bound + bias[q_size : q_size + 2 * kv_size].double().abs()
        k_bound, v_bound = bound.view(2, config.num_kv_heads, config.head_dim)
        half = config.head_dim // 2
        paired = torch.sqrt(k_bound[:, :half] ** 2 + k_bound[:, half:] ** 2)
        per_layer.append(torch.stack([paired.repeat(1, 2), v_bound]))
    bounds = torch.stack(per_layer)
    return power_of_two_scales(bounds)


def power_of_two_scales(bounds: torch.Tensor) -> torch.Tensor:
    """The smallest power of two s with bounds * MARGIN / s <= FP8_MAX, as float32 (a bound of 0, a channel
    that is always 0, gets the scale of the smallest positive bound's range, never 0)."""
    wanted = (bounds.double() * MARGIN / FP8_MAX).clamp(min=2.0**-100)
    return torch.exp2(torch.ceil(torch.log2(wanted))).float()


def scale_digest(scales: torch.Tensor) -> str:
    """A short name for a rank's scales: equal scales, equal digest (KVLayout.scale_digest)."""
    data = scales.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., H, D] / scale [H, D] -> float8_e4m3fn, rounded to nearest even; clamped, since e4m3fn has no
    infinity (an overflow would read back as NaN)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_kv(x8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x8 [..., H, D] float8_e4m3fn * scale [H, D] -> `dtype` (exact for float32; 16-bit rounds once)."""
    return (x8.float() * scale).to(dtype)
