"""The fused elementwise kernels on a CUDA GPU (Triton and torch.compile) against the torch reference, at
Llama-3-8B shapes in bf16 and float32, decode (1 token) and prefill (2k tokens) row counts."""

from __future__ import annotations

import pytest
import torch

from model_runtime.fused.torch_ops import TorchOps

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 4096, 32, 8, 128, 14336
# bf16 results may differ from the reference by one rounding where float32 summation order differs.
TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-5}


def _impl(name: str):
    from model_runtime.fused.select import make_fused_ops

    return make_fused_ops(name, "cuda")


def _err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6))


@pytest.mark.parametrize("name", ["triton", "compile"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("rows", [1, 2048])
def test_fused_ops_match_reference(name: str, dtype: torch.dtype, rows: int) -> None:
    ops, ref = _impl(name), TorchOps()
    gen = torch.Generator(device="cuda").manual_seed(rows)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda").to(dtype)

    x, res, w = randn(rows, HIDDEN), randn(rows, HIDDEN), randn(HIDDEN)
    assert _err(ops.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5)) < TOL[dtype]
    want_out, want_sum = ref.add_rms_norm(x, res, w, 1e-5)
    out, total = ops.add_rms_norm(x, res.clone(), w, 1e-5)
    assert _err(out, want_out) < TOL[dtype] and _err(total, want_sum) < TOL[dtype]

    freqs = torch.outer(torch.arange(8192.0, device="cuda"), torch.rand(HEAD_DIM // 2, device="cuda"))
    cos, sin = freqs.cos(), freqs.sin()
    positions = torch.randint(0, 8192, (rows,), generator=gen, device="cuda")
    qkv = randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    views = (
        qkv[:, :q_size].view(rows, HEADS, HEAD_DIM),
        qkv[:, q_size : q_size + kv_size].view(rows, KV_HEADS, HEAD_DIM),
    )
    want_q, want_k = ref.rotary(views[0].clone(), views[1].clone(), positions, cos, sin)
    q, k = ops.rotary(*views, positions, cos, sin)
    assert _err(q, want_q) < TOL[dtype] and _err(k, want_k) < TOL[dtype]

    gate_up = randn(rows, 2 * INTER)
    assert _err(ops.silu_mul(gate_up), ref.silu_mul(gate_up)) < TOL[dtype]
