"""Choosing the fused-ops implementation for a device (DeviceConfig.kernels: auto | torch | triton | compile)."""

from __future__ import annotations

import os

from model_runtime.fused.base import FusedOps

KERNEL_NAMES = ("auto", "torch", "triton", "compile")


def make_fused_ops(name: str, device: str) -> FusedOps:
    """ "auto": the Triton kernels on CUDA when triton is installed, else the torch reference.
    "triton" on a CPU device needs TRITON_INTERPRET=1 (tests); "compile" needs CUDA."""
    if name not in KERNEL_NAMES:
        raise ValueError(f"device.kernels: {name!r} is not one of {', '.join(KERNEL_NAMES)}")
    from model_runtime.attention.select import triton_available

    on_cuda = device.startswith("cuda")
    if name == "auto":
        name = "triton" if on_cuda and triton_available() else "torch"
    if name == "torch":
        from model_runtime.fused.torch_ops import TorchOps

        return TorchOps()
    if name == "compile":
        if not on_cuda:
            raise ValueError(f"device.kernels: 'compile' runs on CUDA devices, got device {device!r}")
        from model_runtime.fused.compiled import CompiledOps

        return CompiledOps()
    if not triton_available():
        raise ValueError("device.kernels: 'triton' needs the triton package (pip install triton)")
    if not on_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError(
            f"device.kernels: 'triton' runs on CUDA devices, got device {device!r} "
            "(set TRITON_INTERPRET=1 to run its kernels on the CPU for testing)"
        )
    from model_runtime.fused.triton_ops import TritonOps

    return TritonOps()
