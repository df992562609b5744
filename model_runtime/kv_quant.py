"""The FP8 KV cache (cache.dtype fp8_e4m3): what a stored byte means, and where its scale lives.

Each new key or value row of one token and one KV head (D values) is stored as D e4m3 codes and one scale:

    scale  = bf16(max |row| / 448)        (448: e4m3's largest value; an all-zero row gets FP8_MIN_SCALE)
    code   = e4m3(row / scale)            rounded to nearest even, clamped to +-448
    read   = code * scale

so each row's largest value is stored almost exactly (bfloat16's rounding of the scale moves it by at most
2^-9, and a code past 448 clamps by as little) and the others keep e4m3's 3 mantissa bits. Attention scores are
dominated by a few large channels, which is why this matters: on SmolLM2-135M, static per-channel
power-of-two scales (the previous scheme) cost 1.5% of perplexity on tests/model/test_fp8_weights.TEXT and a
scale per token and head 0.05% (bench/diag/fp8_kv_scale_schemes.py).

The scales sit inside the cache's blocks (KVLayout: a block is its codes [B, H, D], then its scales [H, B],
padded to 16 bytes), so whatever moves blocks moves them, and the bytes need nothing from the weights or the
worker to be read: two workers with equal format fields decode a block alike. `split_fp8_cache` gives the two
views the kernels use: codes [..., B, H, D] (float8_e4m3fn) and scales [..., B, H] (bfloat16, a head's B scales
adjacent) over the same memory. A first version kept each token's scales at the end of its own row; the decode
kernel then read one 32-byte sector per token for 2 bytes, and ran 10-20% slower at large batches on an H100
(bench/results/fp8/attention_fp8_h100_run4_token_rows.json). In the kernels a key's scale multiplies its score
(q . (k8 * s) = (q . k8) * s) and a value's scale its probability (p * (v8 * s) = (p * s) * v8), one multiply
per token rather than per element.
"""

from __future__ import annotations

import torch

from model_runtime.kv_layout import FP8_KV_DTYPE, block_layer_bytes
from model_runtime.weights.canonical import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE

CACHE_DTYPE_NAMES = {"fp8_e4m3": FP8_KV_DTYPE}  # cache.dtype -> KVLayout.dtype (others are the same name)
SCALE_DTYPE = torch.bfloat16


def layout_dtype(cache_dtype: str | None, model_dtype: str) -> str:
    """KVLayout.dtype for `cache.dtype` (None: the model's)."""
    if cache_dtype is None:
        return model_dtype
    return CACHE_DTYPE_NAMES.get(cache_dtype, cache_dtype)


def split_fp8_cache(
    storage: torch.Tensor, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of FP8 cache storage [..., block_bytes] (float8_e4m3fn or uint8, blocks as KVLayout lays them out):
    codes [..., B, H, D] float8_e4m3fn and scales [..., B, H] bfloat16, over the same memory."""
    if storage.element_size() != 1 or storage.stride(-1) != 1:
        raise ValueError(
            f"split_fp8_cache: storage must be a byte tensor with dense blocks, got {storage.dtype} "
            f"strides {storage.stride()}"
        )
    codes_end = block_size * num_kv_heads * head_dim
    scales_end = codes_end + 2 * num_kv_heads * block_size
    if storage.shape[-1] < scales_end or storage.shape[-1] % 2 or codes_end % 2:
        raise ValueError(
            f"split_fp8_cache: blocks of {storage.shape[-1]} bytes cannot hold {block_size} tokens of "
            f"{num_kv_heads} heads of {head_dim} codes and their scales"
        )
    raw = storage.view(torch.uint8)
    codes = raw[..., :codes_end].view(FP8_DTYPE).unflatten(-1, (block_size, num_kv_heads, head_dim))
    head_major = raw.view(SCALE_DTYPE)[..., codes_end // 2 : scales_end // 2].unflatten(
        -1, (num_kv_heads, block_size)
    )
    return codes, head_major.transpose(-1, -2)


def row_scales(x: torch.Tensor) -> torch.Tensor:
    """x [..., H, D] -> [..., H] float32 scales, each the bfloat16 nearest max |row| / 448 (never below
    FP8_MIN_SCALE, so an all-zero row divides by something)."""
    amax = x.float().abs().amax(dim=-1)
    return (amax / FP8_MAX).clamp(min=FP8_MIN_SCALE).to(SCALE_DTYPE).float()


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., H, D] -> (codes [..., H, D] float8_e4m3fn, scales [..., H] bfloat16); codes are rounded to nearest
    even and clamped, since e4m3fn has no infinity (an overflow would read back as NaN)."""
    scale = row_scales(x)
    codes = (x.float() / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, scale.to(SCALE_DTYPE)


def dequantize_kv(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes [..., H, D] float8_e4m3fn * scales [..., H] -> `dtype` (exact in float32; 16-bit rounds once)."""
    return (codes.float() * scales.float()[..., None]).to(dtype)


def fp8_pages(
    k_pages: torch.Tensor, v_pages: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Values [N, B, H, D] of K and V as an FP8 cache holds them: (K codes, V codes, scales [2, N, B, H]), views of
    one storage whose blocks are laid out as KVLayout's (for tests and benchmarks that build caches)."""
    n, b, h, d = k_pages.shape
    storage = torch.zeros((2, n, block_layer_bytes(b, h, d, 1, True)), dtype=FP8_DTYPE, device=k_pages.device)
    codes, scales = split_fp8_cache(storage, b, h, d)
    for i, pages in enumerate((k_pages, v_pages)):
        codes[i], scales[i] = quantize_kv(pages)
    return codes[0], codes[1], scales
