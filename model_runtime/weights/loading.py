"""`load_weights`: any `ModelSource` -> the engine's canonical fused tensors (see canonical.py)."""

from __future__ import annotations

import gc

import torch

from model_runtime.config import ModelConfig
from model_runtime.weights.canonical import ByteProgress, assemble
from model_runtime.weights.dummy import dummy_weights
from model_runtime.weights.gguf_loader import GGUFTensorSource
from model_runtime.weights.hf import open_hf_checkpoint
from model_runtime.weights.source import ModelSource, SourceFormat
from model_runtime.weights.weight_cache import load_cached


def load_weights(
    source: ModelSource,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    progress: ByteProgress | None = None,
) -> dict[str, torch.Tensor]:
    """Canonical name -> tensor in `dtype` on `device`; raises `ModelLoadError` naming the file and tensor.
    `progress(done_bytes, total_bytes)` follows a checkpoint's load (dummy weights are made at once)."""
    if source.format is SourceFormat.DUMMY:
        return dummy_weights(config, dtype, device)
    if source.format is SourceFormat.GGUF:
        gguf = source.require_gguf()

        def dequantize() -> dict[str, torch.Tensor]:
            return assemble(config, GGUFTensorSource(gguf, config), dtype, device, progress)

        weights = load_cached(gguf.path, config, dtype, device, dequantize, progress)  # CPU starts only
    else:
        with open_hf_checkpoint(source, config) as tensors:
            weights = assemble(config, tensors, dtype, device, progress, fp8=source.fp8 is not None)
    gc.collect()  # return the dequantization buffers and mmaps now, not at some later collection
    return weights
