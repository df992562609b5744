"""The engine's parameter names and shapes, and the one place that fuses checkpoint tensors into them.

    embed_tokens.weight            [V, H]
    layers.{i}.input_norm.weight   [H]
    layers.{i}.qkv.weight          [(Hq + 2*Hkv)*D, H]   rows: q | k | v
    layers.{i}.qkv.bias            [(Hq + 2*Hkv)*D]      only when config.attention_bias
    layers.{i}.o_proj.weight       [H, Hq*D]
    layers.{i}.post_attn_norm.weight [H]
    layers.{i}.gate_up.weight      [2*I, H]              rows: gate | up
    layers.{i}.down.weight         [H, I]
    norm.weight                    [H]
    lm_head.weight                 [V, H]                absent when tie_word_embeddings

With `device.quantization: fp8` the four projection weights (qkv, o_proj, gate_up, down) become float8_e4m3fn
after the load, each with `layers.{i}.<projection>.weight_scale` [rows] float32 beside it (model_runtime.quantization).
A pre-quantized FP8 checkpoint (`assemble(..., fp8=True)`) has them so from the start: its fp8 rows are fused as
stored, byte for byte, and each scale entry is its pieces' per-row scales stacked (q | k | v, gate | up).

Every format hands `assemble` a `TensorSource` that serves tensors by their Hugging Face name in torch layout;
`assemble` allocates each output once, in the target dtype on the target device, and copies the pieces in, so a
bf16 checkpoint never passes through fp32 and the full model never exists twice.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from model_runtime.config import ModelConfig
from model_runtime.weights.errors import ModelLoadError

# Tensors a checkpoint may carry that the engine recomputes or does not need.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
PROJECTIONS = ("qkv", "o_proj", "gate_up", "down")  # layers.{i}.<projection>.weight: the quantizable ones
FP8_DTYPE = torch.float8_e4m3fn  # FP8 weights and the FP8 KV cache alike
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448: e4m3fn's largest finite value
# The smallest scale a row max / 448 may give: an all-zero row still gets a positive one (nothing divides by zero).
FP8_MIN_SCALE = torch.finfo(torch.float32).tiny
ByteProgress = Callable[[int, int], None]  # (bytes loaded so far, bytes in all)


class TensorSource(Protocol):
    """Serves a checkpoint's tensors under Hugging Face names (`model.layers.0.self_attn.q_proj.weight`)."""

    where: str  # the file or directory, for error messages

    def names(self) -> Iterable[str]: ...

    def get(self, name: str) -> torch.Tensor: ...


@dataclass(frozen=True)
class Piece:
    """One checkpoint tensor and the shape it must have."""

    hf_name: str
    shape: tuple[int, ...]


def canonical_layout(config: ModelConfig, fp8: bool = False) -> dict[str, list[Piece]]:
    """Canonical name -> the checkpoint pieces stacked (on dim 0, in order) to make it. `fp8`: the projections
    come with their per-row scales, `<projection>.weight_scale` from the pieces' `weight_scale`s."""
    h, i_size, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.q_size, config.kv_size
    layout: dict[str, list[Piece]] = {"embed_tokens.weight": [Piece("model.embed_tokens.weight", (v, h))]}
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        attn = hf + "self_attn."
        layout[ours + "input_norm.weight"] = [Piece(hf + "input_layernorm.weight", (h,))]
        layout[ours + "qkv.weight"] = [
            Piece(attn + "q_proj.weight", (q, h)),
            Piece(attn + "k_proj.weight", (kv, h)),
            Piece(attn + "v_proj.weight", (kv, h)),
        ]
        if config.attention_bias:
            layout[ours + "qkv.bias"] = [
                Piece(attn + "q_proj.bias", (q,)),
                Piece(attn + "k_proj.bias", (kv,)),
                Piece(attn + "v_proj.bias", (kv,)),
            ]
        layout[ours + "o_proj.weight"] = [Piece(attn + "o_proj.weight", (h, q))]
        layout[ours + "post_attn_norm.weight"] = [Piece(hf + "post_attention_layernorm.weight", (h,))]
        layout[ours + "gate_up.weight"] = [
            Piece(hf + "mlp.gate_proj.weight", (i_size, h)),
            Piece(hf + "mlp.up_proj.weight", (i_size, h)),
        ]
        layout[ours + "down.weight"] = [Piece(hf + "mlp.down_proj.weight", (h, i_size))]
    layout["norm.weight"] = [Piece("model.norm.weight", (h,))]
    if not config.tie_word_embeddings:
        layout["lm_head.weight"] = [Piece("lm_head.weight", (v, h))]
    if fp8:
        for name in [n for n in layout if is_projection_weight(n)]:
            layout[name + "_scale"] = [Piece(p.hf_name + "_scale", p.shape[:1]) for p in layout[name]]
    return layout


