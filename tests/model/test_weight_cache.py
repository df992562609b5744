"""The weight cache: a second load of a GGUF reads the canonical tensors back bit for bit without dequantizing,
a bad entry is rebuilt, another dtype or other file content is another entry, and an empty TANDEM_CACHE_DIR
turns it off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from model_runtime.weights import gguf_loader, load_model_config, load_weights, resolve_model
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


def no_dequantizing(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_args: object) -> None:
        raise AssertionError("dequantized although the cache holds the tensors")

    monkeypatch.setattr(gguf_loader, "dequantize_tensor", refuse)


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


def test_an_empty_cache_dir_turns_it_off(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(CACHE_DIR_ENV, "")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    load(write_tiny_gguf(tmp_path))
    assert not list(tmp_path.rglob("*.safetensors"))
