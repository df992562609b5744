"""FP8 projection weights on a Hopper GPU: torch._scaled_mm with per-token activation scales against the same
arithmetic in float32, and an engine with quantization fp8 that decodes in CUDA graphs what its eager twin
decodes. The CPU tests (tests/model/test_fp8_weights.py) cover the emulated path; this covers the one H100s run.
"""

from __future__ import annotations

import pytest
import torch

from model_runtime.config import CacheConfig
from model_runtime.engine import Engine
from model_runtime.quantization.act_quant import quantize_rows
from model_runtime.quantization.fp8 import (
    FP8Linear,
    quantize_fp8,
    quantize_rows_torch,
    scaled_mm_linear,
    scaled_mm_supported,
)
from model_runtime.weights.canonical import FP8_DTYPE, FP8_MAX
from tests.gpu.graphs_vs_eager import engine_tokens, graphs_and_eager_tokens
from tests.model.tiny_models import write_tiny_hf

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="needs sm_90+"
    ),
]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("scales_per", ["token", "group"])  # fp8, fp8_group
@pytest.mark.parametrize("width", [4096, 14336, 2500])
def test_the_activation_kernel_quantizes_byte_for_byte_as_torch(width: int, scales_per: str) -> None:
    from model_runtime.quantization.fp8 import quantize_groups_torch
    from model_runtime.quantization.group_gemm import quantize_groups

    kernel, reference = {
        "token": (quantize_rows, quantize_rows_torch),
        "group": (quantize_groups, quantize_groups_torch),
    }[scales_per]
    gen = torch.Generator(device="cuda").manual_seed(width)
    x = (torch.randn(300, width, device="cuda", generator=gen) * 3).bfloat16()
    x[7] = 0.0
    x[9, 11] = 1e4
    codes, scales = kernel(x)
    want_codes, want_scales = reference(x)
    assert torch.equal(scales, want_scales)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))


