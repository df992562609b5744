"""Hugging Face safetensors checkpoints (single file or sharded) as a `TensorSource`; a pre-quantized FP8 one
through `fp8_source.FP8CheckpointSource` (`open_hf_checkpoint`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from model_runtime.config import ModelConfig
from model_runtime.weights.errors import ModelLoadError
from model_runtime.weights.fp8_source import FP8CheckpointSource
from model_runtime.weights.source import ModelSource


class SafetensorsSource:
    """Tensors of one or more safetensors files, read lazily (each file is memory-mapped, not copied)."""

    def __init__(self, directory: Path, files: tuple[Path, ...], handles: dict[str, Any]) -> None:
        self.where = str(directory)
        self._files = files
        self._handles = handles  # tensor name -> the open safe_open handle of the file that holds it

    def names(self) -> Iterable[str]:
        return self._handles.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The stored dtype as safetensors names it (BF16, F32, F8_E4M3, ...), from the header."""
        return str(self._handle(name).get_slice(name).get_dtype())

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def get_part(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """[start, stop) along `dim` (0 or 1) of a tensor, read from its file without reading the rest (a
        tensor-parallel rank's slice)."""
        part = self._handle(name).get_slice(name)
        index = (slice(start, stop),) if dim == 0 else (slice(None), slice(start, stop))
        return part[index]  # type: ignore[no-any-return]

    def _handle(self, name: str) -> Any:
        handle = self._handles.get(name)
        if handle is None:
            raise ModelLoadError(f"{self.where}: tensor {name} is missing from the safetensors files")
        return handle


@contextlib.contextmanager
def open_safetensors(directory: Path, files: tuple[Path, ...]) -> Iterator[SafetensorsSource]:
    """Open every file for the duration of the `with` block; the mmaps are closed on exit."""
    with contextlib.ExitStack() as stack:
        handles: dict[str, Any] = {}
        for file in files:
            try:
                handle = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            except Exception as exc:  # SafetensorError or OSError
                raise ModelLoadError(f"{file}: not a readable safetensors file ({exc})") from exc
            names: list[str] = handle.keys()  # a safe_open handle is not iterable
            for name in names:
                if name in handles:
                    raise ModelLoadError(f"{file}: tensor {name} also appears in another shard")
                handles[name] = handle
        yield SafetensorsSource(directory, files, handles)


@contextlib.contextmanager
def open_hf_checkpoint(
    source: ModelSource, model: ModelConfig
) -> Iterator[SafetensorsSource | FP8CheckpointSource]:
    """`open_safetensors` of an HF source; a pre-quantized FP8 one (`source.fp8`) checked and served through
    FP8CheckpointSource, for `assemble(..., fp8=True)`. `model`: the whole model's config (not a rank's)."""
    with open_safetensors(source.require_path(), source.weight_files) as tensors:
        yield tensors if source.fp8 is None else FP8CheckpointSource(tensors, source.fp8, model)
