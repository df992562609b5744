"""A GGUF file's header (metadata and tensor index) parsed with `struct`, without `gguf.GGUFReader`.

`GGUFReader` builds a numpy memmap view for every scalar of the header: on SmolLM2's file (49k vocabulary
strings, 49k merges) that is about 5 s of CPU, paid by every process that opens the model (each worker, the
router, the test process). Reading the same bytes with `struct.unpack_from` takes a few hundred milliseconds.
The values are what `ReaderField.contents()` gives (Python str, int, float, bool; arrays as flat lists, nested
arrays flattened as the reader does), and the checks are the reader's (magic, version 2 or 3, duplicate keys
or tensors, the alignment, known value and tensor types), so the two accept the same files.

    header layout (little-endian, or all big-endian; u64 lengths):
        magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
        n_kv x      (string key, u32 value type, value)
        n_tensors x (string name, u32 n_dims, u64 dims[n_dims] (fastest first), u32 ggml type, u64 offset)
        padding to `general.alignment` (default 32), then the tensor data; offsets are relative to it
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType

SUPPORTED_VERSIONS = (2, 3)
STRING, ARRAY, UINT32 = 8, 9, 4
# GGUFValueType -> struct code of a scalar (STRING and ARRAY are read by hand).
SCALAR_CODES = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

HeaderValue = str | int | float | bool | list


class GGUFHeaderError(ValueError):
    """The bytes are not a GGUF header this reader can take (the message says where and why)."""


@dataclass(frozen=True)
class RawTensor:
    """One tensor-info entry: `dims` as stored (fastest first), `data_offset` absolute in the file."""

    name: str
    ggml_type: GGMLQuantizationType
    dims: tuple[int, ...]
    data_offset: int
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    metadata: dict[str, HeaderValue]
    tensors: list[RawTensor]


class _Cursor:
    """Reads the header front to back; every read is bounds-checked."""

    def __init__(self, data: mmap.mmap | bytes, order: str) -> None:
        self.data, self.order, self.offset = data, order, 0

    def take(self, code: str, count: int = 1) -> tuple:
        fmt = f"{self.order}{count}{code}"
        size = struct.calcsize(fmt)
        if self.offset + size > len(self.data):
            raise GGUFHeaderError(f"header ends early at byte {self.offset} (truncated file?)")
        values = struct.unpack_from(fmt, self.data, self.offset)
        self.offset += size
        return values

    def string(self) -> str:
        (length,) = self.take("Q")
        end = self.offset + length
        if end > len(self.data):
            raise GGUFHeaderError(f"a string of {length} bytes at byte {self.offset} runs past the end")
        text = str(self.data[self.offset : end], encoding="utf-8")
        self.offset = end
        return text

    def value(self, value_type: int) -> HeaderValue:
        if value_type == STRING:
            return self.string()
        if value_type == ARRAY:
            (item_type,) = self.take("I")
            (count,) = self.take("Q")
            return self.array(item_type, count)
        code = SCALAR_CODES.get(value_type)
        if code is None:
            raise GGUFHeaderError(f"unknown value type {value_type} at byte {self.offset}")
        return self.take(code)[0]

    def array(self, item_type: int, count: int) -> list:
        code = SCALAR_CODES.get(item_type)
        if code is not None:
            return list(self.take(code, count))
        items: list = []
        for _ in range(count):
            item = self.value(item_type)
            if isinstance(item, list):  # nested arrays come out flat, as GGUFReader gives them
                items.extend(item)
            else:
                items.append(item)
        return items


def read_gguf_header(path: Path) -> GGUFHeader:
    """Parse the header of `path`; raises `GGUFHeaderError` (or OSError) on a file it cannot take."""
    with open(path, "rb") as file:
        if file.seek(0, 2) == 0:
            raise GGUFHeaderError("empty file")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _parse(data)


def _parse(data: mmap.mmap | bytes) -> GGUFHeader:
    cursor = _Cursor(data, "<")
    if cursor.take("I")[0] != GGUF_MAGIC:
        raise GGUFHeaderError("GGUF magic invalid")
    (version,) = cursor.take("I")
    if version & 0xFFFF == 0:  # written on a machine of the other byte order
        cursor.order = ">"
        version = int.from_bytes(version.to_bytes(4, "little"), "big")
    if version not in SUPPORTED_VERSIONS:
        raise GGUFHeaderError(f"version {version} is not supported (2 or 3)")
    n_tensors, n_kv = cursor.take("Q", 2)
    metadata: dict[str, HeaderValue] = {
        "GGUF.version": version,
        "GGUF.tensor_count": n_tensors,
        "GGUF.kv_count": n_kv,
    }
    types: dict[str, int] = {}
    for _ in range(n_kv):
        key = cursor.string()
        (types[key],) = cursor.take("I")
        if key in metadata:
            raise GGUFHeaderError(f"duplicate metadata key {key}")
        metadata[key] = cursor.value(types[key])
    entries = [_tensor_entry(cursor) for _ in range(n_tensors)]
    alignment = _alignment(metadata, types)
    start = cursor.offset + (-cursor.offset % alignment)
    return GGUFHeader(metadata, _tensors(entries, start))


def _tensor_entry(cursor: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cursor.string()
    (n_dims,) = cursor.take("I")
    dims = cursor.take("Q", n_dims)
    (raw_type,) = cursor.take("I")
    (offset,) = cursor.take("Q")
    return name, dims, raw_type, offset


def _alignment(metadata: dict[str, HeaderValue], types: dict[str, int]) -> int:
    if "general.alignment" not in metadata:
        return GGUF_DEFAULT_ALIGNMENT
    alignment = metadata["general.alignment"]
    if types["general.alignment"] != UINT32 or not isinstance(alignment, int):
        raise GGUFHeaderError("general.alignment must be a uint32")
    if alignment == 0 or alignment & (alignment - 1):
        raise GGUFHeaderError(f"general.alignment {alignment} is not a power of two")
    return alignment


def _tensors(entries: list[tuple[str, tuple[int, ...], int, int]], start: int) -> list[RawTensor]:
    tensors: list[RawTensor] = []
    seen: set[str] = set()
    for name, dims, raw_type, offset in entries:
        if name in seen:
            raise GGUFHeaderError(f"duplicate tensor {name}")
        seen.add(name)
        try:
            ggml_type = GGMLQuantizationType(raw_type)
        except ValueError as exc:
            raise GGUFHeaderError(f"tensor {name} has unknown GGML type {raw_type}") from exc
        block, type_size = GGML_QUANT_SIZES[ggml_type]
        if dims and dims[0] % block:
            raise GGUFHeaderError(
                f"tensor {name}: row of {dims[0]} values is not whole {ggml_type.name} blocks"
            )
        elements = 1
        for dim in dims:
            elements *= dim
        tensors.append(RawTensor(name, ggml_type, tuple(dims), start + offset, elements * type_size // block))
    return tensors
