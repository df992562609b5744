"""The fused-ops seam: the elementwise chains of a Llama layer that run between the matmuls and attention.

A decode step at small batch is a few large weight reads and many tiny elementwise kernels; at ten or more
launches per layer those tiny kernels cost as much as the weights. Each method here is one chain that an
implementation may run as one kernel:

    add_rms_norm   residual' = x + residual; out = RMSNorm(residual')         (before attention and the MLP)
    rotary         q, k rotated by their positions (neox halves)              (after the qkv matmul)
    silu_mul       silu(gate) * up over the fused gate_up output              (between the MLP matmuls)
    linear         x @ weight^T (+ bias): the projections, which an implementation may stream itself at
                   small batch, where a matmul is a read of its weight matrix

For FP8 projections that take their input quantized per token (fused/fp8_rows.py), the norms and silu_mul
have `_fp8` forms that return QuantizedRows: the result above, rounded to the activation dtype, then quantized.
The defaults here run the two steps one after the other; an implementation may fuse them.

Numerics contract (every implementation): the result is what the torch reference computes, the
reference's roundings included: a residual sum is rounded to the activation dtype before it is normed,
RMSNorm and rotary compute in float32 and round once, and silu(gate) is rounded before the multiply.
Implementations: TorchOps (reference, any device), TritonOps (CUDA, or CPU under TRITON_INTERPRET=1),
CompiledOps (torch.compile of the reference, CUDA).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F

from model_runtime.fused.fp8_rows import QuantizedRows, quantize_rows_torch


class FusedOps(ABC):
    name: str = "abstract"

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of each row of x [T, H]."""

    @abstractmethod
    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(x + residual), x + residual) for rows of [T, H]. The sum may be written into `residual`."""

    @abstractmethod
    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D] and k [T, Hkv, D] rotated at positions [T] by the tables cos, sin [P, D/2] (float32).
        May rotate in place (q and k may be strided views of one qkv output)."""

    @abstractmethod
    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2I] (gate first) -> silu(gate) * up [T, I]."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, K] @ weight [N, K]^T (+ bias [N]) -> [T, N]; the default is torch's (cuBLAS on a GPU)."""
        return F.linear(x, weight, bias)

    def rms_norm_fp8(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> QuantizedRows:
        """rms_norm, quantized per token for an FP8 projection."""
        return QuantizedRows(*quantize_rows_torch(self.rms_norm(x, weight, eps)))

    def add_rms_norm_fp8(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[QuantizedRows, torch.Tensor]:
        """add_rms_norm with the normed rows quantized per token for an FP8 projection."""
        normed, total = self.add_rms_norm(x, residual, weight, eps)
        return QuantizedRows(*quantize_rows_torch(normed)), total

    def silu_mul_fp8(self, gate_up: torch.Tensor) -> QuantizedRows:
        """silu_mul, quantized per token for an FP8 projection."""
        return QuantizedRows(*quantize_rows_torch(self.silu_mul(gate_up)))
