"""e4m3 codes to float16 inside Triton kernels, and whether a device has the instruction for it.

A plain `.to(tl.float16)` of loaded e4m3 codes lets Triton place the conversion wherever it likes; ahead of a
`tl.dot` it moves it past the shared-memory load that forms the dot's operand, so the conversion happens in the
operand's layout and the e4m3 tile is read from shared memory one byte at a time (the FP8 decode attention's V
tile: 128 single-byte loads a thread and tile, compiled for sm_90). `e4m3_to_float16` is declared impure, so the
conversion stays where the codes were loaded: 16-byte loads, two codes per conversion instruction
(cvt.rn.f16x2.e4m3x2, sm_89+), and the float16 tile goes to the operand through shared memory in 16-bit units.
Every e4m3 value is exact in float16 (|c| <= 448, 3 mantissa bits against 10).

`e4m3_to_float16` serves the FP8 decode attention (attention/triton_decode.py), which takes it only where
`converts_e4m3(device)` says so (the CPU interpreter runs no PTX and converts with `.to`); the same predicate
tells the small-batch FP8 matmul (fused/skinny_matmul.py) that the device's tensor cores take e4m3 operands.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def e4m3_to_float16(codes):
    """e4m3 codes (any shape, loaded as float8e4nv or uint8) to float16, in the layout they were loaded in."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r",
        [codes.to(tl.uint8, bitcast=True)],
        dtype=tl.float16,
        is_pure=False,
        pack=4,
    )


def converts_e4m3(device: torch.device) -> bool:
    """Whether the device has the e4m3 -> float16 conversion instruction e4m3_to_float16 issues (sm_89+)."""
    if device.type != "cuda":
        return False
    return capability(torch.cuda.current_device() if device.index is None else device.index) >= (8, 9)


@functools.cache
def capability(index: int) -> tuple[int, int]:
    """A device's compute capability, asked once (eager steps launch the decode kernel once a layer)."""
    return torch.cuda.get_device_capability(index)
