"""Settings of the whole test session (every tier).

The weight cache (model_runtime.weights.weight_cache) lives in a directory of this session, not in
~/.cache/tandem: the first engine of the session that loads a GGUF dequantizes it with the code under test, the
processes after it (every e2e worker, the model tests' engines) read that back, and no entry from an earlier
checkout can stand in for the loader.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

CACHE_DIR_ENV = "TANDEM_CACHE_DIR"  # model_runtime.weights.weight_cache's (not imported: it imports torch)
_SESSION_CACHE = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    directory = tempfile.mkdtemp(prefix="tandem-test-cache-")
    config.stash[_SESSION_CACHE] = directory
    os.environ[CACHE_DIR_ENV] = directory  # inherited by `tandem serve`, its Ray cluster and its workers


def pytest_unconfigure(config: pytest.Config) -> None:
    directory = config.stash.get(_SESSION_CACHE, None)
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)
