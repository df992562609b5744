"""A weight-streaming matmul for a few rows (decode at small batch): out[M, N] = x[M, K] @ weight[N, K]^T.

At M <= 16 a linear layer is a read of its weight matrix; the work is to stream those bytes at the HBM rate.
Each program owns BLOCK_N output columns and walks all of K for them, so every weight byte is read once, by
one program, in long contiguous rows (weight is [N, K] row-major, the nn.Linear layout):

    program n:  acc[BLOCK_M, BLOCK_N] += x[:, k:k+BK] @ weight[n*BN:(n+1)*BN, k:k+BK]^T   for k in 0..K step BK

x is padded to BLOCK_M = 16 rows by masking (tl.dot's smallest tile); the extra FLOPs are free next to the
bytes. No split-K, so no atomics and no second pass: N / BLOCK_N programs must fill the GPU, which holds for
the Llama projections (N >= 4096 -> 128+ programs of 32 columns).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 16


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
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + ks[None, :],
            mask=(rows[:, None] < M) & (ks[None, :] < K),
            other=0.0,
        )
        w = tl.load(
            w_ptr + cols[:, None] * stride_wn + ks[None, :],
            mask=(cols[:, None] < N) & (ks[None, :] < K),
            other=0.0,
        )
        if EXACT:  # float32 inputs: full-precision products, not TF32 (fp32 engines must match the CPU)
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


# Tuned per (N, K) on first use (the engine's warm-up before CUDA-graph capture); the CPU interpreter, which
# cannot time kernels, runs the plain kernel with one fixed config.
_TUNED = triton.autotune(
    configs=[
        triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
        for bn, bk, w, s in [
            (16, 256, 4, 4),
            (32, 128, 4, 4),
            (32, 256, 4, 3),
            (32, 256, 8, 4),
            (64, 128, 4, 4),
            (64, 256, 8, 3),
        ]
    ],
    key=["N", "K"],
)(_skinny_kernel)


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
