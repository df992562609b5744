"""TPGroup: one engine's tensor-parallel ranks, and every collective the engine runs over them.

The group is made once, when a rank's process starts (`init_tp_group`), and then passed explicitly to whatever
communicates: the sharded layers, the logits gather, the step broadcast. Nothing reads a process-wide group.

Two process groups over the same ranks:

    device_group   the model's collectives on activations: nccl on a GPU (inside CUDA graphs), gloo on CPU
    host_group     small host-side messages (each step's inputs, start-up agreement): gloo, CPU tensors, so
                   the other ranks learn a step's shapes without a device round trip

The host group is its own gloo group on CPU too: it has a long timeout (a follower waits on it while the engine
is idle), the device group a short one (a step's collective that stalls means a dead rank). Each rank process
holds one engine rank, so the ranks are the whole world of that process's torch.distributed (rank 0 is the
lead: it schedules and samples).
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from model_runtime.parallel.fast_all_reduce import FastAllReduce

LEAD_RANK = 0


@dataclass(frozen=True)
class TPGroup:
    rank: int
    size: int
    device_group: dist.ProcessGroup
    host_group: dist.ProcessGroup
    fast: FastAllReduce | None = None  # small sums over CUDA symmetric memory, where every rank can

    @property
    def is_lead(self) -> bool:
        return self.rank == LEAD_RANK

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed across ranks (the row-parallel reduction): a new tensor from the symmetric-memory path for
        a small CUDA tensor, else x itself, summed in place by NCCL (gloo on CPU). Use the result."""
        if self.fast is not None:
            summed = self.fast(x)
            if summed is not None:
                return summed
        dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., size * n], rank r's part at columns [r*n, (r+1)*n)."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=-1)

    def broadcast_host(self, x: torch.Tensor) -> None:
        """Copy the lead's CPU tensor x into every rank's x (same shape and dtype on every rank)."""
        dist.broadcast(x, src=LEAD_RANK, group=self.host_group)

    def all_gather_host(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's CPU tensor x (same shape and dtype everywhere), in rank order, on every rank."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.host_group)
        return parts

    def agree_min(self, value: int) -> int:
        """The smallest `value` any rank holds (e.g. KV blocks: every rank's cache must hold the lead's ids)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.host_group)
        return int(t.item())


def init_tp_group(
    rank: int,
    size: int,
    rendezvous: str,
    device: str,
    timeout_s: float = 300.0,
    idle_timeout_s: float = 7 * 24 * 3600.0,
    fast_all_reduce: bool = True,
) -> TPGroup:
    """Join the engine's ranks at `rendezvous`, a torch.distributed init_method: "file:///path" (ranks of one
    node; nothing listens on the network) or "tcp://address:port" (rank 0 listens there, on every interface:
    torch's TCPStore takes no bind address). `device` picks the collectives' backend: nccl for cuda (cuda:N also makes N this process's device; a rank that sees one GPU, as under
    Ray, passes "cuda"), gloo for cpu. A collective of a step that waits past `timeout_s` raises instead of
    hanging (a rank that died takes the others down with an error). The host group waits up to
    `idle_timeout_s`: a follower waits there for the next step for as long as the engine has no work.
    `fast_all_reduce` (parallel.all_reduce: auto): on GPUs, small sums go over CUDA symmetric memory where every
    rank can map its peers' memory (model_runtime.parallel.fast_all_reduce); NCCL otherwise."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl" and torch.device(device).index is not None:
        torch.cuda.set_device(torch.device(device))  # NCCL binds each rank to the current device
    dist.init_process_group(
        backend,
        init_method=rendezvous,
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    world = dist.group.WORLD
    assert isinstance(world, dist.ProcessGroup)  # set by init_process_group above
    if backend == "nccl":
        # NCCL makes its communicator at the first collective; that must not be inside a CUDA graph capture
        # (the decode graphs hold all-reduces), so one small all-reduce makes it here, before any capture.
        dist.all_reduce(torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device())), group=world)
        torch.cuda.synchronize()
    host = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=idle_timeout_s))
    assert isinstance(host, dist.ProcessGroup)
    group = TPGroup(rank=rank, size=size, device_group=world, host_group=host)
    if backend == "nccl" and fast_all_reduce and size > 1:
        here = torch.device("cuda", torch.cuda.current_device())
        group = dataclasses.replace(group, fast=FastAllReduce.setup(group, here))
    return group


def close_tp_group() -> None:
    """Leave the ranks' groups (safe to call when none was made)."""
    if dist.is_initialized():
        dist.destroy_process_group()
