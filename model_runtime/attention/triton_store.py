"""Triton scatter of new K/V rows into the paged cache by slot.

One program per token row: it copies the row's [Hkv, D] keys and values to `cache.view(N * B, Hkv, D)[slot]`.
A slot of -1 marks a padding row (CUDA-graph padding, unused tail of a bucket): the program masks every load
and store off instead of branching, so the grid is the static token count and nothing syncs with the host.
An FP8 cache (QUANTIZED) stores each value divided by its channel's scale ([Hkv, D] per K and V, powers of two:
model_runtime.kv_quant), clamped to e4m3's range and rounded to nearest even.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX: tl.constexpr = tl.constexpr(448.0)  # e4m3fn's largest finite value


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ks,
    stride_kch,
    stride_vs,
    stride_vch,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < NUM_HEADS) & (d[None, :] < HEAD_DIM) & (slot >= 0)
    k = tl.load(k_ptr + row * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + row * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    if QUANTIZED:
        channel = h[:, None] * HEAD_DIM + d[None, :]
        channel_ok = (h[:, None] < NUM_HEADS) & (d[None, :] < HEAD_DIM)
        k_scale = tl.load(k_scale_ptr + channel, mask=channel_ok, other=1.0)
        v_scale = tl.load(v_scale_ptr + channel, mask=channel_ok, other=1.0)
        k = tl.clamp(k.to(tl.float32) / k_scale, -FP8_MAX, FP8_MAX)
        v = tl.clamp(v.to(tl.float32) / v_scale, -FP8_MAX, FP8_MAX)
    tl.store(
        k_cache_ptr + slot * stride_ks + h[:, None] * stride_kch + d[None, :],
        k.to(k_cache_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
        mask=mask,
    )
    tl.store(
        v_cache_ptr + slot * stride_vs + h[:, None] * stride_vch + d[None, :],
        v.to(v_cache_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
        mask=mask,
    )


def _slot_view(cache: torch.Tensor, name: str) -> torch.Tensor:
    """[N, B, H, D] pages as [N * B, H, D] slots; the pages must be laid out back to back."""
    if cache.dim() != 4:
        raise ValueError(
            f"store_kv_triton: {name} must be [num_blocks, block_size, kv_heads, head_dim], "
            f"got shape {tuple(cache.shape)}"
        )
    n, b, h, d = cache.shape
    if cache.stride(3) != 1 or cache.stride(0) != b * cache.stride(1):
        raise ValueError(
            f"store_kv_triton: {name} pages are not flattenable to slots (strides {cache.stride()})"
        )
    return cache.view(n * b, h, d)


def store_kv_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """Write k[t], v[t] ([T, Hkv, D]) to slot slot_mapping[t] of k_cache/v_cache; slot -1 rows are skipped.
    `kv_scale` [2, Hkv, D] float32 (contiguous): an FP8 cache's K and V scales."""
    kc, vc = _slot_view(k_cache, "k_cache"), _slot_view(v_cache, "v_cache")
    if k.shape != v.shape or k.dim() != 3 or k.shape[1:] != kc.shape[1:]:
        raise ValueError(
            f"store_kv_triton: k {tuple(k.shape)} / v {tuple(v.shape)} must be [T, "
            f"{kc.shape[1]}, {kc.shape[2]}] to match the cache"
        )
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(
            f"store_kv_triton: slot_mapping shape {tuple(slot_mapping.shape)} != ({k.shape[0]},)"
        )
    if k.shape[0] == 0:
        return
    # Rows may be strided views of a fused qkv output; only the head_dim axis has to be dense.
    k = k if k.stride(2) == 1 else k.contiguous()
    v = v if v.stride(2) == 1 else v.contiguous()
    num_heads, head_dim = kc.shape[1], kc.shape[2]
    if (kv_scale is not None) != (kc.dtype == torch.float8_e4m3fn):
        raise ValueError(
            f"store_kv_triton: a {kc.dtype} cache {'needs' if kv_scale is None else 'takes no'} kv_scale"
        )
    if kv_scale is not None and (kv_scale.shape != (2, num_heads, head_dim) or not kv_scale.is_contiguous()):
        raise ValueError(f"store_kv_triton: kv_scale must be contiguous [2, {num_heads}, {head_dim}]")
    scales = kv_scale if kv_scale is not None else slot_mapping  # unread when not QUANTIZED
    _store_kv_kernel[(k.shape[0],)](
        k,
        v,
        kc,
        vc,
        slot_mapping,
        scales[0] if kv_scale is not None else scales,
        scales[1] if kv_scale is not None else scales,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kc.stride(0),
        kc.stride(1),
        vc.stride(0),
        vc.stride(1),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        QUANTIZED=kv_scale is not None,
    )
