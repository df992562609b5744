"""kv_transfer.slicing (what both nccl peers derive alike) and kv_transfer.block_copy's kernel, run on the CPU
through Triton's interpreter in a child process (TRITON_INTERPRET must be set before triton is imported),
against torch indexing as the reference."""

from __future__ import annotations

import pytest
import torch

from kv_transfer.block_copy import DevicePointer
from kv_transfer.slicing import ring_bytes, slices
from model_runtime.kv_layout import KVLayout
from tests.unit.interpreter import run_child

pytestmark = pytest.mark.unit


def layout(num_layers: int = 32, blocks: int = 600) -> KVLayout:
    return KVLayout(
        num_layers=num_layers,
        num_kv_heads=8,
        head_dim=128,
        block_size=16,
        num_blocks=blocks,
        dtype="bfloat16",
    )


@pytest.mark.parametrize(
    ("layers", "num_blocks"), [((0, 32), 8), ((0, 32), 128), ((4, 9), 512), ((0, 3), 2048)]
)
def test_slices_cover_the_part_once_in_order_and_fit_the_ring(layers, num_blocks):
    lay = layout()
    pieces = slices(lay, layers[0], layers[1], num_blocks)
    covered = [
        (layer, b)
        for p in pieces
        for layer in range(p.layer_begin, p.layer_end)
        for b in range(p.block_begin, p.block_end)
    ]
    expected = [(layer, b) for layer in range(*layers) for b in range(num_blocks)]
    assert sorted(covered) == expected and len(covered) == len(expected)  # every (layer, block) exactly once
    assert covered == sorted(covered)  # wire order: layer-major, blocks ascending
    assert all(p.num_bytes(lay) <= ring_bytes(lay) for p in pieces)
    assert sum(p.num_bytes(lay) for p in pieces) == lay.bytes_per_block_layer * num_blocks * (
        layers[1] - layers[0]
    )


def test_slices_refuse_an_empty_part():
    with pytest.raises(ValueError, match="empty part"):
        slices(layout(), 3, 3, 4)


def test_device_pointer_heads_matches_tensor_slicing():
    cache = torch.zeros(layout(num_layers=2, blocks=8).cache_shape, dtype=torch.bfloat16)
    whole = DevicePointer(cache.data_ptr(), cache.dtype, tuple(cache.shape), cache.stride())
    window = whole.heads(2, 3)
    view = cache[:, :, :, :, 2:5]
    assert window.data_ptr() == view.data_ptr() and window.shape == tuple(view.shape)
    assert window.stride() == view.stride()


def test_device_pointer_layers_matches_tensor_slicing():
    cache = torch.zeros(layout(num_layers=4, blocks=8).cache_shape, dtype=torch.bfloat16)
    whole = DevicePointer(cache.data_ptr(), cache.dtype, tuple(cache.shape), cache.stride())
    part = whole.layers(1, 3)
    assert part.data_ptr() == cache[1:3].data_ptr() and part.shape == tuple(cache[1:3].shape)
    assert part.stride() == cache[1:3].stride()


CHILD = r"""
import json, torch
from kv_transfer.block_copy import copy_blocks
from model_runtime.kv_layout import KVLayout

def case(dtype, layers, src_ids, dst_ids, src_blocks=12, dst_blocks=9):
    shape = lambda n: (layers, 2, n, 4, 2, 8)
    src = torch.randn(shape(src_blocks)).to(dtype)
    dst = torch.randn(shape(dst_blocks)).to(dtype)
    expected = dst.clone()
    expected[:, :, dst_ids] = src[:, :, src_ids]
    copy_blocks(src, dst, torch.tensor(src_ids), torch.tensor(dst_ids))
    return bool(torch.equal(dst.view(torch.uint8) if dtype != torch.float32 else dst, expected.view(torch.uint8) if dtype != torch.float32 else expected))

out = {
    "scatter_gather_f32": case(torch.float32, 3, [5, 0, 11, 7], [2, 8, 1, 3]),
    "bf16": case(torch.bfloat16, 2, [1, 2, 3], [6, 4, 5]),
    "layer_slice": None,
}
src = torch.randn(4, 2, 6, 4, 2, 8)
dst = torch.zeros(4, 2, 6, 4, 2, 8)
copy_blocks(src[1:3], dst[1:3], torch.tensor([0, 5]), torch.tensor([4, 1]))
ref = torch.zeros_like(dst)
ref[1:3, :, [4, 1]] = src[1:3, :, [0, 5]]
out["layer_slice"] = bool(torch.equal(dst, ref))

# A head window on each side (a piece between tensor-parallel ranks of different sizes): heads 1-2 of a 4-head
# cache into heads 1-2 of a 3-head one, through contiguous staging as the nccl transport does, bf16.
# (Tensor views: the interpreter needs tensors. DevicePointer.heads gives the same pointer and strides: below.)
src = torch.randn(3, 2, 7, 4, 4, 8).to(torch.bfloat16)
dst = torch.randn(3, 2, 5, 4, 3, 8).to(torch.bfloat16)
staging = torch.zeros(3, 2, 2, 4, 2, 8, dtype=torch.bfloat16)
ref = dst.clone()
ref[:, :, [4, 1], :, 1:3] = src[:, :, [6, 2], :, 1:3]
arange = torch.arange(2)
copy_blocks(src[:, :, :, :, 1:3], staging, torch.tensor([6, 2]), arange)
copy_blocks(staging, dst[:, :, :, :, 1:3], arange, torch.tensor([4, 1]))
out["head_window"] = bool(torch.equal(dst.view(torch.uint8), ref.view(torch.uint8)))

# int32 ids (a doorbell slot's), and source ids outside the source clamped into it: never read past src.
src = torch.randn(2, 2, 5, 4, 2, 8)
dst = torch.zeros(2, 2, 6, 4, 2, 8)
copy_blocks(src, dst, torch.tensor([3, 99, -7], dtype=torch.int32), torch.tensor([0, 2, 5], dtype=torch.int32))
ref = torch.zeros_like(dst)
ref[:, :, [0, 2, 5]] = src[:, :, [3, 4, 0]]
out["int32_clamped"] = bool(torch.equal(dst, ref))
print(json.dumps(out))
"""


def test_copy_blocks_kernel_matches_torch_indexing():
    results = run_child(["-c", CHILD], timeout_s=300)
    assert results == {
        "scatter_gather_f32": True,
        "bf16": True,
        "layer_slice": True,
        "head_window": True,
        "int32_clamped": True,
    }, results


def test_copy_blocks_refuses_mismatched_ids_and_shapes():
    from kv_transfer.block_copy import copy_blocks

    a, b = torch.zeros(2, 2, 4, 4, 2, 8), torch.zeros(2, 2, 4, 4, 2, 4)
    with pytest.raises(ValueError, match="ids"):
        copy_blocks(a, a.clone(), torch.tensor([0, 1]), torch.tensor([0]))
    with pytest.raises(ValueError, match="do not match"):
        copy_blocks(a, b, torch.tensor([0]), torch.tensor([0]))