@pytest.mark.parametrize("tokens", [1, 7, 256])
def test_scaled_mm_matches_its_arithmetic_in_float32(tokens: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, 4096, device="cuda", generator=gen).bfloat16()
    x[0, 5] = 40.0  # an outlier: its row's scale grows, the other rows keep theirs
    w = (torch.randn(1024, 4096, device="cuda", generator=gen) * 0.02).bfloat16()
    bias = torch.randn(1024, device="cuda", generator=gen).bfloat16()
    q, scale = quantize_fp8(w)
    out = scaled_mm_linear(x, q, scale, bias, quantize_rows)
    assert out.dtype == torch.bfloat16 and out.shape == (tokens, 1024)

    # The same arithmetic in float32: x quantized per token (its row max onto 448), both sides dequantized.
    x_scale = x.float().abs().amax(dim=-1, keepdim=True) / FP8_MAX
    x_deq = (x.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * x_scale
    ref = x_deq @ (q.float() * scale[:, None]).t() + bias.float()
    assert _rel(out, ref) < 1e-2  # bfloat16 output rounding and accumulation order only
    # And within e4m3's precision of the unquantized bf16 product (both sides quantized: a few percent).
    exact = x.float() @ w.float().t() + bias.float()
    assert _rel(out, exact) < 0.08


# Fast accumulation's error against the float32 product of the same codes, as a share of what quantizing to FP8
# costs (the float32 product of the unquantized operands).
FAST_ACCUM_SHARE_OF_FP8_ERROR = 0.25


@pytest.mark.parametrize("k", [4096, 14336])  # Llama-3-8B's projection inputs: the hidden size, the MLP width
@pytest.mark.parametrize("tokens", [7, 512, 2048])
def test_fast_accumulation_adds_a_small_share_of_fp8s_own_error(tokens: int, k: int) -> None:
    """device.fp8_fast_accum (the default): the tensor cores' accumulator without float32 promotion. Against
    the float32 product of the same codes and scales, the promoted path is off by its bfloat16 output rounding;
    the fast one by more, but by a small share of what the FP8 rounding of the operands costs."""
    from model_runtime.quantization.fp8 import scaled_mm_rows

    gen = torch.Generator(device="cuda").manual_seed(tokens + k)
    x = torch.randn(tokens, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(4096, k, device="cuda", generator=gen) * 0.02).bfloat16()
    q, scale = quantize_fp8(w)
    codes, scales = quantize_rows(x)
    ref = (codes.float() * scales) @ (q.float() * scale[:, None]).t()
    out = {
        fast: scaled_mm_rows(codes, scales, q, scale, None, torch.bfloat16, fast) for fast in (False, True)
    }
    fp8_err = _rel(ref, x.float() @ w.float().t())
    exact_err, fast_err = _rel(out[False], ref), _rel(out[True], ref)
    detail = f"exact {exact_err:.2e}, fast {fast_err:.2e}, FP8's own {fp8_err:.2e}"
    assert exact_err < 4e-3, detail  # bfloat16 output rounding (2**-9 relative) and summation order
    assert fast_err < FAST_ACCUM_SHARE_OF_FP8_ERROR * fp8_err, detail
    assert not torch.equal(out[True], out[False]), (
        "use_fast_accum changed nothing: the flag did not reach cuBLAS"
    )


@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 14336), (112, 4096)])
@pytest.mark.parametrize("rows", [1, 7, 16])
def test_the_small_batch_fp8_kernel_matches_its_arithmetic_in_float32(rows: int, n: int, k: int) -> None:
    """skinny_matmul_fp8 (FP8Linear at <= 16 tokens) against the float32 product of the same codes and scales,
    with a bias, at Llama-3-8B's qkv and down shapes and a width that leaves a partial block of columns; and
    FP8Linear's two paths (the kernel, torch._scaled_mm) within bfloat16 rounding of each other."""
    from model_runtime.fused.skinny_matmul import skinny_matmul_fp8

    gen = torch.Generator(device="cuda").manual_seed(rows + n)
    x = (torch.randn(rows, k, device="cuda", generator=gen) * 3).bfloat16()
    q, scale = quantize_fp8((torch.randn(n, k, device="cuda", generator=gen) * 0.02).bfloat16())
    bias = torch.randn(n, device="cuda", generator=gen).bfloat16()
    codes, scales = quantize_rows(x)
    out = skinny_matmul_fp8(codes, scales, q, scale, bias)
    ref = (codes.float() * scales) @ (q.float() * scale[:, None]).t() + bias.float()
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    assert _rel(out, ref) < 4e-3  # bfloat16 output rounding; the products are exact, the sums float32
    linear = FP8Linear(k, n, bias=True, scaled_mm=True).cuda()
    linear.weight.data, linear.weight_scale.data, linear.bias.data = q, scale, bias
    assert linear.small_m_rows == 16
    kernel = linear(x)
    linear.small_m_rows = 0
    assert _rel(kernel, linear(x)) < 6e-3  # torch._scaled_mm's path, fast accumulation


def test_scaled_mm_is_chosen_on_hopper_and_an_fp8_engine_decodes_the_same_in_cuda_graphs_as_eager(
    tmp_path,
) -> None:
    assert scaled_mm_supported(torch.device("cuda"), torch.bfloat16)

    def check(engine: Engine) -> None:
        fp8 = [m for m in engine.runner.model.modules() if isinstance(m, FP8Linear)]
        assert fp8 and all(m.scaled_mm and m.weight.dtype == FP8_DTYPE and m.fast_accum for m in fp8)
        assert all(m.small_m_rows == 16 for m in fp8)  # small decode batches through skinny_matmul_fp8
        layers = engine.runner.model.layers  # the norms and silu_mul write the projections' FP8 rows
        assert all(layer.input_norm.fp8_rows and layer.post_attn_norm.fp8_rows for layer in layers)
        assert all(layer.mlp.fp8_rows for layer in layers)

    graphs, eager = graphs_and_eager_tokens(tmp_path, CacheConfig(num_blocks=512), "fp8", check)
    assert graphs == eager


def test_the_fused_fp8_inputs_give_the_tokens_of_quantizing_in_each_projection(tmp_path) -> None:
    """The norms and silu_mul quantize for the FP8 projections (fused/fp8_rows.py): byte-equal codes, so the
    same logits and the same greedy tokens as each projection quantizing its own input."""
    from model_runtime.quantization.fp8 import fuse_fp8_inputs

    def unfuse(engine: Engine) -> None:
        for layer in engine.runner.model.layers:
            fuse_fp8_inputs(layer, on=False)
        assert not any(
            layer.input_norm.fp8_rows or layer.mlp.fp8_rows for layer in engine.runner.model.layers
        )

    path = str(write_tiny_hf(tmp_path, "llama"))
    cache = CacheConfig(num_blocks=512)
    fused = engine_tokens(path, cache, "fp8", True, lambda engine: None)
    assert fused == engine_tokens(path, cache, "fp8", True, unfuse)


