"""Model sources: resolve a spec, read its config, load its weights (tokenizers live in model_runtime.tokenizer).

    source = resolve_model("smollm2-135m-instruct")   # or an HF dir, a .gguf file, "dummy:llama-3-8b"
    config = load_model_config(source)                 # model_runtime.config.ModelConfig
    weights = load_weights(source, config, torch.bfloat16, "cuda")   # canonical fused names, see canonical.py

Module map: source.py (specs -> ModelSource), config_loading.py (ModelConfig), gguf_file.py (GGUF metadata and
tensor index; gguf_header.py parses the bytes), canonical.py (engine names, fusing), hf.py / gguf_loader.py /
dummy.py (one per format), quant_config.py (an HF checkpoint's FP8 quantization_config) and fp8_source.py (its
FP8 tensors and scales, checked and served for fusing), weight_cache.py (a GGUF's dequantized tensors on disk, whole or one tensor-parallel
shard; CPU), shapes.py (named dummy shapes), gguf_vocab.py (a GGUF's tokenizer), dummy_vocab.py (the dummy
shapes' byte-level tokenizer). Importing this package does not import torch: the router resolves models for
their tokenizer alone. `load_weights` imports it when called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from model_runtime.weights.config_loading import load_model_config
from model_runtime.weights.errors import ModelLoadError
from model_runtime.weights.shapes import DUMMY_SHAPES
from model_runtime.weights.source import EMBEDDED_MODEL, ModelSource, SourceFormat, resolve_model

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from model_runtime.config import ModelConfig


def load_weights(
    source: ModelSource,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Canonical name -> tensor in `dtype` on `device` (see model_runtime.weights.canonical for the names);
    `progress(done_bytes, total_bytes)` follows the load."""
    from model_runtime.weights.loading import load_weights as load

    return load(source, config, dtype, device, progress)


__all__ = [
    "DUMMY_SHAPES",
    "EMBEDDED_MODEL",
    "ModelLoadError",
    "ModelSource",
    "SourceFormat",
    "load_model_config",
    "load_weights",
    "resolve_model",
]
