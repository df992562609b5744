"""The Ray actor that hosts one worker (prefill, decode or colocated) in its own process.

Ray owns the process (placement on a GPU, death detection); request traffic never goes through Ray: the router
talks to the worker's gRPC address that start() returns.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from model_runtime.roles import WorkerRole
from worker_host.spec import WorkerSpec

if TYPE_CHECKING:  # the class runs its workers in Ray actors: the driver never imports an engine
    from deploy.ranks import Ranks
    from worker_host.lifecycle import WorkerLifecycle

GPU_SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def advertise_node_ip(spec: WorkerSpec) -> WorkerSpec:
    """On a multi-node cluster workers listen on every interface and tell peers this node's IP."""
    import ray

    node_ip = ray.util.get_node_ip_address()
    transfer = replace(spec.transfer, host=spec.host, advertise_host=node_ip)
    return replace(spec, advertise_host=node_ip, transfer=transfer)


def on_ray_node(spec: WorkerSpec) -> WorkerSpec:
    """The spec with this actor's Ray node id, which the worker advertises (WorkerInfo.node_id)."""
    import ray

    return replace(spec, node_id=ray.get_runtime_context().get_node_id())


class WorkerProcess:
    """Plain class; the controller wraps it with ray.remote(...) so this module imports without Ray."""

    def __init__(self, spec: WorkerSpec) -> None:
        os.environ.update(GPU_SAFE_ENV)
        self.spec = spec
        self.worker: WorkerLifecycle | None = None  # PrefillWorker or DecodeWorker, once start() built it
        self.pid = os.getpid()
        self._stage = "importing the engine"
        self.ranks: Ranks | None = None  # a worker of several devices: its other ranks (deploy.ranks)

    def start(self, placement_group: Any = None, num_gpus: float = 0) -> str:
        """Build the worker and serve; returns its gRPC address. `placement_group`: the group a worker of several
        devices runs in (this actor in bundle 0, the other ranks started here in the rest; deploy.ranks)."""
        import torch

        self.spec = on_ray_node(self.spec)
        if self.spec.host in ("0.0.0.0", "::"):
            self.spec = advertise_node_ip(self.spec)
        if self.spec.engine.device.resolved_device() == "cpu":
            # Ray gives each actor a CPU share; more intra-op threads than that only thrash on small hosts.
            torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        group = None
        if self.spec.engine.parallel.tensor_parallel_size > 1:
            from deploy.ranks import Ranks

            self._stage = "starting the other tensor-parallel ranks"
            self.ranks = Ranks()
            group = self.ranks.start(self.spec, placement_group, num_gpus)
        hub = self.ranks.hub if self.ranks is not None else None
        if self.spec.role is WorkerRole.PREFILL:
            from prefill_worker.worker import PrefillWorker

            self.worker = PrefillWorker(self.spec, tp_group=group, agents=hub)
            return self.worker.start()
        from decode_worker.worker import DecodeWorker

        self.worker = DecodeWorker(self.spec, tp_group=group, agents=hub)
        return self.worker.start()

    def startup_stage(self) -> str:
        """Where start() is ("loading weights: 40% (...)"); the controller asks while it waits. Answered on
        another of the actor's threads while start() runs."""
        return self.worker.stage if self.worker is not None else self._stage

    def heartbeat_age(self) -> float:
        """Seconds since the engine loop last went round (inf when it died): a hung step shows here."""
        loop = self.worker.loop if self.worker is not None else None
        if loop is None or not loop.alive or (self.ranks is not None and not self.ranks.alive()):
            return float("inf")
        return time.monotonic() - loop.last_beat

    def process_id(self) -> int:
        return self.pid

    def node_id(self) -> str:
        """The Ray node this actor runs on. The controller asks at launch: the answer comes once Ray has placed
        the actor (a worker waiting for a node has none yet), and names the node whose loss takes it down."""
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def metrics_address(self) -> str:
        """host:port of the worker's Prometheus /metrics ("" before start or when it serves none)."""
        return self.worker.metrics_address if self.worker is not None else ""

    def drain(self) -> bool:
        return self.worker.drain() if self.worker is not None else True

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.stop()
        if self.ranks is not None:
            self.ranks.close()
