"""A weight-streaming matmul for a few rows (decode at small batch): out[M, N] = x[M, K] @ weight[N, K]^T.

At M <= 16 a linear layer is a read of its weight matrix; the work is to stream those bytes at the HBM rate.
Each program owns BLOCK_N output columns and walks all of K for them, so every weight byte is read once, by
one program, in long contiguous rows (weight is [N, K] row-major, the nn.Linear layout):

    program n:  acc[BLOCK_M, BLOCK_N] += x[:, k:k+BK] @ weight[n*BN:(n+1)*BN, k:k+BK]^T   for k in 0..K step BK

x is padded to BLOCK_M = 16 rows by masking (tl.dot's smallest tile); the extra FLOPs are free next to the
bytes. No split-K, so no atomics and no second pass: N / BLOCK_N programs must fill the GPU, which holds for
the Llama projections (N >= 4096 -> 128+ programs of 32 columns).

`skinny_matmul_fp8` is the same walk over an FP8 projection (quantization.fp8.FP8Linear: e4m3 weight [N, K], a
float32 scale per row) for activations already quantized per token (codes [M, K] e4m3, scales [M, 1]), which is
what the fused norms and SiLU write for it: one byte a weight, so half of bf16's bytes. The dot runs on the
e4m3 codes themselves (float32 sums; a product of two e4m3 values is exact), the weight tile as its left operand
so that Hopper's e4m3 wgmma takes it without padding, and each output is scaled by its row's and column's
scales: the arithmetic of torch._scaled_mm with float32 promotion, summed in another order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model_runtime.fused.e4m3 import converts_e4m3

MAX_ROWS = 16


@triton.jit
def _load_tile(ptr, rows, ks, stride, num_rows, K):
    """Rows `rows` and columns `ks` of a row-major [num_rows, K] matrix, zeros outside it."""
    mask = (rows[:, None] < num_rows) & (ks[None, :] < K)
    return tl.load(ptr + rows[:, None] * stride + ks[None, :], mask=mask, other=0.0)


def _autotuned(
    kernel: triton.JITFunction, configs: list[tuple[int, int, int, int]]
) -> triton.runtime.Autotuner:
    """`kernel` tuned per (N, K) over (BLOCK_N, BLOCK_K, num_warps, num_stages) on first use (the engine's
    warm-up before CUDA-graph capture); the CPU interpreter, which cannot time kernels, runs the plain kernel."""
    return triton.autotune(
        configs=[
            triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=stages)
            for bn, bk, w, stages in configs
        ],
        key=["N", "K"],
    )(kernel)


# M (rows, 1-16) changes with the step's batch and sampled rows; only masks read it. Specialized, a single row
# or sixteen would each be another variant to build in the middle of a run (model_runtime.kernel_builds).
@triton.jit(do_not_specialize=["M"])
def _skinny_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EXACT: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = tl.arange(0, 16)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = _load_tile(x_ptr, rows, ks, stride_xm, M, K)
        w = _load_tile(w_ptr, cols, ks, stride_wn, N, K)
        if EXACT:  # float32 inputs: full-precision products, not TF32 (fp32 engines must match the CPU)
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


_TUNED = _autotuned(
    _skinny_kernel,
    [(16, 256, 4, 4), (32, 128, 4, 4), (32, 256, 4, 3), (32, 256, 8, 4), (64, 128, 4, 4), (64, 256, 8, 3)],
)


def skinny_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] (M <= 16) @ weight [N, K]^T -> [M, N] in x's dtype, float32 accumulation."""
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS or weight.shape[1] != k or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(
            f"skinny_matmul: x [M<={MAX_ROWS}, K] and weight [N, K] with dense rows; got {tuple(x.shape)} "
            f"and {tuple(weight.shape)}"
        )
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)

    def grid(meta: dict) -> tuple[int]:
        return (triton.cdiv(n, meta["BLOCK_N"]),)

    args = (x, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0))
    exact = x.dtype == torch.float32
    if x.is_cuda:
        _TUNED[grid](*args, EXACT=exact)
    else:
        _skinny_kernel[(triton.cdiv(n, 32),)](*args, BLOCK_N=32, BLOCK_K=128, EXACT=exact)
    return out


