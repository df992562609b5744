"""The weight cache: a second load of a GGUF reads the canonical tensors back bit for bit without dequantizing,
a bad entry is rebuilt, another dtype or other file content is another entry, each tensor-parallel shard is an
entry of its own, and an empty TANDEM_CACHE_DIR turns it off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from model_runtime.config import ParallelConfig
from model_runtime.parallel.shard import TPShard
from model_runtime.parallel.weights import cut_fused, load_weight_shard
from model_runtime.weights import gguf_loader, load_model_config, load_weights, resolve_model
from model_runtime.weights.canonical import canonical_layout
from model_runtime.weights.weight_cache import CACHE_DIR_ENV
from tests.model.tiny_models import write_tiny_gguf

pytestmark = pytest.mark.model


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "cache"
    monkeypatch.setenv(CACHE_DIR_ENV, str(directory))
    return directory / "weights"


def load(path: Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    source = resolve_model(str(path))
    return load_weights(source, load_model_config(source), dtype, "cpu")


def load_shard(path: Path, rank: int, tp: int = 2) -> dict[str, torch.Tensor]:
    source = resolve_model(str(path))
    model = load_model_config(source)
    return load_weight_shard(source, model, TPShard.plan(model, ParallelConfig(tp), rank), torch.float32)


def no_dequantizing(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_args: object) -> None:
        raise AssertionError("dequantized although the cache holds the tensors")

    monkeypatch.setattr(gguf_loader, "dequantize_tensor", refuse)  # whole tensors
    monkeypatch.setattr(gguf_loader, "dequantize_part", refuse)  # a tensor-parallel rank's parts


def assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def test_a_second_load_reads_the_same_tensors_back(cache, tmp_path, monkeypatch) -> None:
    gguf = write_tiny_gguf(tmp_path, qtypes=(Q.Q4_1, Q.Q8_0, Q.F16))
    first = load(gguf)
    assert len(list(cache.glob("*.safetensors"))) == 1
    no_dequantizing(monkeypatch)
    assert_equal(load(gguf), first)


def test_a_bad_entry_is_rebuilt(cache, tmp_path) -> None:
    gguf = write_tiny_gguf(tmp_path)
    first = load(gguf)
    (entry,) = cache.glob("*.safetensors")
    entry.write_bytes(entry.read_bytes()[:100])
    assert_equal(load(gguf), first)
    assert entry.stat().st_size > 100


def test_other_dtype_or_other_content_is_another_entry(cache, tmp_path) -> None:
    gguf = write_tiny_gguf(tmp_path)
    load(gguf)
    halves = load(gguf, torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in halves.values())
    assert len(list(cache.glob("*.safetensors"))) == 2
    (tmp_path / "other").mkdir()
    other = write_tiny_gguf(tmp_path / "other", seed=1)
    assert not torch.equal(load(other)["embed_tokens.weight"], load(gguf)["embed_tokens.weight"])
    assert len(list(cache.glob("*.safetensors"))) == 3


def new_entry(cache: Path, before: set[Path]) -> Path:
    (entry,) = set(cache.glob("*.safetensors")) - before
    return entry


def test_each_shard_is_an_entry_of_its_own(cache, tmp_path, monkeypatch) -> None:
    """TP=1, TP=2 rank 0 and rank 1, and TP=4 rank 0 each get an entry; the second load of each shard is its own
    first load, read back without dequantizing, and holds TP=1's rows for that shard."""
    gguf = write_tiny_gguf(tmp_path)
    whole = load(gguf)
    entries = set(cache.glob("*.safetensors"))
    shards = [(2, 0), (2, 1), (4, 0)]
    first = {}
    for tp, rank in shards:
        first[tp, rank] = load_shard(gguf, rank, tp)
        entries.add(new_entry(cache, entries))
    no_dequantizing(monkeypatch)
    source = resolve_model(str(gguf))
    model = load_model_config(source)
    layout = canonical_layout(model)
    for tp, rank in reversed(shards):
        again = load_shard(gguf, rank, tp)
        assert_equal(again, first[tp, rank])
        shard = TPShard.plan(model, ParallelConfig(tp), rank)
        for name, tensor in again.items():
            assert torch.equal(tensor, cut_fused(layout[name], whole[name], shard)), (tp, rank, name)
    assert not torch.equal(first[2, 0]["layers.0.qkv.weight"], first[2, 1]["layers.0.qkv.weight"])
    assert set(cache.glob("*.safetensors")) == entries and len(entries) == 4


def test_a_bad_or_mismatched_shard_entry_is_rebuilt(cache, tmp_path, monkeypatch) -> None:
    """A truncated entry, and an entry holding the whole model's shapes under a rank's key, are rebuilt: the
    next load dequantizes and rewrites them, and the one after reads them back."""
    gguf = write_tiny_gguf(tmp_path)
    load(gguf)
    (whole,) = cache.glob("*.safetensors")
    first = {rank: load_shard(gguf, rank) for rank in (0, 1)}
    rank_entries = list(set(cache.glob("*.safetensors")) - {whole})
    rank_entries[0].write_bytes(rank_entries[0].read_bytes()[:100])
    rank_entries[1].write_bytes(whole.read_bytes())
    for rank in (0, 1):
        assert_equal(load_shard(gguf, rank), first[rank])
    for entry in rank_entries:  # half the vocabulary, heads and MLP, and every norm: a shard's tensors again
        assert whole.stat().st_size // 4 < entry.stat().st_size < whole.stat().st_size * 3 // 4
    no_dequantizing(monkeypatch)
    for rank in (0, 1):
        assert_equal(load_shard(gguf, rank), first[rank])


def test_an_empty_cache_dir_turns_it_off(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(CACHE_DIR_ENV, "")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    load(write_tiny_gguf(tmp_path))
    assert not list(tmp_path.rglob("*.safetensors"))
