"""FP8 (e4m3) weights: the per-channel round trip stays within half a unit in the last place of e4m3, the
emulated matmul uses exactly the stored FP8 weights, only the projections are quantized, and the config names
its key."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model_runtime.config import ConfigError, DeviceConfig, EngineConfig
from model_runtime.quantization import (
    FP8_MAX,
    FP8Linear,
    dequantize_fp8,
    quantize_fp8,
    quantize_projection_weights,
)
from model_runtime.quantization.fp8 import scaled_mm_linear, scaled_mm_supported
from model_runtime.weights.dummy import dummy_weights
from model_runtime.weights.shapes import dummy_shape

pytestmark = pytest.mark.unit

E4M3_MANTISSA_BITS = 3
E4M3_MIN_NORMAL_EXP = -6  # below 2**-6 the spacing is fixed (subnormals): 2**-9


def _half_ulp(x: torch.Tensor) -> torch.Tensor:
    """Half the spacing of e4m3 values around |x| (x already divided by its row's scale)."""
    exponent = torch.floor(torch.log2(x.abs().clamp(min=2.0**E4M3_MIN_NORMAL_EXP)))
    return torch.exp2(exponent - E4M3_MANTISSA_BITS - 1)


def _weights() -> torch.Tensor:
    gen = torch.Generator().manual_seed(19)
    w = torch.randn(64, 96, generator=gen)
    w[1] *= 1e-3  # rows of very different magnitude each use the whole range
    w[2] *= 1e3
    w[3, :48] *= 1e-4  # a row with values deep in the subnormal range of its scale
    w[4] = 0.0  # an all-zero row
    return w


def test_round_trip_error_is_within_half_an_e4m3_ulp_per_channel() -> None:
    w = _weights()
    q, scale = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (w.shape[0],)
    back = dequantize_fp8(q, scale, torch.float32)
    err = (back - w).abs()
    bound = _half_ulp(w / scale[:, None]) * scale[:, None]
    assert torch.all(err <= bound * (1 + 1e-6) + 1e-30), f"worst excess {(err - bound).max()}"
    # Per channel the largest error is within the half-ulp at the top of the range (16 * scale).
    assert torch.all(err.amax(dim=1) <= 16 * scale * (1 + 1e-6))
    # Each row's largest magnitude maps onto 448 and comes back (up to float32 rounding of the scale).
    top = w.abs().argmax(dim=1, keepdim=True)
    nonzero = w.abs().amax(dim=1) > 0
    assert torch.allclose(back.gather(1, top)[nonzero], w.gather(1, top)[nonzero], rtol=1e-6, atol=0)
    assert torch.all(q.float().abs().amax(dim=1)[nonzero] == FP8_MAX)
    assert torch.all(back[4] == 0) and torch.all(torch.isfinite(back))
    # Not a no-op: random normals are not all e4m3 values.
    assert (err > 0).float().mean() > 0.5


def test_bfloat16_weights_quantize_like_their_float32_values() -> None:
    w = _weights().to(torch.bfloat16)
    q16, s16 = quantize_fp8(w)
    q32, s32 = quantize_fp8(w.float())
    assert torch.equal(q16.view(torch.uint8), q32.view(torch.uint8)) and torch.equal(s16, s32)


def test_emulated_linear_uses_exactly_the_stored_fp8_weights() -> None:
    w = _weights()
    bias = torch.randn(w.shape[0])
    layer = FP8Linear(w.shape[1], w.shape[0], bias=True, scaled_mm=False)
    q, scale = quantize_fp8(w)
    layer.weight.data, layer.weight_scale.data, layer.bias.data = q, scale, bias  # type: ignore[union-attr]
    x = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(1))
    assert not scaled_mm_supported(x.device, torch.bfloat16)
    out = layer(x)
    assert torch.equal(out, F.linear(x, dequantize_fp8(q, scale, torch.float32), bias))
    assert not torch.allclose(out, F.linear(x, w, bias), rtol=0, atol=1e-6)
    layer.bias.data = bias.to(torch.bfloat16)  # type: ignore[union-attr]
    assert layer(x.to(torch.bfloat16)).dtype == torch.bfloat16  # dequantized to the activations' dtype


