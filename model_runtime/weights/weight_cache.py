"""A content-addressed disk cache of a GGUF model's canonical tensors, so a process starts without dequantizing.

Dequantizing SmolLM2's Q4_1/Q8_0 file takes 2-3 s of CPU in every worker that starts; reading the same canonical
float32 tensors back from a safetensors file takes a fraction of that. The cache is used on CPU only (where a
GGUF's dequantization is most of a small model's start; a GPU model is large and loads once).

    <cache dir>/weights/<key>.safetensors       key = sha256 over (KEY_VERSION, the GGUF file's size and
                                                 sha256, the dtype, the ModelConfig, the tensor-parallel
                                                 shard or none, the source of the modules that compute
                                                 the values)

A tensor-parallel rank's entry holds its shard's canonical tensors (`TPShard.local_model`'s shapes), keyed by
the whole `TPShard` (rank, size and every range it holds): TP=1, and each rank of each size, are entries apart.

- Where: $TANDEM_CACHE_DIR, else $XDG_CACHE_HOME/tandem, else ~/.cache/tandem. `TANDEM_CACHE_DIR=` (set and
  empty) turns the cache off.
- Safe to read from anywhere: safetensors holds raw bytes, names, shapes and dtypes, never code (no pickle). An
  entry is used only when it holds exactly the canonical names, shapes and dtype the config (or the shard's
  local config) asks for.
- Never stale: the key covers the file's content and the code that turns it into tensors; a new loader or a
  changed file is a new key.
- Never in the way: an unreadable entry is rebuilt; an entry that cannot be written is skipped with a warning.
  Writes go to a temporary file renamed into place, so workers that start together never read half a file.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from model_runtime.config import ModelConfig
from model_runtime.weights import canonical, gguf_file, gguf_header, gguf_loader
from model_runtime.weights.canonical import ByteProgress, canonical_shapes

if TYPE_CHECKING:
    from model_runtime.parallel.shard import TPShard

log = logging.getLogger(__name__)

KEY_VERSION = 1
CACHE_DIR_ENV = "TANDEM_CACHE_DIR"
# The modules whose code decides the cached values: a change to any of them is a new key.
VALUE_MODULES: tuple[ModuleType, ...] = (canonical, gguf_file, gguf_header, gguf_loader)
# A shard's entry also depends on the code that cuts the tensors: named here, imported when a key is made
# (model_runtime.parallel.weights imports this module).
SHARD_VALUE_MODULES = ("model_runtime.parallel.shard", "model_runtime.parallel.weights")


def cache_dir() -> Path | None:
    """The weight cache's directory, or None when $TANDEM_CACHE_DIR is set and empty (off)."""
    configured = os.environ.get(CACHE_DIR_ENV)
    if configured is not None:
        return Path(configured).expanduser() / "weights" if configured.strip() else None
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tandem" / "weights"


def cache_key(gguf_path: Path, config: ModelConfig, dtype: torch.dtype, shard: TPShard | None = None) -> str:
    digest = hashlib.sha256()
    with open(gguf_path, "rb") as file:
        content = hashlib.file_digest(file, "sha256").hexdigest()
    modules = VALUE_MODULES
    if shard is not None:
        modules += tuple(importlib.import_module(name) for name in SHARD_VALUE_MODULES)
    code = hashlib.sha256(b"".join(Path(str(m.__file__)).read_bytes() for m in modules)).hexdigest()
    parts = {
        "version": KEY_VERSION,
        "size": gguf_path.stat().st_size,
        "sha256": content,
        "dtype": str(dtype),
        "config": repr(config),
        "shard": repr(shard),  # a frozen dataclass: tp_size, rank and each range of heads, MLP and vocabulary
        "code": code,
    }
    digest.update(json.dumps(parts, sort_keys=True).encode())
    return digest.hexdigest()


def load_cached(
    gguf_path: Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    build: Callable[[], dict[str, torch.Tensor]],
    progress: ByteProgress | None = None,
    shard: TPShard | None = None,
) -> dict[str, torch.Tensor]:
    """The canonical tensors of `gguf_path` (`shard`'s alone when given): on a CPU `device` from the cache when
    it holds them, else `build()` (stored); on any other device always `build()`."""
    directory = cache_dir()
    if directory is None or torch.device(device).type != "cpu":
        return build()
    entry = directory / f"{cache_key(gguf_path, config, dtype, shard)}.safetensors"
    expected = canonical_shapes(config if shard is None else shard.local_model(config))
    if entry.is_file():
        weights = _read(entry, expected, dtype, progress)
        if weights is not None:
            return weights
    weights = build()
    _write(entry, weights)
    return weights


def _read(
    entry: Path, expected: dict[str, tuple[int, ...]], dtype: torch.dtype, progress: ByteProgress | None
) -> dict[str, torch.Tensor] | None:
    try:
        with safe_open(str(entry), framework="pt", device="cpu") as handle:
            if set(handle.keys()) != set(expected):
                raise ValueError("names differ from the model config's (or the shard's)")
            weights: dict[str, torch.Tensor] = {}
            total = sum(_nbytes(shape, dtype) for shape in expected.values())
            done = 0
            for name, shape in expected.items():
                tensor = handle.get_tensor(name)
                if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                    raise ValueError(f"{name} is {tensor.dtype} {tuple(tensor.shape)}, not {dtype} {shape}")
                weights[name] = tensor
                done += _nbytes(shape, dtype)
                if progress is not None:
                    progress(done, total)
    except Exception as exc:  # a truncated or foreign file: rebuild it, never fail the load for the cache
        log.warning("weight cache entry %s unusable (%s); rebuilding it", entry, exc)
        return None
    return weights


def _write(entry: Path, weights: dict[str, torch.Tensor]) -> None:
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=entry.parent, prefix=f".{entry.stem}.", suffix=".part")
        os.close(fd)
        try:
            save_file({name: t.contiguous() for name, t in weights.items()}, temporary)
            os.replace(temporary, entry)
        finally:
            if os.path.exists(temporary):
                os.unlink(temporary)
    except OSError as exc:
        log.warning("weight cache: cannot write %s (%s); the next start dequantizes again", entry, exc)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count * torch.empty((), dtype=dtype).element_size()
