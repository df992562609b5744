"""Random weights at a model's real shape, made directly in the target dtype on the target device.

Benchmarks load `dummy:llama-3-8b` in bf16 on a GPU: each tensor is drawn there by a device-side generator, so no
fp32 or host copy of the model is ever built. Matrices ~ N(0, 0.02^2) like a fresh init; norm weights are 1.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from model_runtime.config import ModelConfig
from model_runtime.weights.canonical import canonical_shapes

INIT_STD = 0.02


def dummy_weights(
    config: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu", seed: int = 0
) -> dict[str, torch.Tensor]:
    """Seeded random canonical weights (the same seed gives the same weights on the same device type)."""
    return dict(iter_dummy_weights(config, dtype, device, seed))


def iter_dummy_weights(
    config: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu", seed: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """`dummy_weights` one tensor at a time (a tensor-parallel rank keeps only its slice of each)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    for name, shape in canonical_shapes(config).items():
        if name.endswith("norm.weight"):
            yield name, torch.ones(shape, dtype=dtype, device=device)
        else:
            tensor = torch.empty(shape, dtype=dtype, device=device)
            tensor.normal_(mean=0.0, std=INIT_STD, generator=generator)
            yield name, tensor
