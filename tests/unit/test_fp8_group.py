"""quantization: fp8_group: a scale per (row, 64 input channels) for weights and per (token, 64 channels) for
activations. The torch quantizers against their definition, and the Triton kernels (group_gemm's activation
quantizer and GEMM) against torch through Triton's CPU interpreter, in a child process (TRITON_INTERPRET must
be set before triton is imported).

The interpreter's float32 -> e4m3 conversion drops the carry when rounding crosses a power of two, so the
quantizer case uses values whose codes are exact (each group a power-of-two scale times e4m3 values, with 448
in it); the GEMM case takes codes made by torch, so its inputs are exact by construction."""

from __future__ import annotations

import pytest
import torch

from model_runtime.quantization.fp8 import (
    GROUP,
    dequantize_fp8,
    quantize_fp8_groups,
    quantize_groups_torch,
)
from model_runtime.weights.canonical import FP8_MAX
from tests.unit.interpreter import run_child


@pytest.mark.parametrize("k", [128, 100, 64 * 9])
def test_each_group_has_its_own_scale_and_its_largest_weight_maps_onto_448(k: int) -> None:
    torch.manual_seed(0)
    weight = torch.randn(24, k) * torch.logspace(-3, 1, k)  # channels of very different sizes
    q, scale = quantize_fp8_groups(weight)
    groups = -(-k // GROUP)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (24, groups)
    for g in range(groups):
        cols = slice(g * GROUP, min(k, (g + 1) * GROUP))
        torch.testing.assert_close(scale[:, g], weight[:, cols].abs().amax(dim=1) / FP8_MAX)
        assert torch.equal(q[:, cols].float().abs().amax(dim=1), torch.full((24,), FP8_MAX))
    back = dequantize_fp8(q, scale, torch.float32)
    # e4m3 keeps 3 mantissa bits: within 1/16 of each value, or of the group's smallest normal step
    bound = weight.abs() / 16 + scale.repeat_interleave(GROUP, dim=1)[:, :k] * 2**-6
    assert bool(((back - weight).abs() <= bound).all())
    # a per-row scale would have flushed the small channels of each row: the groups keep them
    small = slice(0, GROUP)
    rel = (back[:, small] - weight[:, small]).norm() / weight[:, small].norm()
    assert rel < 0.05, rel


def test_activation_groups_match_the_weight_groups_arithmetic() -> None:
    torch.manual_seed(1)
    x = torch.randn(5, 200)
    codes, scales = quantize_groups_torch(x)
    q, s = quantize_fp8_groups(x)  # the same rule, rows being tokens
    assert torch.equal(codes.view(torch.uint8), q.view(torch.uint8)) and torch.equal(scales, s)


CHILD = r"""
import json, torch
from model_runtime.quantization.fp8 import GROUP, quantize_groups_torch, quantize_fp8_groups
from model_runtime.quantization.group_gemm import GROUP as KERNEL_GROUP, group_matmul, quantize_groups
out = {"groups_agree": GROUP == KERNEL_GROUP}

# quantizer: each group = 2^e * e4m3 values with 448 among them, so every code is exact
torch.manual_seed(2)
tokens, k = 3, 64 * 3 + 32
codes = (torch.randn(tokens, k) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
codes[:, ::GROUP] = 448.0
exps = torch.randint(-6, 6, (tokens, -(-k // GROUP))).float()
x = codes.float() * (2.0 ** exps).repeat_interleave(GROUP, dim=1)[:, :k]
got_c, got_s = quantize_groups(x)
ref_c, ref_s = quantize_groups_torch(x)
out["quantizer_codes"] = bool(torch.equal(got_c.view(torch.uint8), ref_c.view(torch.uint8)))
out["quantizer_scales"] = bool(torch.equal(got_s, ref_s))

# GEMM: torch-made codes, float32 reference of the same dequantized values
def gemm_case(m, n, k, bias):
    xq, xs = quantize_groups_torch(torch.randn(m, k))
    wq, ws = quantize_fp8_groups(torch.randn(n, k) * 0.05)
    b = torch.randn(n) if bias else None
    spread = lambda s, k: s.repeat_interleave(GROUP, dim=1)[:, :k]
    ref = (xq.float() * spread(xs, k)) @ (wq.float() * spread(ws, k)).t()
    if b is not None:
        ref = ref + b
    got = group_matmul(xq, xs, wq, ws, b, torch.float32)
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    return err
out["gemm_small"] = gemm_case(5, 40, 160, True)       # 2.5 groups, tiles 16 x 64, partial everything
out["gemm_prefill"] = gemm_case(70, 130, 256, False)  # tiles 128 x 128
print(json.dumps(out))
"""


def test_the_triton_quantizer_and_gemm_match_torch_under_the_interpreter() -> None:
    out = run_child(["-c", CHILD], timeout_s=600)
    assert out["groups_agree"] and out["quantizer_codes"] and out["quantizer_scales"], out
    assert out["gemm_small"] < 1e-5 and out["gemm_prefill"] < 1e-5, out