@pytest.mark.parametrize("rows", [1, 5, 300])
def test_the_fused_norm_and_silu_kernels_write_the_codes_torch_would(rows: int) -> None:
    """On the GPU in bfloat16, byte for byte: the fused kernels' codes and scales against quantize_rows_torch
    of the unfused kernels' output (the CPU test can only compare kernel to kernel: the interpreter rounds some
    e4m3 casts differently)."""
    from model_runtime.fused.triton_ops import TritonOps

    ops, gen = TritonOps(), torch.Generator(device="cuda").manual_seed(rows)
    scale = torch.logspace(-2, 2, rows, device="cuda")[:, None]
    x = (torch.randn(rows, 4096, device="cuda", generator=gen) * scale).bfloat16()
    residual = torch.randn(rows, 4096, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(4096, device="cuda", generator=gen) * 0.1 + 1).bfloat16()
    gate_up = (torch.randn(rows, 2 * 14336, device="cuda", generator=gen) * scale * 4).bfloat16()
    ref_norm, ref_sum = ops.add_rms_norm(x, residual.clone(), w, 1e-5)
    fused_residual = residual.clone()
    cases = {
        "rms_norm": (ops.rms_norm_fp8(x, w, 1e-5), ops.rms_norm(x, w, 1e-5)),
        "add_rms_norm": (ops.add_rms_norm_fp8(x, fused_residual, w, 1e-5)[0], ref_norm),
        "silu_mul": (ops.silu_mul_fp8(gate_up), ops.silu_mul(gate_up)),
    }
    for name, (rows_out, unfused) in cases.items():
        codes, scales = quantize_rows_torch(unfused)
        differ = rows_out.codes.view(torch.uint8) != codes.view(torch.uint8)
        where = differ.nonzero()[:3].tolist()
        detail = f"{name}: {int(differ.sum())} codes differ, e.g. at {where}: " + ", ".join(
            f"{unfused[r, c].item()} -> {rows_out.codes[r, c].float().item()} vs {codes[r, c].float().item()}"
            for r, c in where
        )
        assert not differ.any(), detail
        assert torch.equal(rows_out.scales, scales), f"{name}: scales {rows_out.scales[:3]} vs {scales[:3]}"
    assert torch.equal(fused_residual, ref_sum)


# --- quantization: fp8_group (a scale per 64 input channels on both sides; model_runtime.quantization.group_gemm)
@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
def test_the_group_gemm_matches_its_arithmetic_in_float32(tokens: int) -> None:
    from model_runtime.quantization.fp8 import GROUP, quantize_fp8_groups, quantize_groups_torch
    from model_runtime.quantization.group_gemm import group_matmul

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, 4096, device="cuda", generator=gen).bfloat16()
    x[0, 5] = 40.0  # an outlier scales only its own group of 64
    w = (torch.randn(1024, 4096, device="cuda", generator=gen) * 0.02).bfloat16()
    bias = torch.randn(1024, device="cuda", generator=gen).bfloat16()
    q, scale = quantize_fp8_groups(w)
    xq, xs = quantize_groups_torch(x)
    out = group_matmul(xq, xs, q, scale, bias, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == (tokens, 1024)
    spread = lambda s: s.repeat_interleave(GROUP, dim=1)  # noqa: E731
    ref = (xq.float() * spread(xs)) @ (q.float() * spread(scale)).t() + bias.float()
    assert _rel(out, ref) < 1e-2  # bfloat16 output rounding and accumulation order only
    exact = x.float() @ w.float().t() + bias.float()
    assert _rel(out, exact) < 0.05


def test_an_fp8_group_engine_decodes_the_same_in_cuda_graphs_as_eager(tmp_path) -> None:
    def check(engine: Engine) -> None:
        fp8 = [m for m in engine.runner.model.modules() if isinstance(m, FP8Linear)]
        assert fp8 and all(m.scaled_mm and m.grouped and m.weight_scale.dim() == 2 for m in fp8)

    graphs, eager = graphs_and_eager_tokens(tmp_path, CacheConfig(num_blocks=512), "fp8_group", check)
    assert graphs == eager
