"""TritonOps: the fused-ops contract as three Triton kernels (CUDA; CPU under TRITON_INTERPRET=1 for tests).

    add_rms_norm  one program per row: x + residual -> residual (in place), RMSNorm -> out   (1 launch, was ~7)
    rotary        one program per token: q and k heads rotated in place, cos/sin read once  (1 launch, was ~20)
    silu_mul      programs over (row, column block): silu(gate) * up                          (1 launch, was 2)

Every kernel computes in float32 and rounds where the torch reference rounds (see fused/base.py), so bf16
results match TorchOps except for float32 summation order in the norm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from model_runtime.fused.base import FusedOps
from model_runtime.fused.fp8_rows import QuantizedRows
from model_runtime.fused.skinny_matmul import MAX_ROWS, skinny_matmul
from model_runtime.weights.canonical import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE

SILU_BLOCK = 1024
# e4m3's largest finite value and the smallest per-token scale, as constexprs the kernels can read
_FP8_MAX: tl.constexpr = tl.constexpr(FP8_MAX)
_FP8_MIN_SCALE: tl.constexpr = tl.constexpr(FP8_MIN_SCALE)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    scale_ptr,
    stride_x,
    stride_r,
    stride_o,
    size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    FP8: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < size
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        total = (x + r).to(res_ptr.dtype.element_ty)  # rounded like the reference's add
        tl.store(res_ptr + row * stride_r + cols, total, mask=mask)
        x = total.to(tl.float32)
    mean_sq = tl.sum(x * x, axis=0) / size
    normed = (x * tl.rsqrt(mean_sq + eps)).to(x_ptr.dtype.element_ty).to(tl.float32)  # the activation dtype
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if FP8:  # the row rounded to the activation dtype, then quantized per token (fused/fp8_rows.py)
        y = (normed * w).to(x_ptr.dtype.element_ty).to(tl.float32)
        _store_fp8_row(y, out_ptr + row * stride_o, scale_ptr + row, cols, mask)
    else:
        tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_fp8_row(y, codes_ptr, scale_ptr, cols, mask):
    """A whole row y (float32) as e4m3 codes under its own scale: max|y| / 448 (at least _FP8_MIN_SCALE), then
    y times the scale's reciprocal (an IEEE division, once a row), rounded to nearest even. act_quant's
    arithmetic, which gives torch's bytes on a GPU (torch divides by the scalar 448 as a multiplication by its
    reciprocal, as this `/` compiles; fused/fp8_rows.py says why a multiply per element, not a division)."""
    scale = tl.maximum(tl.max(tl.abs(y), axis=0) / _FP8_MAX, _FP8_MIN_SCALE)
    tl.store(scale_ptr, scale)
    codes = tl.clamp(y * tl.math.div_rn(1.0, scale), -_FP8_MAX, _FP8_MAX)
    tl.store(codes_ptr + cols, codes.to(codes_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_heads(
    base, c, s, heads, stride_h, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr
):
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < heads) & (d[None, :] < HALF)
    first = base + h[:, None] * stride_h + d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * c[None, :] - x2 * s[None, :]
    out2 = x2 * c[None, :] + x1 * s[None, :]
    tl.store(first, out1.to(base.dtype.element_ty), mask=mask)
    tl.store(first + HALF, out2.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    stride_sin,
    num_q_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    c = tl.load(cos_ptr + pos * stride_cos + d, mask=d < HALF, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_sin + d, mask=d < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + row * stride_qt, c, s, num_q_heads, stride_qh, HALF, BLOCK_HQ, BLOCK_D)
    _rotate_heads(k_ptr + row * stride_kt, c, s, num_kv_heads, stride_kh, HALF, BLOCK_HKV, BLOCK_D)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, size, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + size + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded like F.silu
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def launch_silu_mul_fp8(gate_up: torch.Tensor, rows: QuantizedRows, num_warps: int | None = None) -> None:
    """silu(gate) * up of gate_up [T, 2I] into rows' codes [T, I] and scales [T, 1], the whole row in one
    program's registers. num_warps None: 16 for Llama-3-8B's 14336 (bench/fused_rows.py: the fastest of 4-32
    warps, and faster than two passes over column chunks re-read from L2, at every row count measured)."""
    t, size = gate_up.shape[0], gate_up.shape[1] // 2
    block = triton.next_power_of_2(size)  # 14336 -> 16384: 32 values of gate and of up per thread
    _silu_mul_fp8_kernel[(t,)](
        gate_up, rows.codes, rows.scales, gate_up.stride(0), rows.codes.stride(0), size,
        BLOCK=block, num_warps=num_warps or min(16, max(4, block // 1024)),
    )  # fmt: skip


@triton.jit
def _silu_mul_fp8_kernel(x_ptr, codes_ptr, scale_ptr, stride_x, stride_c, size, BLOCK: tl.constexpr):
    """One program per row, the whole row in registers (BLOCK >= size): silu(gate) * up rounded as
    _silu_mul_kernel rounds it, its largest magnitude, then the codes; one read of gate and up, one write."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < size
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + size + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
    y = (act * up).to(x_ptr.dtype.element_ty).to(tl.float32)
    _store_fp8_row(y, codes_ptr + row * stride_c, scale_ptr + row, cols, mask)


