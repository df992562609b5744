"""A tensor-parallel rank's weights: each rank reads and keeps only its slice, under the canonical fused names.

Every checkpoint format already serves tensors by Hugging Face name (canonical.TensorSource). `ShardedSource`
wraps a source that can read part of a tensor (`PartSource`) and cuts each tensor by `TPShard.piece_slice`;
`assemble` then builds the canonical tensors of the rank's local shape from those slices, as it builds a whole
model. What each format reads:

    safetensors   only the slice's bytes, from the memory map
    GGUF          only the slice's bytes for a cut along rows (q/k/v, gate/up, vocabulary); for a cut along
                  columns (o_proj, down) the quantization blocks holding the columns of every row
                  (gguf_loader.dequantize_part); a CPU load goes through the weight cache, one entry per shard
    dummy         each whole tensor drawn in the unsharded order, its slice kept, so rank r's weights are the
                  same rows as TP=1's for the same seed

So a checkpoint's rank holds its shard plus one slice being dequantized (dummy weights: plus one whole tensor),
and the full model exists nowhere.
"""

from __future__ import annotations

import gc
from typing import Protocol

import torch

from model_runtime.config import ModelConfig
from model_runtime.parallel.shard import PieceSlice, TPShard
from model_runtime.weights.canonical import ByteProgress, Piece, TensorSource, assemble, canonical_layout
from model_runtime.weights.dummy import iter_dummy_weights
from model_runtime.weights.errors import ModelLoadError
from model_runtime.weights.gguf_loader import GGUFTensorSource
from model_runtime.weights.hf import open_hf_checkpoint
from model_runtime.weights.source import ModelSource, SourceFormat
from model_runtime.weights.weight_cache import load_cached


class PartSource(TensorSource, Protocol):
    """A tensor source that reads a slice of a tensor without dequantizing or copying the rest."""

    def shape(self, name: str) -> tuple[int, ...]: ...

    def get_part(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor: ...


class ShardedSource:
    """`inner`'s tensors cut to one rank's slices (tensors every rank holds whole pass through)."""

    def __init__(self, inner: PartSource, model: ModelConfig, shard: TPShard) -> None:
        self.where = inner.where
        self._inner = inner
        self._shard = shard
        self._full_shapes = {
            piece.hf_name: piece.shape for pieces in canonical_layout(model).values() for piece in pieces
        }

    def names(self) -> list[str]:
        return list(self._inner.names())

    def get(self, name: str) -> torch.Tensor:
        cut = self._shard.piece_slice(name)
        if cut is None:
            return self._inner.get(name)
        self._check_shape(name, self._inner.shape(name))
        return _pad(self._inner.get_part(name, cut.dim, cut.start, cut.stop), cut)

    def _check_shape(self, name: str, shape: tuple[int, ...]) -> None:
        expected = self._full_shapes.get(name)
        if expected is not None and shape != expected:
            raise ModelLoadError(
                f"{self.where}: tensor {name} has shape {shape}, expected {expected} from the model config"
            )


def _pad(part: torch.Tensor, cut: PieceSlice) -> torch.Tensor:
    """The slice, with zero rows (or columns) appended up to `cut.size` (the last vocabulary shard)."""
    missing = cut.size - part.shape[cut.dim]
    if missing == 0:
        return part
    shape = list(part.shape)
    shape[cut.dim] = missing
    return torch.cat([part, part.new_zeros(shape)], dim=cut.dim)


def load_weight_shard(
    source: ModelSource,
    model: ModelConfig,
    shard: TPShard,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    progress: ByteProgress | None = None,
) -> dict[str, torch.Tensor]:
    """Canonical name -> this rank's slice, shaped for `shard.local_model(model)`, in `dtype` on `device`."""
    local = shard.local_model(model)
    if source.format is SourceFormat.DUMMY:
        return dummy_weight_shard(model, shard, dtype, device)
    if source.format is SourceFormat.GGUF:
        gguf = source.require_gguf()

        def cut() -> dict[str, torch.Tensor]:
            tensors = GGUFTensorSource(gguf, model)  # un-permutes Q/K rows by the model's heads
            return assemble(local, ShardedSource(tensors, model, shard), dtype, device, progress)

        weights = load_cached(gguf.path, model, dtype, device, cut, progress, shard)
    else:
        with open_hf_checkpoint(source, model) as tensors:
            sharded = ShardedSource(tensors, model, shard)
            weights = assemble(local, sharded, dtype, device, progress, fp8=source.fp8 is not None)
    gc.collect()
    return weights


def dummy_weight_shard(
    model: ModelConfig, shard: TPShard, dtype: torch.dtype, device: torch.device | str = "cpu", seed: int = 0
) -> dict[str, torch.Tensor]:
    """The rows of `dummy_weights(model, ...)` this rank holds, drawn one whole tensor at a time."""
    layout = canonical_layout(model)
    return {
        name: cut_fused(layout[name], whole, shard)
        for name, whole in iter_dummy_weights(model, dtype, device, seed)
    }


def cut_fused(pieces: list[Piece], whole: torch.Tensor, shard: TPShard) -> torch.Tensor:
    """A whole canonical tensor -> this rank's: split into its checkpoint pieces (q | k | v, gate | up), each
    cut by the checkpoint rule (`TPShard.piece_slice`), stacked again. A new tensor: `whole` can be freed."""
    parts = whole.split([piece.shape[0] for piece in pieces], dim=0)
    slices = []
    for piece, values in zip(pieces, parts):
        cut = shard.piece_slice(piece.hf_name)
        slices.append(
            values if cut is None else _pad(values.narrow(cut.dim, cut.start, cut.stop - cut.start), cut)
        )
    return torch.cat(slices, dim=0)
