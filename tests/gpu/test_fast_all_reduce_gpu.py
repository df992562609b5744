"""The symmetric-memory all-reduce (model_runtime.parallel.fast_all_reduce) against NCCL, on 2 (and 4) GPUs.

Each rank sums random tensors through TPGroup.all_reduce (one-shot below ONE_SHOT_MAX_BYTES, two-shot up to the
buffer, NCCL past it), eagerly and replayed in a CUDA graph with new inputs each replay, and compares with
NCCL's sum of the same tensors. float32 sums of values that are exact in float32 (multiples of 1/64) are exact
whatever the order; bfloat16 is compared within a rounding step.

    pytest -m gpu tests/gpu/test_fast_all_reduce_gpu.py
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from model_runtime.parallel.fast_all_reduce import MAX_BYTES, ONE_SHOT_MAX_BYTES
from model_runtime.parallel.group import TPGroup
from tests.model import tp_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"
    ),
]

HIDDEN = 4096
# rows of [rows, HIDDEN]: one-shot, the one-shot limit, two-shot, past the buffer (NCCL)
ROWS = {
    "float32": [1, ONE_SHOT_MAX_BYTES // (4 * HIDDEN), 96, MAX_BYTES // (4 * HIDDEN) + 8],
    "bfloat16": [3, ONE_SHOT_MAX_BYTES // (2 * HIDDEN), 128, MAX_BYTES // (2 * HIDDEN) + 8],
}


def _values(rows: int, dtype: torch.dtype, seed: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return (torch.randint(-512, 512, (rows, HIDDEN), generator=gen, device=device) / 64).to(dtype)


def _sums(group: TPGroup, dtype_name: str) -> dict:
    dtype = getattr(torch, dtype_name)
    device = torch.device("cuda", torch.cuda.current_device())
    report: dict = {"fast": group.fast is not None, "eager": [], "graph": []}
    for i, rows in enumerate(ROWS[dtype_name]):
        x = _values(rows, dtype, 100 * i + group.rank, device)
        expected = x.clone()
        dist.all_reduce(expected, group=group.device_group)
        got = group.all_reduce(x.clone())
        report["eager"].append((rows, _error(got, expected)))
    # In a CUDA graph: the captured sums see new inputs at each replay.
    rows = ROWS[dtype_name][2]
    static = _values(rows, dtype, 7, device)
    small = static[:4].clone()
    group.all_reduce(static.clone())  # warm both paths before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_big = group.all_reduce(static.clone())
        out_small = group.all_reduce(small.clone())
    for replay in range(3):
        static.copy_(_values(rows, dtype, 1000 + 10 * replay + group.rank, device))
        small.copy_(_values(4, dtype, 2000 + 10 * replay + group.rank, device))
        want_big, want_small = static.clone(), small.clone()
        dist.all_reduce(want_big, group=group.device_group)
        dist.all_reduce(want_small, group=group.device_group)
        graph.replay()
        torch.cuda.synchronize()
        report["graph"].append((_error(out_big, want_big), _error(out_small, want_small)))
    return report


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max())


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_symmetric_memory_sums_equal_nccls_eagerly_and_in_cuda_graphs(tp: int, dtype_name: str) -> None:
    if torch.cuda.device_count() < tp:
        pytest.skip(f"TP={tp} needs {tp} GPUs")
    reports = tp_ranks.run_ranks(_sums, tp, dtype_name, timeout_s=300, device="cuda")
    # Where the kernels exist, every rank takes the path (the set-up is all or nothing); this machine has them.
    assert all(r["fast"] for r in reports), "the symmetric-memory path was not set up on every rank"
    # float32 sums of multiples of 1/64 are exact; bfloat16 sums round at most once more in another order.
    tolerance = 0.0 if dtype_name == "float32" else 0.25
    for r in reports:
        for rows, err in r["eager"]:
            assert err <= tolerance, f"{rows} rows: the sum differs from NCCL's by {err}"
        for big, small in r["graph"]:
            assert big <= tolerance and small <= tolerance, f"replayed sums differ by {big}, {small}"
