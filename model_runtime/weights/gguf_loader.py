"""GGUF tensors, dequantized and renamed to Hugging Face names, as a `TensorSource`.

llama.cpp's converter reorders the rows of Q and K for llama-architecture files (its rotary kernel pairs dims
(2j, 2j+1) where Hugging Face pairs (j, j + D/2)); we undo that so the engine sees Hugging Face weights.
qwen2-architecture files are written without the reorder (llama.cpp runs them with NeoX-style rotary, which
pairs dims as Hugging Face does), so they are taken as stored; tests check both against transformers.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from model_runtime.config import ModelConfig
from model_runtime.weights.errors import ModelLoadError
from model_runtime.weights.gguf_file import GGUFFile, GGUFTensorInfo, read_tensor_bytes

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_PATTERN = re.compile(r"blk\.(\d+)\.(.+)")
_RAW_FLOAT_TYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None for tensors the engine has no use for."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_PATTERN.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    return None


class GGUFTensorSource:
    """Dequantizes one tensor, or one part of it (`get_part`), per call, so at most one float copy of what was
    asked for is alive at a time."""

    def __init__(self, gguf: GGUFFile, config: ModelConfig) -> None:
        self.where = str(gguf.path)
        self._gguf = gguf
        self._config = config
        self._by_hf_name: dict[str, GGUFTensorInfo] = {}
        for info in gguf.tensors.values():
            name = hf_name(info.name)
            self._by_hf_name[name if name is not None else f"<gguf>{info.name}"] = info

    def names(self) -> Iterable[str]:
        return self._by_hf_name.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return self._info(name).shape

    def get(self, name: str) -> torch.Tensor:
        values = dequantize_tensor(self._gguf, self._info(name))
        heads = self._permuted_heads(name)
        return torch.from_numpy(values if heads is None else unpermute_rows(values, heads))

    def get_part(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """`get(name)[start:stop]` along `dim` (0 or the last), dequantizing only the stored bytes that hold it.

        Q/K of a llama file: the reorder (unpermute_rows) stays inside each head of D rows, so Hugging Face rows
        [start, stop) lie in the same heads of the stored tensor. Those whole heads are read and unpermuted:

            stored  |h0: a0 b0 a1 b1 ..|h1: a0 b0 ..|h2 ..|     read heads start//D .. ceil(stop/D)
            HF      |h0: a0 a1 .. b0 b1|h1: a0 a1 ..|h2 ..|     unpermute them, keep [start, stop)
        """
        info = self._info(name)
        heads = self._permuted_heads(name)
        if heads is None or dim != 0:
            values = dequantize_part(self._gguf, info, dim, start, stop)
            # the reorder moves whole rows: a slice of columns holds every row, unpermuted as the whole tensor
            return torch.from_numpy(values if heads is None else unpermute_rows(values, heads))
        return torch.from_numpy(self._unpermuted_rows(info, heads, start, stop))

    def _unpermuted_rows(self, info: GGUFTensorInfo, heads: int, start: int, stop: int) -> np.ndarray:
        if info.shape[0] % (2 * heads):
            raise ModelLoadError(
                f"{self.where}: cannot unpermute {info.shape[0]} rows of {info.name} into {heads} heads"
            )
        if start == stop:
            return dequantize_part(self._gguf, info, 0, start, stop)
        d = info.shape[0] // heads
        first, last = start // d * d, -(-stop // d) * d
        values = unpermute_rows(dequantize_part(self._gguf, info, 0, first, last), (last - first) // d)
        return values[start - first : stop - first]

    def _info(self, name: str) -> GGUFTensorInfo:
        info = self._by_hf_name.get(name)
        if info is None:
            raise ModelLoadError(f"{self.where}: no GGUF tensor for {name}")
        return info

    def _permuted_heads(self, name: str) -> int | None:
        """The heads whose rows llama.cpp reordered in this tensor, or None when stored as Hugging Face has it."""
        if self._gguf.architecture != "llama":
            return None
        if name.endswith("q_proj.weight"):
            return self._config.num_heads
        if name.endswith("k_proj.weight"):
            return self._config.num_kv_heads
        return None


def dequantize_tensor(gguf: GGUFFile, info: GGUFTensorInfo) -> np.ndarray:
    """A tensor's values as a writable float array (float32, or float16 for F16) in torch-order shape."""
    return _decode(read_tensor_bytes(gguf.path, info), info.ggml_type, info.shape)