def _norm_warps(block: int) -> int:
    return min(16, max(1, block // 256))


def _check_rows(name: str, x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(1) != 1 or weight.shape != (x.shape[1],):
        raise ValueError(
            f"TritonOps.{name}: x must be [T, H] with dense rows and weight [H]; got x {tuple(x.shape)} "
            f"(strides {x.stride()}), weight {tuple(weight.shape)}"
        )
    if weight.dtype != x.dtype:
        raise ValueError(f"TritonOps.{name}: weight dtype {weight.dtype} != activation dtype {x.dtype}")


def _check_residual(x: torch.Tensor, residual: torch.Tensor) -> None:
    if residual.shape != x.shape or residual.stride(1) != 1 or residual.dtype != x.dtype:
        raise ValueError(
            f"TritonOps.add_rms_norm: residual {tuple(residual.shape)} {residual.dtype} must match "
            f"x {tuple(x.shape)} {x.dtype} with dense rows"
        )


def _fp8_rows(x: torch.Tensor) -> QuantizedRows:
    """Empty codes [T, K] and scales [T, 1] for x [T, K]."""
    return QuantizedRows(
        torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device),
        torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device),
    )


class TritonOps(FusedOps):
    """`small_m_matmul`: projections of at most 16 rows (decode at small batch) through the weight-streaming
    kernel (fused/skinny_matmul.py) instead of cuBLAS; larger ones always go to cuBLAS."""

    name = "triton"

    def __init__(self, small_m_matmul: bool = True) -> None:
        self.small_m_matmul = small_m_matmul
        if not small_m_matmul:
            self.name = "triton:cublas"

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not self.small_m_matmul or x.shape[0] > MAX_ROWS or x.shape[0] == 0 or x.stride(-1) != 1:
            return F.linear(x, weight, bias)
        out = skinny_matmul(x, weight)
        return out if bias is None else out + bias

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        _check_rows("rms_norm", x, weight)
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        if x.shape[0] == 0:
            return out
        block = triton.next_power_of_2(x.shape[1])
        _rms_norm_kernel[(x.shape[0],)](
            x, x, weight, out, out, x.stride(0), x.stride(0), out.stride(0), x.shape[1], eps,
            HAS_RESIDUAL=False, BLOCK=block, FP8=False, num_warps=_norm_warps(block),
        )  # fmt: skip
        return out

    def rms_norm_fp8(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> QuantizedRows:
        _check_rows("rms_norm_fp8", x, weight)
        rows = _fp8_rows(x)
        if x.shape[0]:
            block = triton.next_power_of_2(x.shape[1])
            _rms_norm_kernel[(x.shape[0],)](
                x, x, weight, rows.codes, rows.scales, x.stride(0), x.stride(0), rows.codes.stride(0),
                x.shape[1], eps, HAS_RESIDUAL=False, BLOCK=block, FP8=True, num_warps=_norm_warps(block),
            )  # fmt: skip
        return rows

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        _check_rows("add_rms_norm", x, weight)
        _check_residual(x, residual)
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        if x.shape[0] == 0:
            return out, residual
        block = triton.next_power_of_2(x.shape[1])
        _rms_norm_kernel[(x.shape[0],)](
            x, residual, weight, out, out, x.stride(0), residual.stride(0), out.stride(0), x.shape[1], eps,
            HAS_RESIDUAL=True, BLOCK=block, FP8=False, num_warps=_norm_warps(block),
        )  # fmt: skip
        return out, residual

    def add_rms_norm_fp8(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[QuantizedRows, torch.Tensor]:
        _check_rows("add_rms_norm_fp8", x, weight)
        _check_residual(x, residual)
        rows = _fp8_rows(x)
        if x.shape[0]:
            block = triton.next_power_of_2(x.shape[1])
            _rms_norm_kernel[(x.shape[0],)](
                x, residual, weight, rows.codes, rows.scales, x.stride(0), residual.stride(0),
                rows.codes.stride(0), x.shape[1], eps,
                HAS_RESIDUAL=True, BLOCK=block, FP8=True, num_warps=_norm_warps(block),
            )  # fmt: skip
        return rows, residual

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        head_dim = q.shape[-1]
        if q.dim() != 3 or k.dim() != 3 or q.stride(2) != 1 or k.stride(2) != 1 or k.shape[-1] != head_dim:
            raise ValueError(
                f"TritonOps.rotary: q, k must be [T, heads, D] with a dense last axis; got "
                f"{tuple(q.shape)} / {tuple(k.shape)}"
            )
        if cos.shape[-1] * 2 != head_dim or cos.stride(-1) != 1 or sin.stride(-1) != 1:
            raise ValueError(
                f"TritonOps.rotary: tables [P, {head_dim // 2}] expected, got {tuple(cos.shape)}"
            )
        if q.shape[0] == 0:
            return q, k
        half = head_dim // 2
        _rotary_kernel[(q.shape[0],)](
            q, k, positions, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            cos.stride(0), sin.stride(0), q.shape[1], k.shape[1],
            HALF=half, BLOCK_HQ=triton.next_power_of_2(q.shape[1]),
            BLOCK_HKV=triton.next_power_of_2(k.shape[1]), BLOCK_D=triton.next_power_of_2(half),
        )  # fmt: skip
        return q, k

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dim() != 2 or gate_up.stride(1) != 1 or gate_up.shape[1] % 2:
            raise ValueError(
                f"TritonOps.silu_mul: gate_up must be [T, 2I], dense rows; got {tuple(gate_up.shape)}"
            )
        t, size = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((t, size), dtype=gate_up.dtype, device=gate_up.device)
        if t == 0:
            return out
        grid = (t, triton.cdiv(size, SILU_BLOCK))
        _silu_mul_kernel[grid](gate_up, out, gate_up.stride(0), out.stride(0), size, BLOCK=SILU_BLOCK)
        return out

    def silu_mul_fp8(self, gate_up: torch.Tensor) -> QuantizedRows:
        if gate_up.dim() != 2 or gate_up.stride(1) != 1 or gate_up.shape[1] % 2:
            raise ValueError(
                f"TritonOps.silu_mul_fp8: gate_up must be [T, 2I], dense rows; got {tuple(gate_up.shape)}"
            )
        t, size = gate_up.shape[0], gate_up.shape[1] // 2
        rows = QuantizedRows(
            torch.empty((t, size), dtype=FP8_DTYPE, device=gate_up.device),
            torch.empty(t, 1, dtype=torch.float32, device=gate_up.device),
        )
        if t:
            launch_silu_mul_fp8(gate_up, rows)
        return rows
