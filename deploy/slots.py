"""A worker slot as the controller keeps it, the membership entry it publishes, and the spec a slot's worker
is started with."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deploy.config import DeployConfig
from model_runtime.roles import WorkerRole
from worker_host.spec import WorkerSpec


@dataclass(frozen=True)
class Member:
    worker_id: str
    role: WorkerRole
    address: str
    metrics_address: str = ""  # host:port of the worker's /metrics ("" when it serves none)
    draining: bool = False  # leaving its pool: routers place nothing new on it


@dataclass
class Slot:
    role: WorkerRole
    index: int
    spec: WorkerSpec
    num_gpus: float
    resources: dict[str, float]
    labels: dict[str, str] = field(default_factory=dict)  # Ray label selector for the worker's node
    actor: Any = None
    address: str = ""
    metrics_address: str = ""
    restarts: int = 0
    given_up: bool = False
    missed: int = 0  # consecutive heartbeat checks that timed out
    starting: Any = None  # ObjectRef of start() while a slot added at run time loads
    draining: bool = False  # being drained before it is removed
    placed: Any = None  # ObjectRef of the actor's node id: ready once Ray has placed the actor
    node_id: str = ""  # the Ray node the actor runs on, once placed
    launched_at: float = 0.0  # time.monotonic() of the last launch
    waiting: str = ""  # why Ray has not placed the actor yet (deploy.nodes.placement_wait), "" otherwise
    group: Any = None  # the placement group of a worker of several devices (deploy.ranks)

    @property
    def serving(self) -> bool:
        return self.actor is not None and bool(self.address) and self.starting is None and not self.draining

    @property
    def worker_id(self) -> str:
        return self.spec.worker_id


def worker_spec(config: DeployConfig, role: WorkerRole, index: int) -> WorkerSpec:
    """The spec of worker `index` of the `role` pool: its pool's engine and metrics ports, the cluster's settings."""
    pool = config.pools()[role]
    host = "127.0.0.1" if config.ray.address is None else "0.0.0.0"  # a joined cluster: reachable from peers
    return WorkerSpec(
        host=host,
        worker_id=f"{role}-{index}",
        role=role,
        engine=pool.engine,
        transfer=config.transfer,
        drain_timeout_s=config.controller.drain_timeout_s,
        prefill_timeout_s=config.controller.prefill_timeout_s,
        kv_wait_timeout_s=config.controller.kv_wait_timeout_s,
        metrics_port=pool.metrics_port,
        metrics_port_count=pool.metrics_port_count,
        tls=config.tls.cluster.worker_server() if config.tls.cluster else None,
    )
