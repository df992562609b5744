"""WorkerSpec: everything a worker process needs, built by the controller from the deploy config. Its own module,
light to import (no torch): the controller builds specs in the `tandem serve` driver, which never runs an engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from kv_transfer import TransferConfig
from model_runtime.config import EngineConfig
from model_runtime.roles import WorkerRole
from tandem_client.tls import ServerTLS


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs; built by the controller from the deploy config."""

    worker_id: str
    role: WorkerRole  # its config spelling ("decode") is accepted and converted
    engine: EngineConfig
    transfer: TransferConfig = field(default_factory=TransferConfig)
    host: str = "127.0.0.1"  # where the gRPC server binds; "0.0.0.0" on a multi-node cluster
    port: int = 0
    advertise_host: str = ""  # the address peers dial when host is a wildcard (the node's IP)
    node_id: str = (
        ""  # the Ray node id (deploy.actors sets it); "" outside Ray: worker_host.node names the host
    )
    max_concurrent_rpcs: int = 1024
    drain_timeout_s: float = 30.0
    prefill_timeout_s: float = 600.0  # prefill: longest wait for a prompt's first token
    kv_wait_timeout_s: float = 60.0  # decode: the whole wait for a prompt's KV (the lease is renewed)
    # /metrics: 0 is an ephemeral port; otherwise the first free of metrics_port .. + metrics_port_count - 1
    # (deploy.config.PoolSettings says when to use which).
    metrics_port: int = 0
    metrics_port_count: int = 1
    # Mutual TLS on the gRPC server (deploy tls.cluster): only peers with a cluster certificate get a call
    # through. Paths, read on the worker's own node when it starts; None: plaintext.
    tls: ServerTLS | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", WorkerRole.parse(self.role))

    @property
    def public_host(self) -> str:
        return self.advertise_host or self.host
