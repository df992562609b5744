"""A GGUF file's metadata and tensor index, read once (no torch here: the tokenizer uses it too).

The header is parsed once (`gguf_header.read_gguf_header`: struct, not `gguf.GGUFReader`, which spends seconds on
the 100k tokenizer strings) into a `GGUFFile` of plain Python values plus each tensor's byte range. The weight
loader then maps just those byte ranges (`read_tensor_bytes`) instead of parsing the file again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import numpy as np
from gguf import GGMLQuantizationType

from model_runtime.weights.errors import ModelLoadError
from model_runtime.weights.gguf_header import RawTensor, read_gguf_header

SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2")
SUPPORTED_TENSOR_TYPES = (
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
)

GGUFValue = str | int | float | bool | list[str] | list[int] | list[float] | list[bool]


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor: its type, its torch-order shape (GGUF lists dims fastest first) and where its bytes lie."""

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True, eq=False)
class GGUFFile:
    """Parsed metadata and tensor index of one GGUF file."""

    path: Path
    architecture: str
    metadata: Mapping[str, GGUFValue]
    tensors: Mapping[str, GGUFTensorInfo]

    @classmethod
    def open(cls, path: Path) -> GGUFFile:
        """Parse `path`; any unreadable, truncated or unsupported file raises `ModelLoadError`."""
        try:
            header = read_gguf_header(path)
        except Exception as exc:  # GGUFHeaderError, OSError, UnicodeDecodeError... on bad bytes
            raise ModelLoadError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
        metadata = header.metadata
        tensors = {t.name: _tensor_info(t) for t in header.tensors}
        arch = metadata.get("general.architecture")
        if arch not in SUPPORTED_GGUF_ARCHITECTURES:
            raise ModelLoadError(
                f"{path}: GGUF architecture {arch!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
            )
        gguf = cls(path, str(arch), MappingProxyType(metadata), MappingProxyType(tensors))
        gguf._check_tensors()
        return gguf

    def _check_tensors(self) -> None:
        size = self.path.stat().st_size
        for info in self.tensors.values():
            if info.ggml_type not in SUPPORTED_TENSOR_TYPES:
                supported = ", ".join(t.name for t in SUPPORTED_TENSOR_TYPES)
                raise ModelLoadError(
                    f"{self.path}: tensor {info.name} has type {info.ggml_type.name}, which is not supported; "
                    f"supported: {supported}"
                )
            if info.offset + info.nbytes > size:
                raise ModelLoadError(
                    f"{self.path}: tensor {info.name} ends at byte {info.offset + info.nbytes} but the file has "
                    f"{size} bytes (truncated file?)"
                )

    def has(self, key: str) -> bool:
        return key in self.metadata

    def get_int(self, key: str, default: int | None = None) -> int:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ModelLoadError(f"{self.path}: metadata {key} must be an integer, got {value!r}")
        return value

    def get_float(self, key: str, default: float | None = None) -> float:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ModelLoadError(f"{self.path}: metadata {key} must be a number, got {value!r}")
        return float(value)

    def get_bool(self, key: str, default: bool | None = None) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise ModelLoadError(f"{self.path}: metadata {key} must be a boolean, got {value!r}")
        return value

    def get_str(self, key: str, default: str | None = None) -> str:
        value = self._get(key, default)
        if not isinstance(value, str):
            raise ModelLoadError(f"{self.path}: metadata {key} must be a string, got {value!r}")
        return value

    def get_list(self, key: str) -> list[str] | list[int] | list[float] | list[bool]:
        value = self._get(key, None)
        if not isinstance(value, list):
            raise ModelLoadError(f"{self.path}: metadata {key} must be an array, got {type(value).__name__}")
        return value

    def arch_key(self, suffix: str) -> str:
        """`{arch}.{suffix}`, e.g. `llama.block_count`."""
        return f"{self.architecture}.{suffix}"

    def _get(self, key: str, default: object) -> object:
        if key in self.metadata:
            return self.metadata[key]
        if default is None:
            raise ModelLoadError(f"{self.path}: metadata key {key} is missing")
        return default


def read_tensor_bytes(
    path: Path, info: GGUFTensorInfo, first: int = 0, count: int | None = None
) -> np.ndarray:
    """Bytes [first, first + count) of one tensor (all of them by default) as a read-only uint8 memmap view of
    just that range (freed with the last reference)."""
    count = info.nbytes - first if count is None else count
    if first < 0 or count < 0 or first + count > info.nbytes:
        raise ValueError(f"{info.name}: bytes [{first}, {first + count}) are outside its {info.nbytes} bytes")
    return np.memmap(path, dtype=np.uint8, mode="r", offset=info.offset + first, shape=(count,))


def _tensor_info(tensor: RawTensor) -> GGUFTensorInfo:
    return GGUFTensorInfo(
        name=tensor.name,
        ggml_type=tensor.ggml_type,
        shape=tuple(reversed(tensor.dims)),
        offset=tensor.data_offset,
        nbytes=tensor.nbytes,
    )