def is_projection_weight(name: str) -> bool:
    """Whether canonical `name` is a projection's weight (layers.{i}.qkv.weight, ...), the tensors FP8 holds."""
    parts = name.split(".")
    return len(parts) == 4 and parts[0] == "layers" and parts[2] in PROJECTIONS and parts[3] == "weight"


def canonical_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape of the fused tensor."""
    return {name: _stacked_shape(pieces) for name, pieces in canonical_layout(config).items()}


def assemble(
    config: ModelConfig,
    source: TensorSource,
    dtype: torch.dtype,
    device: torch.device | str,
    progress: ByteProgress | None = None,
    fp8: bool = False,
) -> dict[str, torch.Tensor]:
    """Build every canonical tensor from `source`; unknown checkpoint tensors are errors, not silently dropped.
    `progress(done_bytes, total_bytes)` is called after each tensor (a 70B load takes minutes). `fp8`: the
    source is a pre-quantized checkpoint (weights.fp8_source): projections stay float8_e4m3fn, with their
    float32 `weight_scale`s; everything else is in `dtype`."""
    layout = canonical_layout(config, fp8)
    _reject_unknown_tensors(config, source, layout)
    dtypes = {name: _entry_dtype(name, dtype, fp8) for name in layout}
    sizes = {
        name: math.prod(_stacked_shape(pieces)) * dtypes[name].itemsize for name, pieces in layout.items()
    }
    total, done = sum(sizes.values()), 0
    out: dict[str, torch.Tensor] = {}
    for name, pieces in layout.items():
        out[name] = _fuse(pieces, source.get, source.where, dtypes[name], device)
        done += sizes[name]
        if progress is not None:
            progress(done, total)
    return out


def _entry_dtype(name: str, dtype: torch.dtype, fp8: bool) -> torch.dtype:
    if fp8 and is_projection_weight(name):
        return FP8_DTYPE
    if fp8 and name.endswith(".weight_scale"):
        return torch.float32
    return dtype


def _fuse(
    pieces: list[Piece],
    get: Callable[[str], torch.Tensor],
    where: str,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    target = torch.empty(_stacked_shape(pieces), dtype=dtype, device=device)
    row = 0
    for piece in pieces:
        tensor = get(piece.hf_name)
        if tuple(tensor.shape) != piece.shape:
            raise ModelLoadError(
                f"{where}: tensor {piece.hf_name} has shape {tuple(tensor.shape)}, expected {piece.shape} "
                "from the model config"
            )
        stored_fp8 = tensor.dtype.is_floating_point and tensor.dtype.itemsize == 1
        if stored_fp8 != (dtype == FP8_DTYPE) or (stored_fp8 and tensor.dtype != dtype):
            # fp8 values copied into a wider dtype lose their scale; wider ones copied into fp8 get rounded.
            raise ModelLoadError(
                f"{where}: tensor {piece.hf_name} is stored as {tensor.dtype}, expected {dtype} here (an FP8 "
                "weight needs config.json's quantization_config; only projections may be FP8)"
            )
        target[row : row + piece.shape[0]].copy_(tensor)
        row += piece.shape[0]
        del tensor  # drop the (possibly dequantized fp32) intermediate before reading the next piece
    return target


def _stacked_shape(pieces: list[Piece]) -> tuple[int, ...]:
    return (sum(p.shape[0] for p in pieces), *pieces[0].shape[1:])


def _reject_unknown_tensors(
    config: ModelConfig, source: TensorSource, layout: dict[str, list[Piece]]
) -> None:
    expected = {piece.hf_name for pieces in layout.values() for piece in pieces}
    if config.tie_word_embeddings:
        expected.add("lm_head.weight")  # some tied checkpoints still store a copy; it is not used
    unknown = sorted(
        name for name in source.names() if name not in expected and not name.endswith(IGNORED_SUFFIXES)
    )
    if unknown:
        shown = ", ".join(unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        raise ModelLoadError(
            f"{source.where}: tensors the model config does not account for: {shown} "
            "(an unsupported feature such as biases, or a config that does not match the weights)"
        )
