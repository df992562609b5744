"""kv_transfer.gpu_ops without a GPU: which calls a transfer thread gets, and the library lookup behind it."""

from __future__ import annotations

import ctypes

import pytest

from kv_transfer.gpu_ops import RAW_CALLS_ENV, RawOps, TorchOps, gpu_ops, loaded_libraries

pytestmark = pytest.mark.unit


def _libcuda_loadable() -> bool:
    try:
        ctypes.PyDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@pytest.fixture(autouse=True)
def fresh_choice():
    gpu_ops.cache_clear()
    yield
    gpu_ops.cache_clear()


def test_raw_calls_are_chosen_exactly_when_the_driver_loads(monkeypatch) -> None:
    monkeypatch.delenv(RAW_CALLS_ENV, raising=False)
    assert isinstance(gpu_ops(), RawOps) == _libcuda_loadable()
    assert gpu_ops() is gpu_ops()  # chosen once per process


def test_the_switch_forces_torch_and_cupy_calls(monkeypatch) -> None:
    monkeypatch.setenv(RAW_CALLS_ENV, "0")
    assert type(gpu_ops()) is TorchOps and not gpu_ops().raw


def test_loaded_libraries_names_mapped_files_only() -> None:
    import _ctypes  # a shared library of the interpreter, mapped into this process

    paths = loaded_libraries("_ctypes")
    assert paths and all(p.startswith("/") and "_ctypes" in p.rsplit("/", 1)[-1] for p in paths)
    assert _ctypes.__file__ in paths
    assert loaded_libraries("no-such-library-name.so") == []
