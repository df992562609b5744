"""copy_blocks: one Triton kernel that copies whole KV blocks, layer by layer, from one cache-shaped tensor into
another by block id: the gather and scatter of the nccl transport and the cuda_ipc pull.

    dst[l, kv, dst_ids[i]] = src[l, kv, src_ids[i]]     for every layer l, K|V plane kv and i

A (layer, plane, block) chunk is contiguous (block_size x kv_heads x head_dim elements), so each program
copies one chunk with wide loads and stores; one launch covers a whole part. A window of a block's heads (one
piece of a handoff between tensor-parallel workers of different sizes, `DevicePointer.heads`) is block_size
rows of heads x head_dim elements, a row stride apart: the program then copies tiles of ROWS rows at once
(one load per tile, not one per row: a block's rows are in flight together). It replaces torch's index_select /
index_copy_ on the block dimension (two generic kernels, about half the HBM bandwidth in bench/kv_transfer.py)
and, for cuda_ipc, a copy-engine call per run of consecutive blocks: with the sender's mapped cache as `src`
the SMs read the peer's memory over NVLink directly into our blocks, scattered ids and all, with no staging.

`src` and `dst` are tensors, or `DevicePointer`s for memory torch does not own (a peer's mapped cache); dims
0-2 are (layer, K|V, block), dim 3 the block's rows (tokens), and the rest contiguous within a row. Block ids are
int64 tensors on the device, or int32 or int64 `DevicePointer`s (a doorbell slot's, in pinned host memory); a
source id outside [0, src blocks) is clamped into it, so a copy never reads outside `src`.

Over NVLink the kernel pulls 347-372 GB/s between two H200s (bench/block_copy.py), 91-95% of what the copy
engines move for one contiguous buffer of the same size. A CUDA C version of it, launched through
cuLaunchKernel, was measured against it and not kept: the same bandwidth, and the same host time per launch
(17-27 us), bench/results/kv_handoff_h200x2/block_copy_run12_cuda_c_experiment_nvidia-h200.json.

Launching without letting go of the interpreter lock: Triton's launcher releases Python's lock around
cuLaunchKernel, and on a busy decode worker each release costs the transfer thread a wait behind the engine
loop to get it back (kv_transfer.gpu_ops explains why that matters). With `ops` (RawOps) and `stream` given,
copy_blocks launches each variant through Triton once, then launches the same compiled function itself through
the driver, the lock held. Which compiled variant a launch needs is Triton's choice (its specialization of the
arguments); `_variant_key` is a finer split of the same properties (each pointer's dtype and 16-byte alignment,
each integer's being 1, a multiple of 16, or past 32 bits), so a key never maps to another specialization's
function. A variant whose parameters cannot be laid out with certainty (scratch memory, clusters, a parameter
list that does not match the PTX) stays on Triton's launcher.
"""

from __future__ import annotations

import ctypes
import logging
import re
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

CHUNK_ELEMENTS = 2048  # per inner step; 16 bytes per thread at 4 warps for 16-bit dtypes
TILE_ELEMENTS = 8192  # a window's tile: rows x row elements per inner step


@dataclass(frozen=True)
class DevicePointer:
    """Memory that is not a torch tensor (a peer's mapped cache), as a Triton kernel argument: Triton takes
    anything with data_ptr() and dtype. strides: the element strides of its cache shape."""

    ptr: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    strides: tuple[int, ...]

    def data_ptr(self) -> int:
        return self.ptr

    def stride(self) -> tuple[int, ...]:
        return self.strides

    def heads(self, begin: int, count: int) -> DevicePointer:
        """Heads [begin, begin + count) of a cache shaped [L, 2, N, B, H, D], like tensor[..., begin:end, :]."""
        return DevicePointer(
            self.ptr + begin * self.strides[4] * self.dtype.itemsize,
            self.dtype,
            (*self.shape[:4], count, *self.shape[5:]),
            self.strides,
        )

    def layers(self, begin: int, end: int) -> DevicePointer:
        """Layers [begin, end), like tensor[begin:end]."""
        return DevicePointer(
            self.ptr + begin * self.strides[0] * self.dtype.itemsize,
            self.dtype,
            (end - begin, *self.shape[1:]),
            self.strides,
        )


