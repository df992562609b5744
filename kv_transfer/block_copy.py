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
0-2 are (layer, K|V, block), dim 3 the block's rows (tokens), and the rest contiguous within a row. Block ids are int64 tensors on the device.

Over NVLink the kernel pulls 347-372 GB/s between two H200s (bench/block_copy.py), 91-95% of what the copy
engines move for one contiguous buffer of the same size. A CUDA C version of it, launched through
cuLaunchKernel, was measured against it and not kept: the same bandwidth, and the same host time per launch
(17-27 us), bench/results/kv_handoff_h200x2/block_copy_run12_cuda_c_experiment_nvidia-h200.json.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

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
    @triton.jit(do_not_specialize=["src_ids", "dst_ids", "num_blocks"])
    def copy_blocks_kernel(
        src,
        dst,
        src_ids,
        dst_ids,
        num_blocks,
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
        s = tl.load(src_ids + i).to(tl.int64)
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


def copy_blocks(src: Any, dst: Any, src_ids: Any, dst_ids: Any) -> None:
    """Queue the copy on the current stream (a transfer thread enters its stream once per part). src and dst
    have the same number of layers (dim 0)."""
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
    grid = (layers * 2 * num,)
    _COMPILED[0][grid](
        src, dst, src_ids, dst_ids, num, ss[0], ss[1], ss[2], ds[0], ds[1], ds[2], rows, row_len, src_rs,
        dst_rs, STEP=step, ROWS=tile_rows,
    )  # fmt: skip


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