def dequantize_part(gguf: GGUFFile, info: GGUFTensorInfo, dim: int, start: int, stop: int) -> np.ndarray:
    """`dequantize_tensor(gguf, info)[start:stop]` along `dim` (0 or the last), from only the bytes that hold it.

    GGUF stores a tensor row-major, its last torch dim fastest, in blocks of B values (type_size bytes each)
    along each row (B = 1 for F32, F16 and BF16):

        row 0   [blk 0][blk 1][blk 2][blk 3]      row_bytes = columns / B * type_size
        row 1   [blk 0][blk 1][blk 2][blk 3]
        ...

    dim 0 (a column-parallel weight's rows, vocabulary rows, a bias's entries when B = 1): rows [start, stop) are
    bytes [start*row_bytes, stop*row_bytes), and only those are mapped and dequantized.
    Last dim (a row-parallel weight's input columns): every row's blocks [start // B, ceil(stop / B)) are copied
    out, dequantized and trimmed to [start, stop). The memory held is the part's plus under one block a row at
    either end; the mapping covers the whole tensor, so the page cache may read the pages around those blocks.
    """
    shape = info.shape
    if not (0 <= dim < len(shape) and 0 <= start <= stop <= shape[dim]):
        raise ValueError(f"{info.name}: no part [{start}, {stop}) along dim {dim} of shape {shape}")
    if dim == 0 and len(shape) > 1:
        row_bytes = info.nbytes // shape[0]
        raw = read_tensor_bytes(gguf.path, info, start * row_bytes, (stop - start) * row_bytes)
        return _decode(raw, info.ggml_type, (stop - start, *shape[1:]))
    if dim != len(shape) - 1:
        raise ValueError(f"{info.name}: a part is cut along dim 0 or the last dim, not dim {dim} of {shape}")
    block, type_size = GGML_QUANT_SIZES[info.ggml_type]
    first, last = start // block, -(-stop // block)
    rows = read_tensor_bytes(gguf.path, info).reshape(-1, shape[-1] // block * type_size)
    blocks = np.ascontiguousarray(rows[:, first * type_size : last * type_size])
    values = _decode(blocks, info.ggml_type, (*shape[:-1], (last - first) * block))
    return values[..., start - first * block : stop - first * block]


def _decode(raw: np.ndarray, ggml_type: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    """Contiguous bytes of whole rows of blocks -> a writable float array of `shape` (float16 for F16, else
    float32)."""
    if ggml_type in _RAW_FLOAT_TYPES:
        return raw.view(_RAW_FLOAT_TYPES[ggml_type]).reshape(shape).copy()
    if raw.size == 0:  # an empty part (a rank past the end of a small vocabulary): gguf cannot shape no rows
        return np.zeros(shape, dtype=np.float32)
    # BF16 and block-quantized types: rows of bytes in, rows of float32 out.
    rows = math.prod(shape[:-1])
    return dequantize(raw.reshape(rows, raw.size // rows), ggml_type).reshape(shape)


def unpermute_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order.

    Within each head of D rows, llama.cpp stores row (2j + t) what Hugging Face has at row (t*D/2 + j):
        HF rows   [a0 a1 .. a(D/2-1) | b0 b1 .. b(D/2-1)]    (the two halves rotary pairs up)
        GGUF rows [a0 b0 a1 b1 .. ]
    """
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise ModelLoadError(f"cannot unpermute {rows} rows into {n_heads} heads of even size")
    half = rows // n_heads // 2
    return weight.reshape(n_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
