"""Choosing the attention backend for a device (DeviceConfig.attention_backend: auto | torch | triton)."""

from __future__ import annotations

import importlib.util
import os

from model_runtime.attention.base import AttentionBackend
from model_runtime.config import CHUNK_ATTENTION_MAX_TOKENS, DECODE_GATHER_MAX_TOKENS

BACKEND_NAMES = ("auto", "torch", "triton")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def make_attention_backend(
    name: str,
    device: str,
    decode_gather_tokens: int = DECODE_GATHER_MAX_TOKENS,
    chunk_attention_tokens: int = CHUNK_ATTENTION_MAX_TOKENS,
) -> AttentionBackend:
    """ "auto": Triton on CUDA when triton is installed, else the torch reference.
    "triton" on a CPU device needs TRITON_INTERPRET=1 (tests); it is an error otherwise.
    `decode_gather_tokens`, `chunk_attention_tokens`: the Triton backend's (device.decode_gather_tokens,
    device.chunk_attention_tokens)."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention_backend: {name!r} is not one of {', '.join(BACKEND_NAMES)}")
    on_cuda = device.startswith("cuda")
    if name == "auto":
        name = "triton" if on_cuda and triton_available() else "torch"
    if name == "torch":
        from model_runtime.attention.torch_ref import TorchAttention

        return TorchAttention()
    if not triton_available():
        raise ValueError("attention_backend: 'triton' needs the triton package (pip install triton)")
    if not on_cuda and not _triton_interpreting():
        raise ValueError(
            f"attention_backend: 'triton' runs on CUDA devices, got device {device!r} "
            "(set TRITON_INTERPRET=1 to run its kernels on the CPU for testing)"
        )
    from model_runtime.attention.triton_backend import TritonAttention

    return TritonAttention(
        decode_gather_tokens=decode_gather_tokens, chunk_attention_tokens=chunk_attention_tokens
    )
