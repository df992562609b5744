"""Small all-reduces over CUDA symmetric memory: a decode step's 2 x layers sums without NCCL's ring.

A decode step of a tensor-parallel engine sums a [batch, hidden] tensor twice per layer: 160 sums of 0.5-2 MiB
for a 70B model at batch 32-128. NCCL's ring (LL protocol) takes 15-25 us for each on two H200s
(bench/tp_decode.py), a sixth of the step. Every rank of a worker is on one node, linked by NVLink, so each can
read its peers' buffers directly: one kernel copies the rank's input into its symmetric buffer, waits at a
barrier of signal flags, and sums the peers' buffers as it reads them (one-shot), or, for larger messages, each
rank sums one slice and the ranks then gather the sums (two-shot). torch provides both kernels
(torch.ops.symm_mem, over CUDA IPC; NVLink multicast stays off), and CUDA graphs capture them.

    FastAllReduce.setup(group, device)   collective (a TPGroup), once, before any graph capture; None where unusable
    fast(x) -> summed tensor, or None    None: too large or not a CUDA tensor, so the caller runs NCCL

Set-up is all or nothing: every rank checks it can allocate and map the buffer, the ranks agree on the host
group, one sum is checked against NCCL's, and they agree again. Any rank that cannot (an old torch, a rank that
sees fewer GPUs than the group spans, as under Ray's one GPU per actor, no peer access) makes every rank keep
NCCL, with the reason logged.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from model_runtime.parallel.group import TPGroup  # which imports this module

log = logging.getLogger(__name__)

# From bench/tp_decode.py's all-reduce rows (each path timed alone in one run, 2x and 4x H200, bf16, 2 x layers
# sums in a CUDA graph): one-shot wins up to 512 KiB at TP=2 and TP=4 (at 512 KiB, TP=4: 2.24 against 2.50 ms a
# step); at 1 MiB two-shot wins at TP=4 (2.79 against 3.01 ms) and loses a little at TP=2 (1.03 against 0.96 ms).
ONE_SHOT_MAX_BYTES = 512 * 1024
MAX_BYTES = 8 * 1024 * 1024  # the symmetric buffer; larger sums (long prompts) go to NCCL
_DTYPES = (torch.bfloat16, torch.float32)  # what torch's kernels take


@dataclass(frozen=True)
class FastAllReduce:
    buffer: torch.Tensor  # uint8 [MAX_BYTES], symmetric: every rank's is mapped in every other rank
    group_name: str
    one_shot_max: int = ONE_SHOT_MAX_BYTES

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """The sum of x over the ranks as a new tensor, or None when x is not one this path takes."""
        nbytes = x.numel() * x.element_size()
        if (
            not x.is_cuda
            or x.dtype not in _DTYPES
            or nbytes > self.buffer.numel()
            or nbytes % 16
            or not x.is_contiguous()
        ):
            return None
        # Every view starts at the buffer's first byte: the ops find the allocation by its address.
        staged = self.buffer[:nbytes].view(x.dtype).view(x.shape)
        out = torch.empty_like(x)
        if nbytes <= self.one_shot_max:
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(staged, x, "sum", self.group_name, out)
        else:
            staged.copy_(x)
            torch.ops.symm_mem.two_shot_all_reduce_out(staged, "sum", self.group_name, out)
        return out

    @classmethod
    def setup(cls, group: TPGroup, device: torch.device, max_bytes: int = MAX_BYTES) -> FastAllReduce | None:
        """Collective over every rank of `group` (its device group and its host group); None on every rank
        unless every rank can use it."""

        def agree(ok: bool, step: str, why: str) -> bool:
            everyone = group.agree_min(1 if ok else 0) == 1
            if not ok:
                log.info("rank %d: small all-reduces stay on NCCL (%s: %s)", group.rank, step, why)
            elif not everyone:
                log.info(
                    "rank %d: small all-reduces stay on NCCL (another rank failed at %s)", group.rank, step
                )
            return everyone

        buffer, why = _allocate(device, max_bytes, group.size)
        if not agree(buffer is not None, "allocation", why):
            return None
        assert buffer is not None
        handle, why = _attempt(lambda: _rendezvous(buffer, group.device_group))
        if not agree(handle is not None, "rendezvous", why):
            return None
        fast = cls(buffer, group.device_group.group_name)
        ok, why = _check(fast, group, device)
        if not agree(ok, "check against NCCL", why):
            return None
        log.info("rank %d: small all-reduces (<= %d bytes) over CUDA symmetric memory", group.rank, max_bytes)
        return fast


def _allocate(device: torch.device, nbytes: int, ranks: int) -> tuple[torch.Tensor | None, str]:
    if device.type != "cuda":
        return None, "not a CUDA device"
    if torch.cuda.device_count() < ranks:
        # Under Ray each rank's process sees only its own GPU (CUDA_VISIBLE_DEVICES): its peers' memory is on
        # devices it cannot name, and mapping it is not something to try inside a serving process.
        return None, f"this process sees {torch.cuda.device_count()} GPU(s), the group spans {ranks}"
    ops = getattr(torch.ops, "symm_mem", None)
    for op in ("one_shot_all_reduce_copy_out", "two_shot_all_reduce_out"):
        if ops is None or not hasattr(ops, op):
            return None, f"this torch ({torch.__version__}) has no torch.ops.symm_mem.{op}"
    import torch.distributed._symmetric_memory as symm_mem

    buffer, why = _attempt(lambda: symm_mem.empty(nbytes, dtype=torch.uint8, device=device))
    return buffer, why


def _rendezvous(buffer: torch.Tensor, group: dist.ProcessGroup) -> object:
    import torch.distributed._symmetric_memory as symm_mem

    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)  # required by older torch, a no-op later
    if enable is not None:
        enable(group.group_name)
    return symm_mem.rendezvous(buffer, group.group_name)


def _check(fast: FastAllReduce, group: TPGroup, device: torch.device) -> tuple[bool, str]:
    """One sum of each path (one-shot and two-shot sizes) equal to NCCL's, exactly (small integers)."""
    row_bytes = 1024 * torch.bfloat16.itemsize
    for rows in (4, fast.one_shot_max // row_bytes + 8):  # [rows, 1024] bfloat16: one-shot, then two-shot
        x = torch.arange(rows * 1024, device=device, dtype=torch.float32).remainder(17).add(group.rank)
        x = x.to(torch.bfloat16).view(rows, 1024)
        expected = x.clone()
        dist.all_reduce(expected, group=group.device_group)
        got, why = _attempt(functools.partial(fast, x))
        if got is None:
            return False, why or "the fast path refused a tensor it should take"
        torch.cuda.synchronize(device)
        if not torch.equal(got, expected):
            return False, f"a sum of {rows} x 1024 differs from NCCL's"
    return True, ""


def _attempt(fn: Callable[[], object]) -> tuple:
    try:
        return fn(), ""
    except Exception as exc:  # any failure means "use NCCL"; the reason is logged by the caller
        return None, f"{type(exc).__name__}: {exc}"