def cache_pointer(cache: torch.Tensor) -> DevicePointer:
    return DevicePointer(cache.data_ptr(), cache.dtype, tuple(cache.shape), tuple(cache.stride()))


def staging_pointer(ptr: int, dtype: torch.dtype, shape: tuple[int, ...]) -> DevicePointer:
    """A contiguous buffer of `shape` (KVLayout.staging_shape) at ptr."""
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= size
    return DevicePointer(ptr, dtype, shape, tuple(reversed(strides)))


def ids_pointer(ids: torch.Tensor, begin: int, end: int) -> DevicePointer:
    """ids[begin:end] of a contiguous int64 device tensor, without a torch op (each one is a GIL round trip)."""
    return DevicePointer(ids.data_ptr() + begin * 8, torch.int64, (end - begin,), (1,))


def _kernel() -> Any:
    import triton
    import triton.language as tl

    # The ids and the block count vary with every part (an id pointer's alignment, a count of 1 or a multiple of
    # 16) and would each make another variant to compile and load; they do not change the copy's code. The cache
    # pointers, strides and chunk size (one per layout) stay specialized: their 16-element alignment is what
    # lets the copy use wide loads. warm() loads the variants a pair uses before any NCCL call is pending.
    @triton.jit(do_not_specialize=["src_ids", "dst_ids", "num_blocks", "src_limit"])
    def copy_blocks_kernel(
        src,
        dst,
        src_ids,
        dst_ids,
        num_blocks,
        src_limit,
        src_s0,
        src_s1,
        src_s2,
        dst_s0,
        dst_s1,
        dst_s2,
        rows,
        row_len,
        src_rs,
        dst_rs,
        STEP: tl.constexpr,
        ROWS: tl.constexpr,
    ):
        pid = tl.program_id(0)
        plane = pid // num_blocks
        i = pid % num_blocks
        layer = (plane // 2).to(tl.int64)
        kv = (plane % 2).to(tl.int64)
        # Never read outside src, whatever the ids say (a doorbell slot's ids come from the peer's host).
        s = tl.minimum(tl.maximum(tl.load(src_ids + i).to(tl.int64), 0), src_limit - 1)
        d = tl.load(dst_ids + i).to(tl.int64)
        src_base = src + layer * src_s0 + kv * src_s1 + s * src_s2
        dst_base = dst + layer * dst_s0 + kv * dst_s1 + d * dst_s2
        for r0 in range(0, rows, ROWS):
            r = r0 + tl.arange(0, ROWS)[:, None]
            for start in range(0, row_len, STEP):
                offs = start + tl.arange(0, STEP)[None, :]
                mask = (r < rows) & (offs < row_len)
                value = tl.load(src_base + r * src_rs + offs, mask=mask)
                tl.store(dst_base + r * dst_rs + offs, value, mask=mask)

    return copy_blocks_kernel


_COMPILED: list[Any] = []
# _variant_key -> the variant to launch through the driver (None: it stays on Triton's launcher)
_RAW: dict[tuple, RawVariant | None] = {}


def copy_blocks(
    src: Any, dst: Any, src_ids: Any, dst_ids: Any, ops: Any = None, stream: torch.cuda.Stream | None = None
) -> None:
    """Queue the copy on the current stream (a transfer thread enters its stream once per part), which must be
    `stream` when given. src and dst have the same number of layers (dim 0). With `ops` that make raw calls
    (gpu_ops.RawOps) and `stream`, a variant launched before is launched through the driver, the interpreter
    lock held."""
    num = int(src_ids.shape[0])
    if num != int(dst_ids.shape[0]):
        raise ValueError(f"copy_blocks: {num} source ids but {dst_ids.shape[0]} destination ids")
    layers = int(src.shape[0])
    if int(dst.shape[0]) != layers or tuple(src.shape)[3:] != tuple(dst.shape)[3:]:
        raise ValueError(f"copy_blocks: shapes {tuple(src.shape)} and {tuple(dst.shape)} do not match")
    if num == 0:
        return
    if not _COMPILED:
        _COMPILED.append(_kernel())
    ss, ds = src.stride(), dst.stride()
    rows, row_len = _rows(src.shape)
    src_rs, dst_rs = (int(ss[3]), int(ds[3])) if len(ss) > 3 else (row_len, row_len)
    if src_rs == row_len and dst_rs == row_len:  # whole blocks: one contiguous chunk each
        rows, row_len = 1, rows * row_len
    step = min(CHUNK_ELEMENTS, _pow2(row_len))
    tile_rows = min(_pow2(rows), max(1, TILE_ELEMENTS // step))
    grid = layers * 2 * num
    src_limit = int(src.shape[2])
    args = (
        src, dst, src_ids, dst_ids, num, src_limit, ss[0], ss[1], ss[2], ds[0], ds[1], ds[2], rows, row_len,
        src_rs, dst_rs,
    )  # fmt: skip
    if ops is None or stream is None or not ops.raw:
        _COMPILED[0][(grid,)](*args, STEP=step, ROWS=tile_rows)
        return
    device = getattr(stream, "device_index", None)
    key = _variant_key(args, step, tile_rows, stream.device.index if device is None else device)
    variant = _RAW.get(key, _UNSEEN)
    if isinstance(variant, RawVariant):
        ops.launch(
            variant.function, grid, variant.threads, variant.shared, stream.cuda_stream, variant.params(args)
        )
        return
    compiled = _COMPILED[0][(grid,)](*args, STEP=step, ROWS=tile_rows)
    if variant is _UNSEEN:
        _RAW[key] = RawVariant.of(compiled, len(args))


_UNSEEN = object()


def _variant_key(args: tuple, step: int, tile_rows: int, device: int) -> tuple:
    """The launch's arguments as Triton may specialize them, or more finely (see the module docstring), on
    one device (a compiled function belongs to the device it was loaded on)."""
    key: list[Any] = [device, step, tile_rows]
    for a in args:
        if isinstance(a, int):
            key.append((a == 1, a % 16 == 0, -(2**31) <= a < 2**31))
        else:
            key.append((a.dtype, a.data_ptr() % 16 == 0))
    return tuple(key)


_PTX_PARAM = re.compile(r"\.param\s+\.([a-z]+)(\d+)")
_C_TYPES = {"i32": ctypes.c_int32, "i64": ctypes.c_int64, "u64": ctypes.c_uint64}


@dataclass(frozen=True)
class RawVariant:
    """One compiled variant of the copy kernel, launched through cuLaunchKernel: its CUfunction, launch shape
    and parameter layout (which arguments it takes, as which C types, and the null scratch pointers Triton's
    launcher appends)."""

    function: int
    threads: int
    shared: int
    passed: tuple[tuple[int, Any], ...]  # (argument index, ctypes type), in parameter order
    nulls: int  # trailing pointer parameters (Triton's global and profile scratch), 0 when unused

    @staticmethod
    def of(compiled: Any, num_args: int) -> RawVariant | None:
        """From the CompiledKernel a Triton launch of `num_args` arguments returned, or None when its parameters
        cannot be laid out with certainty (then Triton's launcher keeps the variant)."""
        try:
            layout = param_layout(compiled, num_args)
            function = int(compiled.function or 0) if layout is not None else 0
            if layout is None or not function:
                return None
            meta = compiled.metadata
            return RawVariant(function, 32 * int(meta.num_warps), int(meta.shared), *layout)
        except Exception as exc:  # an unexpected Triton: launching through it is always right
            log.info("copy_blocks: variant stays on Triton's launcher (%s: %s)", type(exc).__name__, exc)
            return None

    def params(self, args: tuple) -> Any:
        """The kernelParams array for these arguments (same variant key as the ones it was built from)."""
        values = [ctype(_value(args[i])) for i, ctype in self.passed]
        values += [ctypes.c_uint64(0) for _ in range(self.nulls)]
        array = (ctypes.c_void_p * len(values))(*map(ctypes.addressof, values))
        array._values = values  # type: ignore[attr-defined]  # kept alive with the array until the launch
        return array


def param_layout(compiled: Any, num_args: int) -> tuple[tuple[tuple[int, Any], ...], int] | None:
    """(passed, nulls) of a CompiledKernel launched with `num_args` arguments: which of them its parameters take
    (those its specialization did not fold into the code), in order, with their C types, then how many null
    pointers follow; None when the compiled parameters (its PTX entry) do not match that layout exactly, or the
    variant needs what only Triton's launcher provides. The layout is the compiled variant's: the arguments'
    values chose the variant (_variant_key), not the layout."""
    meta = compiled.metadata
    unusual = [
        name
        for name in (
            "global_scratch_size",
            "profile_scratch_size",
            "launch_cooperative_grid",
            "launch_pdl",
        )
        if getattr(meta, name, 0)
    ]
    if getattr(meta, "num_ctas", 1) != 1:
        unusual.append("num_ctas")
    signature = list(compiled.src.signature.values())
    if unusual or len(signature) < num_args:
        log.info("copy_blocks: variant stays on Triton's launcher (%s)", unusual or "signature")
        return None
    passed: list[tuple[int, Any]] = []
    for i, kind in enumerate(signature[:num_args]):
        if kind == "constexpr":
            continue
        ctype = ctypes.c_uint64 if kind.startswith("*") else _C_TYPES.get(kind)
        if ctype is None:
            return None
        passed.append((i, ctype))
    ptx = compiled.asm["ptx"]
    entry = ptx[ptx.index(".entry") :]
    declared = [(t, int(bits)) for t, bits in _PTX_PARAM.findall(entry[: entry.index(")")])]
    nulls = len(declared) - len(passed)
    widths = [ctypes.sizeof(ctype) * 8 for _, ctype in passed] + [64] * max(0, nulls)
    if nulls < 0 or [bits for _, bits in declared] != widths:
        log.info("copy_blocks: variant stays on Triton's launcher (PTX parameters %s)", declared)
        return None
    return tuple(passed), nulls


def _value(arg: Any) -> int:
    return arg if isinstance(arg, int) else int(arg.data_ptr())


def warm(cache: torch.Tensor, staging: DevicePointer, ids: torch.Tensor, gather: bool) -> None:
    """Compile and load the kernel variant a pair's gathers (cache -> staging) or scatters (staging -> cache)
    use, by copying the null block (0: padding only, never a request's) through ring slot `staging`, and wait.

    Why before any NCCL call of the pair: loading a GPU module may wait for the device's running kernels
    (CUDA's lazy-loading caveat), and an NCCL receive whose peer never sends runs until it is aborted; a first
    load queued behind it would block its transfer thread, which then never gets to abort it."""
    cache_layer = cache_pointer(cache).layers(0, 1)
    null = ids_pointer(ids, 0, 1)  # ids[0] == 0
    if gather:
        copy_blocks(cache_layer, staging, null, null)
    else:
        copy_blocks(staging, cache_layer, null, null)
    torch.cuda.synchronize(cache.device)


def _rows(shape: Any) -> tuple[int, int]:
    """(rows, elements per row) of one (layer, plane, block) chunk."""
    dims = [int(size) for size in tuple(shape)[3:]]
    if not dims:
        return 1, 1
    out = 1
    for size in dims[1:]:
        out *= size
    return dims[0], out


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
