"""kv_transfer.block_copy launching its compiled Triton variants through cuLaunchKernel itself (the interpreter
lock held): the parameter layout it derives must be the compiled kernel's, and its variant key must never put
two of Triton's specializations under one function.

Triton compiles for an sm_90 target without a GPU (to PTX and, with its bundled ptxas, a cubin), so the
kernels checked here are the real compiled variants, specialized from the arguments the way Triton's launcher
specializes them. The launch itself needs a GPU: tests/gpu/test_block_copy_gpu.py and the transfer tests run
the copies through it."""

from __future__ import annotations

import ctypes
import random
import re

import pytest
import torch
import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.compiler import ASTSource

from kv_transfer import block_copy
from kv_transfer.block_copy import DevicePointer, RawVariant, param_layout

TARGET = GPUTarget("cuda", 90, 32)


def _specialization(args: tuple) -> list[tuple]:
    """What Triton's launcher makes of these arguments (triton/runtime/jit.py: the binder's specialization)."""
    kernel = block_copy._kernel()
    out = []
    for param, arg in zip(kernel.params, args):
        specialize, align = not param.do_not_specialize, not param.do_not_specialize_on_alignment
        out.append(native_specialize_impl(BaseBackend, arg, param.is_const, specialize, align))
    return out


def _compile(args: tuple, step: int, rows: int):
    kernel = block_copy._kernel()
    spec = _specialization(args) + [("constexpr", step), ("constexpr", rows)]
    values = (*args, step, rows)
    signature = {p.name: s[0] for p, s in zip(kernel.params, spec)}
    constexprs = {(i,): v for i, (s, v) in enumerate(zip(spec, values)) if s[0] == "constexpr"}
    backend = CUDABackend(TARGET)
    attrs = {(i,): backend.parse_attr(s[1]) for i, s in enumerate(spec) if isinstance(s[1], str)}
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=TARGET)


def _pointer(address: int, dtype: torch.dtype = torch.bfloat16) -> DevicePointer:
    return DevicePointer(address, dtype, (1,), (1,))


def _args(rows: int, row_len: int, big_stride: bool = False, ids_offset: int = 0) -> tuple:
    cache, staging = _pointer(0x7F0000000000), _pointer(0x7F1000000000)
    ids = _pointer(0x7F2000000000 + 8 * ids_offset, torch.int64)
    s0 = 2**33 if big_stride else 2 * 4096 * rows * row_len  # a layer's stride past 32 bits: an i64 parameter
    return (cache, staging, ids, ids, 7, 4096, s0, 4096 * rows * row_len, rows * row_len, 2 * 8 * rows * row_len,
            8 * rows * row_len, rows * row_len, rows, row_len, row_len, row_len)  # fmt: skip


@pytest.mark.parametrize(
    "args",
    [
        _args(1, 16 * 8 * 128),
        _args(16, 128),
        _args(1, 16 * 8 * 128, big_stride=True),
        _args(16, 100, ids_offset=3),
    ],
    ids=["whole-blocks", "head-window", "64-bit-stride", "odd-row-and-ids-offset"],
)
def test_the_layout_is_the_compiled_kernel_s_parameters_in_order_with_null_scratch(args) -> None:
    compiled = _compile(args, 2048, 1)
    layout = param_layout(compiled, len(args))
    assert layout is not None
    passed, nulls = layout
    # Every argument Triton did not fold into the code (a 1 becomes a constant), in order, with its type.
    folded = [i for i, s in enumerate(_specialization(args)) if s[0] == "constexpr"]
    assert [i for i, _ in passed] == [i for i in range(len(args)) if i not in folded]
    assert (1 in args[12:13]) == (12 in folded)  # rows == 1 is folded, a window's rows are not
    kinds = {i: s[0] for i, s in enumerate(_specialization(args))}
    for i, ctype in passed:
        expected = (
            ctypes.c_uint64
            if kinds[i].startswith("*")
            else {"i32": ctypes.c_int32, "i64": ctypes.c_int64}[kinds[i]]
        )
        assert ctype is expected, (i, kinds[i])
    assert nulls == 2  # Triton 3.7 appends its global and profile scratch pointers

    variant = RawVariant(function=1, threads=128, shared=0, passed=passed, nulls=nulls)
    params = variant.params(args)
    got = [
        ctypes.cast(params[k], ctypes.POINTER(ctype)).contents.value for k, (_, ctype) in enumerate(passed)
    ]
    want = [a if isinstance(a, int) else a.data_ptr() for a in (args[i] for i, _ in passed)]
    assert got == want
    tail = [
        ctypes.cast(params[len(passed) + k], ctypes.POINTER(ctypes.c_uint64)).contents.value
        for k in range(nulls)
    ]
    assert tail == [0] * nulls


def test_a_compiled_kernel_unlike_what_the_layout_expects_stays_on_triton_s_launcher() -> None:
    """What a later Triton might change: a parameter more or less in the PTX, or scratch memory it must
    allocate (the launcher passes it; null would be wrong)."""
    args = _args(16, 128)
    compiled = _compile(args, 2048, 1)
    assert param_layout(compiled, len(args)) is not None
    ptx = compiled.asm["ptx"]
    first_int = re.search(r"\t\.param \.u32 \w+,\n", ptx)
    assert first_int is not None
    compiled.asm = {**compiled.asm, "ptx": ptx.replace(first_int.group(0), "", 1)}
    assert param_layout(compiled, len(args)) is None
    compiled.asm = {**compiled.asm, "ptx": ptx}
    compiled.metadata = compiled.metadata._replace(global_scratch_size=256)
    assert param_layout(compiled, len(args)) is None


def test_the_variant_key_splits_whatever_triton_s_specialization_splits() -> None:
    rng = random.Random(7)
    values = [1, 2, 15, 16, 17, 32, 4096, 2**31 - 1, 2**31, 2**33]
    addresses = [0x7F0000000000, 0x7F0000000008, 0x7F0000000010, 0x7F0000000004]
    launches = []
    for _ in range(400):
        pointers = [
            _pointer(rng.choice(addresses), rng.choice([torch.bfloat16, torch.float8_e4m3fn]))
            for _ in range(2)
        ]
        ids = [_pointer(rng.choice(addresses), rng.choice([torch.int64, torch.int32])) for _ in range(2)]
        ints = [rng.choice(values) for _ in range(12)]
        launches.append(((*pointers, *ids, *ints), rng.choice([1024, 2048]), rng.choice([1, 8])))
    by_key: dict[tuple, set] = {}
    for args, step, rows in launches:
        key = block_copy._variant_key(args, step, rows, device=0)
        triton_spec = (tuple(_specialization(args)), step, rows)
        by_key.setdefault(key, set()).add(triton_spec)
    assert all(len(specs) == 1 for specs in by_key.values())
    assert len(by_key) > 50  # the draw did exercise many specializations
    # Another device is another function, whatever the arguments.
    args, step, rows = launches[0]
    assert block_copy._variant_key(args, step, rows, device=0) != block_copy._variant_key(
        args, step, rows, device=1
    )
