"""The fused elementwise kernels (model_runtime.fused.triton_ops) on the CPU through Triton's interpreter,
against the torch reference (model_runtime.fused.torch_ops): each op alone on awkward shapes (odd head counts,
strided qkv views, sizes that are not powers of two), then a whole tiny model's logits and KV with TritonOps
against the same model with TorchOps.

The kernels run in one child process, this file run as a script (tests/unit/interpreter.py says why).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests.unit.interpreter import HAVE_TRITON, interpreted_cases, run_cases

pytestmark = pytest.mark.unit

TOL = 1e-5  # fp32: only summation order differs


def _close(name: str, out: torch.Tensor, ref: torch.Tensor) -> tuple[bool, str]:
    err = float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-6))
    return err < TOL, f"{name} rel_err={err:.1e}"


def _all(*results: tuple[bool, str]) -> tuple[bool, str]:
    return all(ok for ok, _ in results), "; ".join(d for _, d in results)


# --- cases (child side) -------------------------------------------------------------------------------------
def _case_rms_norm() -> tuple[bool, str]:
    from model_runtime.fused import torch_ops
    from model_runtime.fused.triton_ops import TritonOps

    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 48, generator=gen) * 3, torch.randn(48, generator=gen)
    return _close("rms_norm", TritonOps().rms_norm(x, w, 1e-5), torch_ops.rms_norm(x, w, 1e-5))


def _case_add_rms_norm() -> tuple[bool, str]:
    from model_runtime.fused import torch_ops
    from model_runtime.fused.triton_ops import TritonOps

    gen = torch.Generator().manual_seed(1)
    x, res, w = (
        torch.randn(7, 40, generator=gen),
        torch.randn(7, 40, generator=gen),
        torch.randn(40, generator=gen),
    )
    ref_out, ref_sum = torch_ops.add_rms_norm(x, res, w, 1e-6)
    buffer = res.clone()
    out, total = TritonOps().add_rms_norm(x, buffer, w, 1e-6)
    return _all(
        _close("out", out, ref_out), _close("sum", total, ref_sum), _close("in_place", buffer, ref_sum)
    )


def _case_rotary_strided_gqa() -> tuple[bool, str]:
    """q and k as views into one fused qkv output (3 query heads, 1 KV head: masks on both head axes)."""
    from model_runtime.fused import torch_ops
    from model_runtime.fused.triton_ops import TritonOps

    gen = torch.Generator().manual_seed(2)
    t, hq, hkv, d = 6, 3, 1, 16
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.outer(torch.arange(64, dtype=torch.float32), inv_freq)
    cos, sin = freqs.cos(), freqs.sin()
    positions = torch.tensor([0, 5, 63, 17, 2, 40])
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen)
    q_ref, k_ref = torch_ops.rotary(
        qkv[:, : hq * d].reshape(t, hq, d),
        qkv[:, hq * d : (hq + hkv) * d].reshape(t, hkv, d),
        positions,
        cos,
        sin,
    )
    v_before = qkv[:, (hq + hkv) * d :].clone()
    q_view = qkv[:, : hq * d].view(t, hq, d)
    k_view = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    q, k = TritonOps().rotary(q_view, k_view, positions, cos, sin)
    v_kept = torch.equal(qkv[:, (hq + hkv) * d :], v_before)
    return _all(_close("q", q, q_ref), _close("k", k, k_ref), (v_kept, f"v untouched={v_kept}"))


def _case_silu_mul() -> tuple[bool, str]:
    from model_runtime.fused import torch_ops
    from model_runtime.fused.triton_ops import SILU_BLOCK, TritonOps

    gen = torch.Generator().manual_seed(3)
    gate_up = torch.randn(4, 2 * (SILU_BLOCK + 37), generator=gen) * 4  # a partial second column block
    return _close("silu_mul", TritonOps().silu_mul(gate_up), torch_ops.silu_mul(gate_up))


def _same_rows(name: str, rows, ref: torch.Tensor) -> tuple[bool, str]:
    """QuantizedRows byte-equal to what the activation quantization kernel (quantization.act_quant, the pass the
    fusion replaces) makes of `ref`, the unfused kernel's output: codes and scales. Kernel against kernel,
    because the interpreter rounds some e4m3 casts differently from torch (test_triton_interpret.py), and the
    scale's division by 448 rounds differently in torch on a CPU than on a GPU; tests/gpu compares both with
    torch on the GPU."""
    from model_runtime.quantization.act_quant import quantize_rows

    codes, scales = quantize_rows(ref)
    same_codes = torch.equal(rows.codes.view(torch.uint8), codes.view(torch.uint8))
    same_scales = torch.equal(rows.scales, scales)
    differing = int((rows.codes.view(torch.uint8) != codes.view(torch.uint8)).sum())
    peak = int(rows.codes.float().abs().max())  # every row's largest value maps onto 448
    ok = same_codes and same_scales and peak == 448 and bool(ref.abs().max() > 0)
    return (
        ok,
        f"{name}: codes equal={same_codes} ({differing} differ), scales equal={same_scales}, peak {peak}",
    )


def _case_norms_fp8() -> tuple[bool, str]:
    """rms_norm_fp8 / add_rms_norm_fp8: the codes and scales of quantizing the unfused kernels' output, byte for
    byte; the residual sum written as add_rms_norm writes it. Rows of very different magnitudes."""
    from model_runtime.fused.triton_ops import TritonOps

    ops, gen = TritonOps(), torch.Generator().manual_seed(11)
    x = torch.randn(6, 72, generator=gen) * torch.logspace(-3, 3, 6)[:, None]
    res, w = torch.randn(6, 72, generator=gen), torch.randn(72, generator=gen)
    plain_res, fused_res = res.clone(), res.clone()
    ref_norm, ref_sum = ops.add_rms_norm(x, plain_res, w, 1e-6)
    rows, total = ops.add_rms_norm_fp8(x, fused_res, w, 1e-6)
    same_sum = torch.equal(total, ref_sum) and torch.equal(fused_res, ref_sum)
    return _all(
        _same_rows("rms_norm_fp8", ops.rms_norm_fp8(x, w, 1e-5), ops.rms_norm(x, w, 1e-5)),
        _same_rows("add_rms_norm_fp8", rows, ref_norm),
        (same_sum, f"residual sum equal={same_sum}"),
    )


def _case_silu_mul_fp8() -> tuple[bool, str]:
    """silu_mul_fp8 over rows that are not a power of two wide (a masked tail): byte-equal to quantizing
    silu_mul."""
    from model_runtime.fused.fp8_rows import QuantizedRows
    from model_runtime.fused.triton_ops import TritonOps, launch_silu_mul_fp8

    ops, gen = TritonOps(), torch.Generator().manual_seed(12)
    gate_up = torch.randn(3, 2 * 2093, generator=gen) * torch.tensor([[0.01], [1.0], [50.0]])
    unfused = ops.silu_mul(gate_up)
    results = [_same_rows("silu_mul_fp8", ops.silu_mul_fp8(gate_up), unfused)]
    for chunk in (
        None,
        256,
        1024,
    ):  # the whole row in registers; two passes over chunks, the last one partial
        rows = QuantizedRows(torch.empty(3, 2093, dtype=torch.float8_e4m3fn), torch.empty(3, 1))
        launch_silu_mul_fp8(gate_up, rows, chunk)
        results.append(_same_rows(f"silu_mul_fp8 chunk {chunk}", rows, unfused))
    return _all(*results)


def _case_small_m_fp8_linear() -> tuple[bool, str]:
    """The weight-streaming FP8 matmul for <= 16 rows (skinny_matmul_fp8): activations quantized per token
    against an e4m3 weight with a scale per row, odd sizes (masked columns and K tail), with and without a bias:
    the float32 product of the same codes and scales (the dot's products of e4m3 values are exact in float16)."""
    from model_runtime.fused.skinny_matmul import skinny_matmul_fp8
    from model_runtime.quantization.fp8 import quantize_fp8, quantize_rows_torch

    gen = torch.Generator().manual_seed(7)
    q, w_scale = quantize_fp8(torch.randn(70, 300, generator=gen) * 0.05)
    bias = torch.randn(70, generator=gen)
    results = []
    for rows, with_bias in ((1, True), (5, False), (16, True)):
        codes, scales = quantize_rows_torch(torch.randn(rows, 300, generator=gen) * 4)
        b = bias if with_bias else None
        out = skinny_matmul_fp8(codes, scales, q, w_scale, b, torch.float32)
        ref = (codes.float() * scales) @ (q.float() * w_scale[:, None]).t() + (0 if b is None else b)
        results.append(_close(f"fp8 rows {rows}", out, ref))
    return _all(*results)


def _case_small_m_linear() -> tuple[bool, str]:
    """The weight-streaming matmul for <= 16 rows (with a bias, odd sizes); more rows fall back to torch."""
    from model_runtime.fused.triton_ops import TritonOps

    gen = torch.Generator().manual_seed(6)
    w, b = torch.randn(70, 300, generator=gen), torch.randn(70, generator=gen)
    results = []
    for rows in (1, 5, 16, 17):
        x = torch.randn(rows, 300, generator=gen)
        results.append(
            _close(f"rows {rows}", TritonOps().linear(x, w, b), torch.nn.functional.linear(x, w, b))
        )
    return _all(*results)


def _case_model_logits_and_kv() -> tuple[bool, str]:
    """A tiny Llama (random norm weights too) run eagerly over a prefill and a decode step: TritonOps
    against TorchOps, same logits and the same KV written. The projections stay on torch here (the small-M
    matmul has its own case; interpreted over the tiny model's vocabulary it would take minutes)."""
    from model_runtime.attention.torch_ref import TorchAttention
    from model_runtime.fused.torch_ops import TorchOps
    from model_runtime.fused.triton_ops import TritonOps
    from model_runtime.kv_layout import KVLayout
    from model_runtime.model_runner import ModelRunner
    from model_runtime.request import Request, SamplingParams, ScheduledChunk, SchedulerOutput
    from model_runtime.weights.dummy import dummy_weights
    from model_runtime.weights.shapes import dummy_shape

    config = dummy_shape("tiny-llama")
    weights = dummy_weights(config, torch.float32, "cpu", seed=4)
    gen = torch.Generator().manual_seed(5)
    for name, tensor in weights.items():
        if name.endswith("norm.weight"):
            tensor.copy_(1 + 0.5 * torch.randn(tensor.shape, generator=gen))
    layout = KVLayout(config.num_layers, config.num_kv_heads, config.head_dim, 8, 16, "float32")
    results = []
    runners = [
        ModelRunner(config, weights, layout, "cpu", TorchAttention(), 64, ops=ops)
        for ops in (TorchOps(), TritonOps(small_m_matmul=False))
    ]
    prompt = torch.randint(0, config.vocab_size, (11,), generator=gen).tolist()
    for step, (computed, n) in enumerate([(0, 11), (11, 1)]):
        logits = []
        for runner in runners:
            request = Request(
                "r", prompt + [7], SamplingParams(), block_ids=[3, 5], num_computed_tokens=computed
            )
            logits.append(runner.execute(SchedulerOutput((ScheduledChunk(request, n, sample=True),))))
        results.append(_close(f"logits step {step}", logits[1], logits[0]))
    results.append(_close("kv", runners[1].kv_cache, runners[0].kv_cache))
    return _all(*results)


CASES: dict[str, Callable[[], tuple[bool, str]]] = {
    "rms_norm": _case_rms_norm,
    "add_rms_norm_in_place": _case_add_rms_norm,
    "rotary_strided_gqa": _case_rotary_strided_gqa,
    "silu_mul_partial_block": _case_silu_mul,
    "norms_fp8_rows": _case_norms_fp8,
    "silu_mul_fp8_rows": _case_silu_mul_fp8,
    "small_m_linear": _case_small_m_linear,
    "small_m_fp8_linear": _case_small_m_fp8_linear,
    "model_logits_and_kv": _case_model_logits_and_kv,
}


# --- pytest side --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict[str, object]]:
    return interpreted_cases(__file__)


@pytest.mark.parametrize("case", list(CASES))
def test_fused_kernel_matches_reference(interpreted: dict[str, dict[str, object]], case: str) -> None:
    result = interpreted[case]
    assert result["ok"], f"{case}: {result['detail']}"


def test_select_fused_ops_by_device(monkeypatch: pytest.MonkeyPatch) -> None:
    from model_runtime.fused.select import make_fused_ops

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert make_fused_ops("auto", "cpu").name == "torch"
    assert make_fused_ops("torch", "cuda").name == "torch"
    with pytest.raises(ValueError, match="fast"):
        make_fused_ops("fast", "cpu")
    with pytest.raises(ValueError, match="'compile' runs on CUDA"):
        make_fused_ops("compile", "cpu")
    if HAVE_TRITON:
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            make_fused_ops("triton", "cpu")


if __name__ == "__main__":
    run_cases(CASES)