@triton.jit(do_not_specialize=["M"])
def _skinny_fp8_kernel(
    x_ptr,
    x_scale_ptr,
    w_ptr,
    w_scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    E4M3_DOT: tl.constexpr,
):
    """Transposed: the weight tile is the dot's left operand ([BLOCK_N, BLOCK_K], BLOCK_N >= 64) and the 16 padded
    token rows its right one, so on Hopper the dot is one e4m3 wgmma (m64n16k32) per 64 weight rows, with no
    conversion and no padding of the weight side; the tokens' padding costs FLOPs only."""
    pid = tl.program_id(0)
    rows = tl.arange(0, 16)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = _load_tile(x_ptr, rows, ks, stride_xm, M, K)
        w = _load_tile(w_ptr, cols, ks, stride_wn, N, K)
        if E4M3_DOT:
            acc += tl.dot(w, tl.trans(x))
        else:  # the CPU interpreter: float16 holds every e4m3 value exactly
            acc += tl.dot(w.to(tl.float16), tl.trans(x.to(tl.float16)))
    x_scale = tl.load(x_scale_ptr + rows, mask=rows < M, other=0.0)
    w_scale = tl.load(w_scale_ptr + cols, mask=cols < N, other=0.0)
    out = acc * w_scale[:, None] * x_scale[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[:, None]
    mask = (cols[:, None] < N) & (rows[None, :] < M)
    tl.store(out_ptr + rows[None, :] * stride_om + cols[:, None], out.to(out_ptr.dtype.element_ty), mask=mask)


# One byte a weight; at least 64 weight rows a program (the e4m3 wgmma's M).
_TUNED_FP8 = _autotuned(
    _skinny_fp8_kernel,
    [(64, 128, 4, 4), (64, 256, 4, 3), (64, 256, 4, 5), (64, 512, 4, 3), (128, 128, 4, 4), (128, 256, 4, 3),
     (128, 256, 8, 3)],
)  # fmt: skip


def skinny_matmul_fp8(
    codes: torch.Tensor,
    scales: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """codes [M, K] e4m3 (M <= 16) with scales [M, 1] float32, @ weight [N, K] e4m3 with weight_scale [N]
    float32, transposed (+ bias [N]) -> [M, N] in out_dtype."""
    m, k = codes.shape
    n = weight.shape[0]
    if (
        m > MAX_ROWS
        or weight.shape[1] != k
        or codes.stride(1) != 1
        or weight.stride(1) != 1
        or scales.shape != (m, 1)
        or weight_scale.shape != (n,)
        or not (scales.is_contiguous() and weight_scale.is_contiguous())
    ):
        raise ValueError(
            f"skinny_matmul_fp8: codes [M<={MAX_ROWS}, K] with scales [M, 1], weight [N, K] with weight_scale "
            f"[N], dense rows; got codes {tuple(codes.shape)}, scales {tuple(scales.shape)}, weight "
            f"{tuple(weight.shape)}, weight_scale {tuple(weight_scale.shape)}"
        )
    out = torch.empty((m, n), dtype=out_dtype, device=codes.device)
    if m == 0:
        return out

    def grid(meta: dict) -> tuple[int]:
        return (triton.cdiv(n, meta["BLOCK_N"]),)

    args = (codes, scales, weight, weight_scale, out if bias is None else bias, out, m, n, k,
            codes.stride(0), weight.stride(0), out.stride(0))  # fmt: skip
    if codes.is_cuda:
        _TUNED_FP8[grid](*args, HAS_BIAS=bias is not None, E4M3_DOT=converts_e4m3(codes.device))
    else:
        _skinny_fp8_kernel[(triton.cdiv(n, 64),)](
            *args, BLOCK_N=64, BLOCK_K=128, HAS_BIAS=bias is not None, E4M3_DOT=False
        )
    return out