def test_only_the_projections_are_quantized_and_they_take_half_of_bf16_bytes() -> None:
    config = dummy_shape("tiny-llama")
    weights = dummy_weights(config, torch.bfloat16, "cpu")
    before = {name: tensor.clone() for name, tensor in weights.items()}
    quantize_projection_weights(weights)
    projections = {
        f"layers.{i}.{p}.weight"
        for i in range(config.num_layers)
        for p in ("qkv", "o_proj", "gate_up", "down")
    }
    assert set(weights) == set(before) | {name + "_scale" for name in projections}
    for name, tensor in before.items():
        if name in projections:
            assert weights[name].dtype == torch.float8_e4m3fn
            assert weights[name].nbytes * 2 == tensor.nbytes
            assert weights[name + "_scale"].shape == (tensor.shape[0],)
        else:  # embeddings, norms, lm_head
            assert weights[name].dtype == torch.bfloat16 and torch.equal(weights[name], tensor)


def test_config_names_the_quantization_key() -> None:
    assert DeviceConfig(quantization="fp8").quantization == "fp8"
    with pytest.raises(
        ConfigError, match=r"^device\.quantization: must be one of none, fp8, fp8_group, got 'int4'"
    ):
        DeviceConfig(quantization="int4")
    # fp8 with tensor parallelism: each rank quantizes its slice (tests/model/test_fp8_weights.py).
    config = EngineConfig.from_dict(
        {"device": {"quantization": "fp8"}, "parallel": {"tensor_parallel_size": 2}}
    )
    assert config.device.quantization == "fp8"
    with pytest.raises(ConfigError, match=r"^engine\.device\.quantization: must be one of"):
        EngineConfig.from_dict({"device": {"quantization": "FP8"}})


def test_config_takes_fp8_fast_accum_as_a_bool_only() -> None:
    assert DeviceConfig().fp8_fast_accum is True  # the fast accumulation, as vLLM's FP8 kernels on Hopper
    assert DeviceConfig(fp8_fast_accum=False).fp8_fast_accum is False
    for bad in ("false", 0, None):
        with pytest.raises(ConfigError, match=r"^device\.fp8_fast_accum: must be true or false, got "):
            DeviceConfig(fp8_fast_accum=bad)
    assert EngineConfig.from_dict({"device": {"fp8_fast_accum": False}}).device.fp8_fast_accum is False


def test_the_scaled_mm_path_quantizes_activations_per_token() -> None:
    """The GPU path's wiring (scale shapes, the column-major weight, per-token activation scales) through
    torch._scaled_mm's CPU implementation; CUDA's kernel itself is verified on a GPU. Each activation is off by
    at most half an e4m3 ulp (2**-4 relative), so each output is within 2**-4 * sum |x_k w_k|, plus bfloat16's
    rounding of the output."""
    w = _weights()[5:]  # rows of ordinary magnitude
    q, scale = quantize_fp8(w)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(7, w.shape[1], generator=gen)
    x[3] *= 100.0  # one token far larger than the rest: a per-tensor scale would flush the others
    x = x.to(torch.bfloat16)
    exact_w = dequantize_fp8(q, scale, torch.float32)
    ref = F.linear(x.float(), exact_w)
    out = scaled_mm_linear(x, q, scale, None)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    bound = 2.0**-4 * F.linear(x.float().abs(), exact_w.abs()) + 2.0**-8 * ref.abs()
    assert torch.all((out.float() - ref).abs() <= bound)
    assert not torch.equal(out.float(), ref)
    assert scaled_mm_linear(x[:0], q, scale, None).shape == (0, w.shape[0])
