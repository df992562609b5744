"""Triton scatter of new K/V rows into the paged cache by slot.

One program per token row: it copies the row's [Hkv, D] keys and values to `cache[slot // B, slot % B]`.
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
    stride_kn,
    stride_kb,
    stride_kch,
    stride_vn,
    stride_vb,
    stride_vch,
    stride_sn,
    stride_sb,
    stride_sh,
    PAGE: tl.constexpr,
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
    block = slot // PAGE
    offset = slot % PAGE
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
        scale_at = block * stride_sn + offset * stride_sb + h * stride_sh
        tl.store(k_scale_ptr + scale_at, k_scale, mask=head_ok)
        tl.store(v_scale_ptr + scale_at, v_scale, mask=head_ok)
        k = tl.clamp(tl.math.div_rn(k, k_scale.to(tl.float32)[:, None]), -MAX, MAX)
        v = tl.clamp(tl.math.div_rn(v, v_scale.to(tl.float32)[:, None]), -MAX, MAX)
    tl.store(
        k_cache_ptr + block * stride_kn + offset * stride_kb + h[:, None] * stride_kch + d[None, :],
        k.to(k_cache_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
        mask=mask,
    )
    tl.store(
        v_cache_ptr + block * stride_vn + offset * stride_vb + h[:, None] * stride_vch + d[None, :],
        v.to(v_cache_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
        mask=mask,
    )


def _check_pages(cache: torch.Tensor, name: str) -> None:
    if cache.dim() != 4 or cache.stride(3) != 1:
        raise ValueError(
            f"store_kv_triton: {name} must be [num_blocks, block_size, kv_heads, head_dim] with a dense head_dim, "
            f"got shape {tuple(cache.shape)} strides {cache.stride()}"
        )


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
    _check_pages(k_cache, "k_cache")
    _check_pages(v_cache, "v_cache")
    if k.shape != v.shape or k.dim() != 3 or k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"store_kv_triton: k {tuple(k.shape)} / v {tuple(v.shape)} must be [T, "
            f"{k_cache.shape[2]}, {k_cache.shape[3]}] to match the cache"
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
    num_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    check_scale_pages(k_cache, kv_scale, "store_kv_triton")
    if kv_scale is not None:
        ks, vs = kv_scale[0], kv_scale[1]
        scale_strides = (ks.stride(0), ks.stride(1), ks.stride(2))
    else:
        ks = vs = slot_mapping  # unread when not QUANTIZED
        scale_strides = (0, 0, 0)
    _store_kv_kernel[(k.shape[0],)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        ks,
        vs,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        *scale_strides,
        PAGE=k_cache.shape[1],
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        QUANTIZED=kv_scale is not None,
        MAX=FP8_MAX,
        MIN_SCALE=FP8_MIN_SCALE,
    )


def check_scale_pages(k_cache: torch.Tensor, kv_scale: torch.Tensor | None, where: str) -> None:
    """An FP8 cache [N, B, H, D] needs its bfloat16 scale pages [2, N, B, H]; another takes none."""
    quantized = k_cache.dtype == torch.float8_e4m3fn
    if quantized != (kv_scale is not None):
        raise ValueError(f"{where}: a {k_cache.dtype} cache {'needs' if quantized else 'takes no'} kv_scale")
    if kv_scale is not None and (
        tuple(kv_scale.shape) != (2, *k_cache.shape[:3]) or kv_scale.dtype != torch.bfloat16
    ):
        raise ValueError(
            f"{where}: kv_scale must be bfloat16 [2, {', '.join(map(str, k_cache.shape[:3]))}], "
            f"got {kv_scale.dtype} {tuple(kv_scale.shape)}"
        )
