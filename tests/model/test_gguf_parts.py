"""Reading part of a GGUF tensor (a tensor-parallel rank's rows or columns): the part equals the same slice of
the whole tensor's dequantization for every type the loader supports, llama's Q/K rows land on the right heads,
and a rank of a sharded load dequantizes only its own bytes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from model_runtime.config import ParallelConfig
from model_runtime.parallel.shard import TPShard
from model_runtime.parallel.weights import cut_fused, load_weight_shard
from model_runtime.weights import gguf_loader, load_model_config, load_weights, resolve_model
from model_runtime.weights.canonical import canonical_layout
from model_runtime.weights.gguf_file import SUPPORTED_TENSOR_TYPES, GGUFFile, GGUFTensorInfo
from model_runtime.weights.gguf_loader import GGUFTensorSource
from model_runtime.weights.weight_cache import CACHE_DIR_ENV
from tests.model.tiny_models import tiny_hf_model, write_tiny_gguf

pytestmark = pytest.mark.model


def open_source(path: Path) -> GGUFTensorSource:
    source = resolve_model(str(path))
    return GGUFTensorSource(source.require_gguf(), load_model_config(source))


def ranges(size: int) -> list[tuple[int, int]]:
    """Halves (TP=2), quarters (TP=4), a range that starts and ends inside quantization blocks, and none."""
    quarter = size // 4
    return [
        (0, size // 2),
        (size // 2, size),
        (quarter, 2 * quarter),
        (5, min(size, 37)),
        (size, size),
    ]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("qtype", SUPPORTED_TENSOR_TYPES, ids=lambda q: q.name)
def test_a_part_is_the_same_slice_of_the_whole_tensor(tmp_path: Path, arch: str, qtype: Q) -> None:
    """Every tensor of a file of `qtype` (norms and biases stay F32), cut along rows and along columns."""
    tensors = open_source(write_tiny_gguf(tmp_path, arch, qtypes=(qtype,)))
    for name in tensors.names():
        whole = tensors.get(name)
        for dim in range(whole.dim()):
            for start, stop in ranges(whole.shape[dim]):
                part = tensors.get_part(name, dim, start, stop)
                expected = whole.narrow(dim, start, stop - start)
                assert part.dtype == expected.dtype and torch.equal(part, expected), (name, dim, start, stop)


def test_llama_q_k_rows_of_a_part_are_the_hugging_face_rows(tmp_path: Path) -> None:
    """An F32 file holds the model's values exactly, so a part of q/k (stored in llama.cpp's per-head order) must
    equal the Hugging Face rows it claims to be: whole heads, and ranges that start or end inside a head."""
    tensors = open_source(write_tiny_gguf(tmp_path, "llama", qtypes=(Q.F32,)))
    state = tiny_hf_model("llama").state_dict()
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
        rows = state[name].shape[0]  # head_dim 16: q has 4 heads, k 2
        for start, stop in [(0, rows // 2), (rows // 2, rows), (16, 32), (3, 21), (17, 18)]:
            part = tensors.get_part(name, 0, start, stop)
            assert torch.equal(part, state[name][start:stop]), (name, start, stop)


def test_a_rank_dequantizes_only_its_part(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At TP=2 the two ranks' parts of the tiny model split every Q8_0 tensor exactly (row cuts, and column cuts
    on 32-value block boundaries), so their dequantized bytes must add up to the file's, once; whole tensors are
    read only for the norms; and each rank holds TP=1's rows."""
    monkeypatch.setenv(CACHE_DIR_ENV, "")  # the cache off: every load dequantizes
    path = write_tiny_gguf(tmp_path, "llama", qtypes=(Q.Q8_0,))
    source = resolve_model(str(path))
    model = load_model_config(source)
    whole = load_weights(source, model, torch.float32)
    quantized = sum(t.nbytes for t in source.require_gguf().tensors.values() if t.ggml_type == Q.Q8_0)

    dequantized: list[int] = []
    read_whole: list[str] = []
    dequantize, dequantize_tensor = gguf_loader.dequantize, gguf_loader.dequantize_tensor

    def count(raw: np.ndarray, qtype: Q) -> np.ndarray:
        dequantized.append(raw.nbytes)
        return dequantize(raw, qtype)

    def record(gguf: GGUFFile, info: GGUFTensorInfo) -> np.ndarray:
        read_whole.append(info.name)
        return dequantize_tensor(gguf, info)

    monkeypatch.setattr(gguf_loader, "dequantize", count)
    monkeypatch.setattr(gguf_loader, "dequantize_tensor", record)
    layout = canonical_layout(model)
    per_rank = []
    for rank in range(2):
        dequantized.clear()
        shard = TPShard.plan(model, ParallelConfig(2), rank)
        ours = load_weight_shard(source, model, shard, torch.float32)
        per_rank.append(sum(dequantized))
        for name, tensor in ours.items():
            torch.testing.assert_close(tensor, cut_fused(layout[name], whole[name], shard), rtol=0, atol=0)
    assert read_whole and all(name.endswith("norm.weight") for name in read_whole), read_whole
    assert sum(per_rank) == quantized and all(0 < n < quantized for n in per_rank), (per_rank, quantized)
