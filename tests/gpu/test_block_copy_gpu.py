"""kv_transfer.block_copy on a GPU: the kernel copies exactly the blocks torch indexing names, for bf16,
FP8-byte and float32 caches, on one GPU and from a peer GPU's memory, on a transfer stream."""

from __future__ import annotations

import random

import pytest
import torch

from kv_transfer.block_copy import cache_pointer, copy_blocks
from kv_transfer.gpu_ops import transfer_stream

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _caches(device: torch.device, dtype: torch.dtype, block_shape: tuple[int, ...], blocks: int = 40):
    gen = torch.Generator(device=device).manual_seed(7)
    src = torch.randint(-100, 100, (3, 2, blocks, *block_shape), generator=gen, device=device).to(dtype)
    dst = torch.zeros_like(src)
    rng = random.Random(3)
    src_ids, dst_ids = rng.sample(range(1, blocks), 17), rng.sample(range(1, blocks), 17)
    return src, dst, src_ids, dst_ids


@pytest.mark.parametrize(
    "dtype, block_shape",
    [(torch.bfloat16, (16, 8, 128)), (torch.uint8, (16640,)), (torch.float32, (4, 2, 16))],
)
def test_copy_blocks_matches_torch_indexing(dtype, block_shape) -> None:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    src, dst, src_ids, dst_ids = _caches(device, dtype, block_shape)
    stream = transfer_stream(device)
    ids = lambda v: torch.tensor(v, device=device)  # noqa: E731
    torch.cuda.synchronize(device)
    with torch.cuda.stream(stream):
        copy_blocks(src[1:3], dst[1:3], ids(src_ids), ids(dst_ids))
    stream.synchronize()
    expect = torch.zeros_like(src)
    expect[1:3, :, dst_ids] = src[1:3, :, src_ids]
    assert torch.equal(dst, expect)


@pytest.mark.parametrize(("src_heads", "dst_heads"), [((2, 4), (0, 4)), ((0, 8), (4, 8)), ((3, 1), (1, 1))])
def test_a_window_of_heads_moves_through_staging_as_torch_slicing_says(src_heads, dst_heads) -> None:
    """A piece between tensor-parallel ranks of different sizes (nccl's gather and scatter): heads
    [s, s + n) of an 8-head cache into heads [t, t + n) of a 12-head one, through contiguous staging."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    (s, n), (t, _) = src_heads, dst_heads
    src, _, src_ids, dst_ids = _caches(device, torch.bfloat16, (16, 8, 128))
    dst = torch.zeros((3, 2, 40, 16, 12, 128), dtype=torch.bfloat16, device=device)
    staging = torch.zeros((3, 2, len(src_ids), 16, n, 128), dtype=torch.bfloat16, device=device)
    arange = torch.arange(len(src_ids), device=device)
    ids = lambda v: torch.tensor(v, device=device)  # noqa: E731
    copy_blocks(cache_pointer(src).heads(s, n), staging, ids(src_ids), arange)
    copy_blocks(staging, cache_pointer(dst).heads(t, n), arange, ids(dst_ids))
    torch.cuda.synchronize(device)
    expect = torch.zeros_like(dst)
    expect[:, :, dst_ids, :, t : t + n] = src[:, :, src_ids, :, s : s + n]
    assert torch.equal(dst, expect)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_pull_from_the_peer_gpu_over_nvlink() -> None:
    """What cuda_ipc does: the kernel runs on the receiver's GPU and reads the sender's memory."""
    from cupy.cuda import runtime  # type: ignore[import-not-found]

    before = torch.cuda.current_device()  # the tests after this one run on the default device again
    try:
        for dev, peer in ((0, 1), (1, 0)):
            runtime.setDevice(dev)
            try:
                runtime.deviceEnablePeerAccess(peer)
            except runtime.CUDARuntimeError as exc:
                if "ALREADY" not in str(exc).upper():
                    raise
        src, _, src_ids, dst_ids = _caches(torch.device("cuda", 0), torch.bfloat16, (16, 8, 128))
        receiver = torch.device("cuda", 1)
        with torch.cuda.device(receiver):
            dst = torch.zeros(src.shape, dtype=src.dtype, device=receiver)
            stream = transfer_stream(receiver)
            ids = lambda v: torch.tensor(v, device=receiver)  # noqa: E731
            torch.cuda.synchronize(0)
            with torch.cuda.stream(stream):
                copy_blocks(cache_pointer(src), dst, ids(src_ids), ids(dst_ids))
            stream.synchronize()
        assert torch.equal(dst[:, :, dst_ids].cpu(), src[:, :, src_ids].cpu())
    finally:
        runtime.setDevice(before)
        torch.cuda.set_device(before)


@pytest.mark.parametrize(
    "dtype, block_shape", [(torch.bfloat16, (16, 8, 128)), (torch.float32, (4, 2, 16))], ids=["bf16", "fp32"]
)
def test_copies_after_the_first_launch_through_the_driver_move_the_same_blocks(dtype, block_shape) -> None:
    """With raw calls and the stream given, the first copy of a variant goes through Triton's launcher and
    the later ones through cuLaunchKernel (the lock held): each must land what torch indexing says."""
    from kv_transfer import block_copy
    from kv_transfer.gpu_ops import gpu_ops

    ops = gpu_ops()
    if not ops.raw:
        pytest.skip("no raw CUDA driver calls in this process")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    src, _, _, _ = _caches(device, dtype, block_shape)
    stream = transfer_stream(device)
    rng = random.Random(11)
    block_copy._RAW.clear()  # a variant another test launched would already be raw: start from none
    raw_before = 0
    for round_ in range(4):
        dst = torch.zeros_like(src)
        src_ids, dst_ids = rng.sample(range(1, 40), 9 + round_), rng.sample(range(1, 40), 9 + round_)
        ids = lambda v: torch.tensor(v, device=device)  # noqa: E731
        torch.cuda.synchronize(device)
        with torch.cuda.stream(stream):
            copy_blocks(src[round_ % 2 :], dst[round_ % 2 :], ids(src_ids), ids(dst_ids), ops, stream)
        stream.synchronize()
        expect = torch.zeros_like(src)
        expect[round_ % 2 :, :, dst_ids] = src[round_ % 2 :, :, src_ids]
        assert torch.equal(dst, expect), f"round {round_}"
    raw_after = sum(isinstance(v, block_copy.RawVariant) for v in block_copy._RAW.values())
    assert raw_after > raw_before, "no variant was launched through the driver"
