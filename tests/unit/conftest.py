"""Fixtures of the unit tests that run the benchmark scripts on the CPU."""

from __future__ import annotations

import pytest

from tests.model.tiny_models import write_tiny_hf


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """A tiny random-weight Hugging Face Llama written for the module (bench scripts' --model on the CPU)."""
    return str(write_tiny_hf(tmp_path_factory.mktemp("bench-smoke")))
