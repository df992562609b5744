"""CompiledOps: the reference functions under torch.compile (inductor writes the fused kernels).

Kept beside TritonOps so both can be measured on the same card (bench/decode_step.py --kernels); the engine
default is whichever docs/performance.md shows winning. Shapes are compiled dynamic in the token count, so
one compilation serves every batch; size 1 (a batch-1 decode) is specialised once more by dynamo. Compiling
happens on first use, which for the engine is the warm-up run before each CUDA graph capture.
"""

from __future__ import annotations

from typing import Any

import torch

from model_runtime.fused import torch_ops
from model_runtime.fused.base import FusedOps


def _compile(fn: Any) -> Any:
    return torch.compile(fn, dynamic=True, fullgraph=True)


class CompiledOps(FusedOps):
    name = "compile"

    def __init__(self) -> None:
        self._rms_norm = _compile(torch_ops.rms_norm)
        self._add_rms_norm = _compile(torch_ops.add_rms_norm)
        self._rotary = _compile(torch_ops.rotary)
        self._silu_mul = _compile(torch_ops.silu_mul)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._add_rms_norm(x, residual, weight, eps)

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._rotary(q, k, positions, cos, sin)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._silu_mul(gate_up)
