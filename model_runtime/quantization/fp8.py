"""FP8 (e4m3) projection weights with one float32 scale per output channel, quantized at load.

    weight [N, K] (model dtype)  ->  q [N, K] float8_e4m3fn,  scale [N] float32,  weight ~ q * scale[:, None]
    scale[n] = max_k |weight[n, k]| / 448       (448: e4m3fn's largest finite value; a row's largest weight maps
                                                  onto it, so nothing saturates and each row uses the full range)

`quantization: fp8_group` scales finer: one scale per (output row, group of 64 input channels), scale [N, K/64],
and the activations likewise per (token, group), matmul by model_runtime.quantization.group_gemm on a GPU.

Quantized: the projections, q/k/v (the fused qkv), o_proj, gate/up (the fused gate_up) and down. Embeddings, norms
and lm_head keep the model dtype. A fused tensor's rows are independent (one scale each), so fusing q|k|v or
gate|up changes nothing. Stored as e4m3 these weights take half of their bfloat16 bytes. A pre-quantized FP8
checkpoint (model_runtime.weights.fp8_source) arrives in this form already and is not quantized again.

Two matmuls, chosen once per module when the model is built, never per step:
- scaled_mm (CUDA sm_90+, bfloat16 activations, K and N multiples of 16): each token's activations quantized to
  e4m3 on the fly with a scale of its own (per token: max |x| of the row / 448; one Triton kernel,
  model_runtime.quantization.act_quant), then torch._scaled_mm with the row-wise scales of both sides, bfloat16
  out. Shapes are static and nothing syncs with the host, so a decode CUDA graph captures it
  (tests/gpu/test_fp8_weights_gpu.py). qkv, gate_up and down take their input already quantized
  (QuantizedRows) from the norm or SiLU-and-multiply kernel before them (fuse_fp8_inputs); o_proj quantizes its own.
  At up to 16 tokens (decode at small batch) the matmul is fused/skinny_matmul.skinny_matmul_fp8 instead, a
  weight-streaming Triton kernel over the same codes and scales (torch._scaled_mm is no faster than bf16 there).
  `fast_accum` (device.fp8_fast_accum, on by default) lets the tensor cores keep their FP8 partial sums in their
  own accumulator for the whole K loop instead of promoting them into float32 every few K steps
  (torch._scaled_mm's use_fast_accum; vLLM's CUTLASS FP8 kernels for Hopper use the same fast-accumulation
  schedules): faster, and less exact by an amount bench/fp8_matmul.py measures against the float32 product.
- emulation (CPU, other GPUs, other dtypes): the weight dequantized to the activation dtype (q * scale in
  float32, rounded once) and a plain matmul: the weights used are exactly the stored FP8 ones; activations are
  not quantized, unless `emulate_scaled_mm` asks for scaled_mm's numerics (each token's activations rounded to
  e4m3 under its own scale first), which is how the CPU tests measure what a Hopper GPU computes. On SmolLM2 the
  difference matters: perplexity +1.0% with the weights alone, +2.8% with the activations rounded as well.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from model_runtime.fused.fp8_rows import QuantizedRows, quantize_rows_torch
from model_runtime.models.llama import LlamaForCausalLM, Projection
from model_runtime.weights.canonical import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE, is_projection_weight

# Rows quantized at once: the float32 scratch is one chunk's, not a whole (maybe 57344-row) matrix's.
_ROWS_PER_CHUNK = 4096
GROUP = 64  # input channels per scale under fp8_group, for the CPU emulation and the GPU kernels alike


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (q [N, K] float8_e4m3fn, scale [N] float32) on weight's device, rounded to nearest even."""
    q = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
    scale = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    for start in range(0, weight.shape[0], _ROWS_PER_CHUNK):
        rows = weight[start : start + _ROWS_PER_CHUNK].float()
        row_scale = (rows.abs().amax(dim=1) / FP8_MAX).clamp(min=FP8_MIN_SCALE)
        # The row's max divided by its scale may land a rounding above 448; clamp keeps it finite (e4m3fn has
        # no infinity: an overflow would be NaN).
        q[start : start + rows.shape[0]] = (rows / row_scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        scale[start : start + rows.shape[0]] = row_scale
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q [N, K] float8_e4m3fn with scale [N] (per row) or [N, ceil(K / GROUP)] (per group) float32 -> [N, K] in
    `dtype` (computed in float32, rounded once)."""
    if scale.dim() == 1:
        return (q.float() * scale[:, None]).to(dtype)
    return (q.float() * _spread(scale, q.shape[1])).to(dtype)


def _spread(scale: torch.Tensor, k: int) -> torch.Tensor:
    """[R, ceil(K / GROUP)] group scales -> [R, K]: each group's scale over its channels."""
    return scale.repeat_interleave(GROUP, dim=1)[:, :k]


def _group_scales(x: torch.Tensor) -> torch.Tensor:
    """[R, K] float32 -> [R, ceil(K / GROUP)]: each group's largest |x| / 448 (the last group may be short)."""
    rows, k = x.shape
    pad = -k % GROUP
    padded = F.pad(x.abs(), (0, pad)) if pad else x.abs()
    return (padded.view(rows, -1, GROUP).amax(dim=2) / FP8_MAX).clamp(min=FP8_MIN_SCALE)


def quantize_fp8_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (q [N, K] float8_e4m3fn, scale [N, ceil(K / GROUP)] float32): each (row, group of GROUP
    input channels) with a scale of its own, its largest weight onto 448."""
    groups = -(-weight.shape[1] // GROUP)
    q = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
    scale = torch.empty(weight.shape[0], groups, dtype=torch.float32, device=weight.device)
    for start in range(0, weight.shape[0], _ROWS_PER_CHUNK):
        rows = weight[start : start + _ROWS_PER_CHUNK].float()
        row_scale = _group_scales(rows)
        q[start : start + rows.shape[0]] = (
            (rows / _spread(row_scale, rows.shape[1])).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        )
        scale[start : start + rows.shape[0]] = row_scale
    return q, scale


def quantize_groups_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (codes [T, K] e4m3, scales [T, ceil(K / GROUP)] float32) in torch ops: the reference for
    group_gemm.quantize_groups, and the CPU emulation of what the GPU path rounds."""
    xf = x.float()
    scales = _group_scales(xf)
    return (xf / _spread(scales, x.shape[1])).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scales


def scaled_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch._scaled_mm with row-wise scales serves this device: CUDA sm_90+ (H100, H200) with
    bfloat16 activations (its only row-wise output dtype). sm_89 has FP8 too, but row-wise scaling there
    depends on the torch build: it emulates until a GPU session verifies it."""
    if device.type != "cuda" or dtype != torch.bfloat16:
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


Quantizer = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def scaled_mm_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    quantize: Quantizer = quantize_rows_torch,
    fast_accum: bool = False,
) -> torch.Tensor:
    """x [T, K] bfloat16 @ dequant(weight [N, K], weight_scale [N])^T (+ bias) -> [T, N] bfloat16, with x
    quantized per token by `quantize`. No host sync: the scales stay on the device."""
    if x.shape[0] == 0:
        return x.new_empty(0, weight.shape[0])
    codes, scales = quantize(x)
    return scaled_mm_rows(codes, scales, weight, weight_scale, bias, x.dtype, fast_accum)


def scaled_mm_rows(
    codes: torch.Tensor,
    scales: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    fast_accum: bool = False,
) -> torch.Tensor:
    """Activations already quantized per token (codes [T, K] e4m3, scales [T, 1]) @ the FP8 weight -> [T, N].
    `fast_accum`: the tensor cores' FP8 accumulation without float32 promotion (see the module docstring)."""
    if codes.shape[0] == 0:
        return torch.empty(0, weight.shape[0], dtype=out_dtype, device=codes.device)
    # mat2 must be column-major: weight [N, K] row-major, transposed, is.
    out = torch._scaled_mm(
        codes,
        weight.t(),
        scale_a=scales,
        scale_b=weight_scale.unsqueeze(0),
        out_dtype=out_dtype,
        use_fast_accum=fast_accum,
    )
    return out if bias is None else out + bias


class FP8Linear(nn.Module):
    """A projection whose weight is float8_e4m3fn [N, K] with `weight_scale` float32 (canonical names
    `<projection>.weight` and `<projection>.weight_scale`): [N] per row, or with `grouped` [N, ceil(K / GROUP)]
    per (row, group of GROUP input channels). The bias, if any, stays in the model dtype."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        scaled_mm: bool,
        grouped: bool = False,
        fast_accum: bool = False,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False
        )
        self.grouped = grouped
        scale_shape = (out_features, -(-in_features // GROUP)) if grouped else (out_features,)
        self.weight_scale = nn.Parameter(torch.empty(scale_shape, dtype=torch.float32), requires_grad=False)
        self.bias: nn.Parameter | None
        self.register_parameter("bias", nn.Parameter(torch.empty(out_features)) if bias else None)
        # Fixed at build: shapes and device do not change, and the choice must not cost a step anything.
        self.scaled_mm = scaled_mm and in_features % 16 == 0 and out_features % 16 == 0
        self._quantize: Quantizer = quantize_rows_torch
        # Emulation only: round the activations per token (per group when grouped) as the GPU path does
        # (emulate_scaled_mm).
        self.round_activations = False
        self._group_matmul: Callable[..., torch.Tensor] | None = None
        # CUDA: Triton kernels quantize the activations (and, grouped, multiply); Triton is imported only then
        if self.scaled_mm and grouped:
            from model_runtime.quantization.group_gemm import group_matmul, quantize_groups

            self._quantize, self._group_matmul = quantize_groups, group_matmul
        elif self.scaled_mm:
            from model_runtime.quantization.act_quant import quantize_rows

            self._quantize = quantize_rows
        # Whether this projection takes its input as QuantizedRows, which the kernel before it then writes
        # (use_fp8_projections tells the norms and the MLP; fused/fp8_rows.py): the row-wise scaled_mm path.
        self.takes_fp8_rows = self.scaled_mm and not grouped
        # The scaled_mm path's accumulation (device.fp8_fast_accum); the emulation and the group GEMM accumulate
        # in float32 whatever it says.
        self.fast_accum = fast_accum
        # Up to `small_m_rows` tokens the weight-streaming kernel (skinny_matmul_fp8) instead of torch._scaled_mm;
        # 0 turns it off (bench/fp8_matmul.py compares both).
        self.small_m_rows = 0
        self._small_m_matmul: Callable[..., torch.Tensor] | None = None
        if self.takes_fp8_rows:
            from model_runtime.fused.skinny_matmul import MAX_ROWS, skinny_matmul_fp8

            self.small_m_rows, self._small_m_matmul = MAX_ROWS, skinny_matmul_fp8

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        if isinstance(x, QuantizedRows):
            return self._rows(x.codes, x.scales)
        return self._forward(x)

    def _rows(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """Activations quantized per token -> [T, N] bfloat16 (the scaled_mm path)."""
        if self._small_m_matmul is not None and 0 < codes.shape[0] <= self.small_m_rows:
            return self._small_m_matmul(codes, scales, self.weight, self.weight_scale, self.bias)
        return scaled_mm_rows(
            codes, scales, self.weight, self.weight_scale, self.bias, torch.bfloat16, self.fast_accum
        )

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._group_matmul is not None:
            codes, scales = self._quantize(x)
            return self._group_matmul(codes, scales, self.weight, self.weight_scale, self.bias, x.dtype)
        if self.scaled_mm:
            if x.shape[0] == 0:
                return x.new_empty(0, self.weight.shape[0])
            return self._rows(*self._quantize(x))
        if self.round_activations:
            if self.grouped:
                codes, scales = quantize_groups_torch(x)
                x = (codes.float() * _spread(scales, x.shape[1])).to(x.dtype)
            else:
                codes, scales = quantize_rows_torch(x)
                x = (codes.float() * scales).to(x.dtype)
        return F.linear(x, dequantize_fp8(self.weight, self.weight_scale, x.dtype), self.bias)


def emulate_scaled_mm(model: nn.Module) -> int:
    """Make every emulated FP8 projection of `model` compute what the scaled_mm path computes (activations
    rounded to e4m3 per token, then the matmul); returns how many it changed. For measuring, on a CPU, the
    numerics of a Hopper GPU."""
    changed = 0
    for module in model.modules():
        if isinstance(module, FP8Linear) and not module.scaled_mm:
            module.round_activations = True
            changed += 1
    return changed


def use_fp8_projections(
    model: LlamaForCausalLM,
    device: torch.device,
    dtype: torch.dtype,
    grouped: bool = False,
    fast_accum: bool = False,
) -> None:
    """Replace every projection of `model` (built, weights not yet loaded) by an FP8Linear of its shape, on
    the meta device; `model.load_weights` then adopts what `quantize_projection_weights` made. `dtype`: the
    activations' (the model dtype); `grouped`: scales per group of GROUP input channels; `fast_accum`: the
    scaled_mm path's accumulation (device.fp8_fast_accum)."""
    scaled_mm = scaled_mm_supported(device, dtype)
    for layer in model.layers:
        for block in (layer.get_submodule("attn"), layer.get_submodule("mlp")):
            for name, child in list(block.named_children()):
                if isinstance(child, Projection):
                    out_features, in_features = child.weight.shape
                    with torch.device("meta"):
                        fp8 = FP8Linear(
                            in_features, out_features, child.bias is not None, scaled_mm, grouped, fast_accum
                        )
                    block.add_module(name, fp8)
        fuse_fp8_inputs(layer)


def fuse_fp8_inputs(layer: nn.Module, on: bool = True) -> None:
    """Let the kernels that feed a layer's FP8 projections quantize their output for them (fused/fp8_rows.py):
    the input norm for qkv, the post-attention norm for gate_up, SiLU-and-multiply for down, wherever that
    projection takes QuantizedRows. `on=False` turns it back off (the tests compare both ways)."""
    attn, mlp = layer.get_submodule("attn"), layer.get_submodule("mlp")
    for owner, projection in ((layer.get_submodule("input_norm"), attn.get_submodule("qkv")),
                              (layer.get_submodule("post_attn_norm"), mlp.get_submodule("gate_up")),
                              (mlp, mlp.get_submodule("down"))):  # fmt: skip
        setattr(owner, "fp8_rows", on and getattr(projection, "takes_fp8_rows", False))  # noqa: B010


def quantize_projection_weights(weights: dict[str, torch.Tensor], grouped: bool = False) -> None:
    """Quantize the projection weights of canonical `weights` in place: `layers.{i}.qkv.weight` becomes e4m3 and
    `layers.{i}.qkv.weight_scale` appears beside it (likewise o_proj, gate_up, down). Each original is dropped as
    its copy is made, so the peak is the unquantized weights plus one projection's FP8 copy. A projection that
    has its scale already (a pre-quantized checkpoint) is kept as stored: quantizing it again would round it.
    `grouped`: a scale per (row, group of GROUP input channels) instead of per row."""
    quantize = quantize_fp8_groups if grouped else quantize_fp8
    for name in [n for n in weights if is_projection_weight(n) and n + "_scale" not in weights]:
        weights[name], weights[name + "_scale"] = quantize(weights[name])
