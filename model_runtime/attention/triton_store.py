"""Triton scatter of new K/V rows into the paged cache by slot.

One program per token row: it copies the row's [Hkv, D] keys and values to `cache.view(N * B, Hkv, D)[slot]`.
A slot of -1 marks a padding row (CUDA-graph padding, unused tail of a bucket): the program masks every load
and store off instead of branching, so the grid is the static token count and nothing syncs with the host.
An FP8 cache (QUANTIZED) stores each head's row as e4m3 codes and one bfloat16 scale (model_runtime.kv_quant):
scale = bf16(max |row| / 448), code = row / scale (IEEE division, div_rn, as torch's) clamped to e4m3's range
and rounded to nearest even, so the kernel writes the bytes the torch store writes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model_runtime.weights.canonical import FP8_MAX, FP8_MIN_SCALE


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
    stride_ss,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANTIZED: tl.constexpr,
    MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < NUM_HEADS) & (d[None, :] < HEAD_DIM) & (slot >= 0)
    k = tl.load(k_ptr + row * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask, other=0.0)
    v = tl.load(v_ptr + row * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask, other=0.0)
    if QUANTIZED:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        # Per head: the bfloat16 nearest max|row| / 448 (IEEE division, as torch's), never below MIN_SCALE.
        top = tl.full([BLOCK_H], MAX, tl.float32)
        k_scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(k), 1), top), MIN_SCALE)
        v_scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(v), 1), top), MIN_SCALE)
        k_scale = k_scale.to(tl.bfloat16, fp_downcast_rounding="rtne")
        v_scale = v_scale.to(tl.bfloat16, fp_downcast_rounding="rtne")
        head_ok = (h < NUM_HEADS) & (slot >= 0)
        tl.store(k_scale_ptr + slot * stride_ss + h, k_scale, mask=head_ok)
        tl.store(v_scale_ptr + slot * stride_ss + h, v_scale, mask=head_ok)
        k = tl.clamp(tl.math.div_rn(k, k_scale.to(tl.float32)[:, None]), -MAX, MAX)
        v = tl.clamp(tl.math.div_rn(v, v_scale.to(tl.float32)[:, None]), -MAX, MAX)
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
    `kv_scale` [2, N, B, Hkv] bfloat16: an FP8 cache's scale pages (kv_quant.split_fp8_cache), where each
    row's scale goes."""
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
    check_scale_pages(k_cache, kv_scale, "store_kv_triton")
    if kv_scale is not None:
        ks, vs = _scale_slots(kv_scale[0]), _scale_slots(kv_scale[1])
        stride_ss = ks.stride(0)
    else:
        ks = vs = slot_mapping  # unread when not QUANTIZED
        stride_ss = 0
    _store_kv_kernel[(k.shape[0],)](
        k,
        v,
        kc,
        vc,
        slot_mapping,
        ks,
        vs,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kc.stride(0),
        kc.stride(1),
        vc.stride(0),
        vc.stride(1),
        stride_ss,
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        QUANTIZED=kv_scale is not None,
        MAX=FP8_MAX,
        MIN_SCALE=FP8_MIN_SCALE,
    )


def _scale_slots(pages: torch.Tensor) -> torch.Tensor:
    """[N, B, H] scale pages as [N * B, H] slots (heads dense)."""
    n, b, h = pages.shape
    if pages.stride(2) != 1 or pages.stride(0) != b * pages.stride(1):
        raise ValueError(
            f"store_kv_triton: scale pages are not flattenable to slots (strides {pages.stride()})"
        )
    return pages.view(n * b, h)


def check_scale_pages(k_cache: torch.Tensor, kv_scale: torch.Tensor | None, where: str) -> None:
    """An FP8 cache [N, B, H, D] needs its bfloat16 scale pages [2, N, B, H], heads dense; another takes none."""
    quantized = k_cache.dtype == torch.float8_e4m3fn
    if quantized != (kv_scale is not None):
        raise ValueError(f"{where}: a {k_cache.dtype} cache {'needs' if quantized else 'takes no'} kv_scale")
    if kv_scale is not None and (
        tuple(kv_scale.shape) != (2, *k_cache.shape[:3])
        or kv_scale.dtype != torch.bfloat16
        or kv_scale.stride(-1) != 1
    ):
        raise ValueError(
            f"{where}: kv_scale must be bfloat16 [2, {', '.join(map(str, k_cache.shape[:3]))}] with dense heads, "
            f"got {kv_scale.dtype} {tuple(kv_scale.shape)} strides {kv_scale.stride()}"
        )
