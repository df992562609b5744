"""FP8 matmul with a scale per 64 input channels on both sides: the GPU path of `quantization: fp8_group`.

    out[t, n] = sum over groups g of  (sum_{k in g} xq[t, k] * wq[n, k]) * sx[t, g] * sw[n, g]   (+ bias[n])

xq / sx: the activations quantized per (token, group of GROUP channels) by `quantize_groups`; wq / sw: the
weight quantized per (output row, group) at load (fp8.quantize_fp8_groups). Why groups: one scale per token
and per output row lets a single large activation or weight coarsen the rounding of a whole 576- to
14336-wide row. With a scale per 64 channels on both sides, SmolLM2's perplexity on the tests' longer text
moves +0.86% from float32 (tests/model/test_fp8_weights.py) where per-row scales move it +3.7%: the issue's
1% is met this way. torch._scaled_mm takes one scale per row or per tensor only, hence this kernel.

The GEMM: one program per [BLOCK_M, BLOCK_N] output tile; each K step is one group (BLOCK_K = GROUP), an e4m3
tl.dot accumulated in float32 and multiplied by the group's scales before it is added (so every 64 products
are summed at full precision before any scaling, as DeepSeek-V3's blockwise FP8 GEMM promotes partial sums).
Shapes are static and nothing syncs with the host: a decode CUDA graph captures both kernels.

Status: the arithmetic is tested under Triton's CPU interpreter against torch (tests/unit/test_fp8_group.py) and
on an H200 (tests/gpu/test_fp8_weights_gpu.py). Speed on an H200: 2.4-4x slower than the bf16 matmul it replaces
(bench/fp8_matmul.py, bench/group_gemm_tiles.py): each group's partial product is scaled and added in registers,
so the loop waits on every dot. fp8_group is the quality option (docs/performance.md), not a fast one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model_runtime.quantization.fp8 import GROUP  # input channels per scale, activations and weights alike
from model_runtime.weights.canonical import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE

_QUANT_BLOCK = 1024  # elements of a row per quantization program: 16 groups


@triton.jit
def _quantize_groups_kernel(
    x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, stride_s,
    MAX: tl.constexpr, MIN_SCALE: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    groups: tl.constexpr = BLOCK // GROUP
    g = chunk * groups + tl.arange(0, groups)
    k = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    ok = k < K
    x = tl.load(x_ptr + row * stride_x + k, mask=ok, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 1) / MAX, MIN_SCALE)
    tl.store(s_ptr + row * stride_s + g, scale, mask=g * GROUP < K)
    q = tl.clamp(tl.math.div_rn(x, scale[:, None]), -MAX, MAX)
    tl.store(q_ptr + row * stride_q + k, q.to(q_ptr.dtype.element_ty), mask=ok)


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (last dim contiguous) -> (codes [T, K] float8_e4m3fn, scales [T, ceil(K / GROUP)] float32):
    each group's largest |x| onto 448, IEEE division, round to nearest even (fp8.quantize_groups_torch's
    numbers, in one kernel)."""
    if x.stride(-1) != 1:
        raise ValueError(f"quantize_groups: x's last dimension must be contiguous, got strides {x.stride()}")
    tokens, k = x.shape
    codes = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(tokens, triton.cdiv(k, GROUP), dtype=torch.float32, device=x.device)
    if tokens:
        _quantize_groups_kernel[(tokens, triton.cdiv(k, _QUANT_BLOCK))](
            x, codes, scales, k, x.stride(0), codes.stride(0), scales.stride(0),
            MAX=FP8_MAX, MIN_SCALE=FP8_MIN_SCALE, GROUP=GROUP, BLOCK=_QUANT_BLOCK, num_warps=4,
        )  # fmt: skip
    return codes, scales


@triton.jit(do_not_specialize=["M"])  # the step's token count: masks only, not one variant per 1 / 16k tokens
def _group_mm_kernel(
    a_ptr, sa_ptr, w_ptr, sw_ptr, bias_ptr, c_ptr, M, N, K,
    stride_am, stride_sam, stride_wn, stride_swn, stride_cm,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, GROUP)
    m_ok = rm < M
    n_ok = rn < N
    a_rows = a_ptr + rm.to(tl.int64)[:, None] * stride_am
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for g in range(0, tl.cdiv(K, GROUP)):
        k = g * GROUP + rk
        k_ok = k < K
        a = tl.load(a_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        sa = tl.load(sa_ptr + rm * stride_sam + g, mask=m_ok, other=0.0)
        sw = tl.load(sw_ptr + rn * stride_swn + g, mask=n_ok, other=0.0)
        acc += tl.dot(a, tl.trans(w)) * (sa[:, None] * sw[None, :])
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    c = c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _tiles(m: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for m rows: small tiles for decode batches (the weight streams
    once per 16-64 tokens), 64 x 128 with 4 stages above. On an H200 that was the fastest of five tilings at
    300, 2048 and 8192 tokens for gate_up and down, 1.2-1.45x the 128 x 128 / 8 warps / 3 stages it replaced,
    and a weight stored [K, N] did not help (bench/group_gemm_tiles.py,
    bench/results/fp8/group_gemm_tiles_run15.json)."""
    if m <= 16:
        return 16, 64, 4, 3
    if m <= 64:
        return 64, 64, 4, 3
    return 64, 128, 4, 4


def group_matmul(
    x_codes: torch.Tensor,
    x_scales: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """x_codes [T, K] e4m3 with x_scales [T, G], weight [N, K] e4m3 with weight_scale [N, G] (G = ceil(K /
    GROUP)) -> [T, N] in out_dtype, + bias [N] when given."""
    tokens, k = x_codes.shape
    n = weight.shape[0]
    groups = triton.cdiv(k, GROUP)
    if weight.shape[1] != k or x_scales.shape != (tokens, groups) or weight_scale.shape != (n, groups):
        raise ValueError(
            f"group_matmul: x {tuple(x_codes.shape)} / scales {tuple(x_scales.shape)}, weight "
            f"{tuple(weight.shape)} / scales {tuple(weight_scale.shape)} do not agree (groups of {GROUP})"
        )
    out = torch.empty(tokens, n, dtype=out_dtype, device=x_codes.device)
    if tokens == 0:
        return out
    block_m, block_n, warps, stages = _tiles(tokens)
    grid = (triton.cdiv(tokens, block_m), triton.cdiv(n, block_n))
    _group_mm_kernel[grid](
        x_codes, x_scales, weight, weight_scale, bias if bias is not None else out, out, tokens, n, k,
        x_codes.stride(0), x_scales.stride(0), weight.stride(0), weight_scale.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, GROUP=GROUP,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out
