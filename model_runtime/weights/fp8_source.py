"""A pre-quantized FP8 checkpoint's tensors, served the way `canonical.assemble(..., fp8=True)` fuses them.

    checkpoint                                   served here
    <proj>.weight        float8_e4m3fn [N, K]    as stored, byte for byte
    <proj>.weight_scale  [] or [1]   (tensor)    [N] float32: the one value, repeated for every row
                         [N, 1] or [N] (channel) [N] float32
    <proj>.input_scale   (static activations)    dropped, with one log line: FP8Linear quantizes activations per
                                                 token at run time (on CPU it does not quantize them at all); a
                                                 scale fitted to each token's own range is at least as accurate
                                                 as one calibrated scale for every token

So weight.float() * scale[:, None] is, row by row, what the checkpoint means by weight x weight_scale; fusing
q|k|v or gate|up stacks rows with their scales, which is exact. A tensor-parallel rank reads its rows' scales
(`get_part` along dim 0); a column cut (o_proj, down) keeps every row, so that rank takes the whole scale vector
(`TPShard.piece_slice` gives a scale no column cut).

Checked when opened, from the safetensors headers alone: every projection weight is float8_e4m3fn with a
weight_scale of a shape the config's strategy allows; nothing else is 8-bit (embeddings, norms and lm_head stay
in the model dtype); no FP8 KV-cache scales. A projection left unquantized (`ignore`) is refused, also when it is
one shard of a fused q|k|v or gate|up: an FP8Linear holds a whole fused matrix in FP8 or none of it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from model_runtime.config import ModelConfig
from model_runtime.weights.canonical import canonical_layout
from model_runtime.weights.errors import ModelLoadError
from model_runtime.weights.quant_config import FP8Checkpoint

if TYPE_CHECKING:
    from model_runtime.weights.hf import SafetensorsSource

log = logging.getLogger(__name__)

FP8_STORED = "F8_E4M3"  # safetensors' name of float8_e4m3fn
KV_CACHE_SCALES = (".k_scale", ".v_scale", ".kv_scale")
INPUT_SCALE = ".input_scale"
ONLY_PROJECTIONS = (
    "only the attention and MLP projections may be FP8: embeddings, norms and lm_head stay in the model dtype "
    "(the quantization_config's ignore lists them)"
)


class FP8CheckpointSource:
    """`inner`'s tensors with each projection's `weight_scale` as [rows] float32 and `input_scale`s left out."""

    def __init__(self, inner: SafetensorsSource, scheme: FP8Checkpoint, model: ModelConfig) -> None:
        self.where = inner.where
        self._inner = inner
        self._scheme = scheme
        names = list(inner.names())
        self._names = [n for n in names if not n.endswith(INPUT_SCALE)]
        self._rows: dict[str, int] = {}  # weight_scale name -> its weight's rows
        self._per_tensor: set[str] = set()  # the weight_scales holding one value for the whole weight
        layout = canonical_layout(model, fp8=True)
        scales = {p.hf_name for name, pieces in layout.items() if name.endswith("_scale") for p in pieces}
        self._check_names(set(self._names), scales)
        dropped = len(names) - len(self._names)
        if dropped:
            log.info(
                "%s: ignoring %d static input scales (input_scale): activations are quantized per token at run "
                "time instead, which is at least as accurate",
                self.where,
                dropped,
            )

    def names(self) -> Iterable[str]:
        return self._names

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._rows:
            return (self._rows[name],)
        return self._inner.shape(name)

    def get(self, name: str) -> torch.Tensor:
        if name in self._rows:
            return self._scale(name, 0, self._rows[name])
        return self._inner.get(name)

    def get_part(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        if name not in self._rows:
            return self._inner.get_part(name, dim, start, stop)
        if dim != 0:
            raise ValueError(
                f"{name}: a weight_scale is cut along its rows only (a column cut takes it whole)"
            )
        return self._scale(name, start, stop)

    def _scale(self, name: str, start: int, stop: int) -> torch.Tensor:
        if name in self._per_tensor:
            scale = self._inner.get(name).float().reshape(()).expand(stop - start).clone()
        else:
            scale = self._inner.get_part(name, 0, start, stop).float().reshape(-1)
        if not torch.isfinite(scale).all():
            raise ModelLoadError(f"{self.where}: tensor {name} holds a scale that is not finite")
        return scale

    # --- checks, from the headers ----------------------------------------------------------------------
    def _check_names(self, names: set[str], scales: set[str]) -> None:
        weights = {scale.removesuffix("_scale") for scale in scales}
        for name in sorted(names - weights):
            if name.endswith(KV_CACHE_SCALES):
                raise ModelLoadError(
                    f"{self.where}: tensor {name}: FP8 KV-cache scales are not supported (the KV cache is kept "
                    "in the model dtype)"
                )
            if name in scales:
                self._check_scale(name)
            elif name.endswith("_scale"):
                raise ModelLoadError(
                    f"{self.where}: tensor {name} is a quantization scale; {ONLY_PROJECTIONS}"
                )
            elif self._inner.dtype(name).startswith("F8"):
                raise ModelLoadError(
                    f"{self.where}: tensor {name} is stored as {self._inner.dtype(name)}; {ONLY_PROJECTIONS}"
                )
        for weight in sorted(weights & names):
            if weight + "_scale" not in names:
                raise self._unquantized(weight)

    def _unquantized(self, weight: str) -> ModelLoadError:
        stored = self._inner.dtype(weight)
        if stored.startswith("F8"):
            return ModelLoadError(
                f"{self.where}: tensor {weight} is stored as {stored} without a weight_scale"
            )
        ignore = self._scheme.ignore
        return ModelLoadError(
            f"{self.where}: tensor {weight} is not quantized (stored as {stored}, no weight_scale"
            f"{f'; quantization_config ignore: {list(ignore)}' if ignore else ''}): every q/k/v/o and gate/up/down "
            "projection must be FP8, since q|k|v and gate|up are each fused into one FP8 matrix"
        )

    def _check_scale(self, name: str) -> None:
        weight = name.removesuffix("_scale")
        stored = self._inner.dtype(weight)
        if stored != FP8_STORED:
            raise ModelLoadError(
                f"{self.where}: tensor {weight} is stored as {stored} beside its weight_scale; an FP8 weight must "
                f"be {FP8_STORED} (float8_e4m3fn)"
            )
        rows = self._inner.shape(weight)[0]
        shape = self._inner.shape(name)
        allowed = self._scheme.strategies
        if shape in ((), (1,)) and "tensor" in allowed:
            self._per_tensor.add(name)
        elif shape not in ((rows, 1), (rows,)) or "channel" not in allowed:
            raise ModelLoadError(
                f"{self.where}: tensor {name} has shape {list(shape)}, which the quantization_config's weight "
                f"strategy ({' or '.join(sorted(allowed))}) does not allow: [] or [1] per tensor, "
                f"[{rows}, 1] per channel"
            )
        self._rows[name] = rows
