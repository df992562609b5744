"""GGUF tensors, dequantized and renamed to Hugging Face names, as a `TensorSource`.

llama.cpp's converter reorders the rows of Q and K for llama-architecture files (its rotary kernel pairs dims
(2j, 2j+1) where Hugging Face pairs (j, j + D/2)); we undo that so the engine sees Hugging Face weights.
qwen2-architecture files are written without the reorder (llama.cpp runs them with NeoX-style rotary, which
pairs dims as Hugging Face does), so they are taken as stored; tests check both against transformers.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import numpy as np
import torch
from gguf import GGMLQuantizationType
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
    """Dequantizes one tensor per `get`, so at most one fp32 copy of a tensor is alive at a time."""

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

    def get(self, name: str) -> torch.Tensor:
        info = self._by_hf_name.get(name)
        if info is None:
            raise ModelLoadError(f"{self.where}: no GGUF tensor for {name}")
        values = dequantize_tensor(self._gguf, info)
        if self._gguf.architecture == "llama":
            if name.endswith("q_proj.weight"):
                values = unpermute_rows(values, self._config.num_heads)
            elif name.endswith("k_proj.weight"):
                values = unpermute_rows(values, self._config.num_kv_heads)
        return torch.from_numpy(values)


def dequantize_tensor(gguf: GGUFFile, info: GGUFTensorInfo) -> np.ndarray:
    """A tensor's values as a writable float array (float32, or float16 for F16) in torch-order shape."""
    raw = read_tensor_bytes(gguf.path, info)
    if info.ggml_type in _RAW_FLOAT_TYPES:
        return raw.view(_RAW_FLOAT_TYPES[info.ggml_type]).reshape(info.shape).copy()
    # BF16 and block-quantized types: rows of bytes in, rows of float32 out.
    row_bytes = info.nbytes // int(np.prod(info.shape[:-1], dtype=np.int64))
    return dequantize(raw.reshape(*info.shape[:-1], row_bytes), info.ggml_type).reshape(info.shape)


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
