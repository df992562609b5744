"""Per-token FP8 quantization of activations, one Triton kernel: x [T, K] -> (codes [T, K] e4m3, scales [T, 1]).

    scale[t] = max(max_k |x[t, k]| / 448, tiny)        codes[t, k] = e4m3(clamp(x[t, k] * (1 / scale[t]), +-448))

The same arithmetic in torch ops (model_runtime.quantization.fp8.quantize_rows_torch) is five kernels (abs, amax, the division, clamp, the
cast) with float32 temporaries of the whole [T, K] activation between them; a decode step runs it before each
of a layer's four FP8 projections, so on an 8B model it added 640 small kernels to a step. The kernel is one
program per token that reads its row twice (the maximum, then the codes; the second read comes from L2) and
writes one byte per element and one scale. The row's reciprocal is an IEEE round-to-nearest division (div_rn),
as torch's `1.0 / scales`, each element is multiplied by it (fused/fp8_rows.py says why not a division per
element), and the cast rounds to nearest even, so its codes are torch's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model_runtime.weights.canonical import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE

_BLOCK = 1024  # elements of a row per iteration (4096-wide rows: four)


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    K,
    stride_x,
    stride_q,
    MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    amax = tl.zeros([BLOCK], tl.float32)
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, 0) / MAX, MIN_SCALE)
    tl.store(scale_ptr + row, scale)
    inverse = tl.math.div_rn(1.0, scale)
    q_row = q_ptr + row * stride_q
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
        q = tl.clamp(x * inverse, -MAX, MAX)
        tl.store(q_row + k, q.to(q_ptr.dtype.element_ty), mask=k < K)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (bfloat16/float16/float32, last dim contiguous) -> (codes [T, K] float8_e4m3fn, scales [T, 1]
    float32); one kernel, no host sync (CUDA graphs capture it)."""
    if x.stride(-1) != 1:
        raise ValueError(f"quantize_rows: x's last dimension must be contiguous, got strides {x.stride()}")
    codes = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
    if x.shape[0]:
        _quantize_rows_kernel[(x.shape[0],)](
            x, codes, scales, x.shape[1], x.stride(0), codes.stride(0),
            MAX=FP8_MAX, MIN_SCALE=FP8_MIN_SCALE, BLOCK=_BLOCK, num_warps=4,
        )  # fmt: skip
    return codes, scales
