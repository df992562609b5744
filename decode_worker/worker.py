"""DecodeWorker: one decode (or colocated) worker process: engine + loop + KV receiver + gRPC service."""

from __future__ import annotations

import logging

from decode_worker.service import DecodeService
from kv_transfer import KVReceiver
from model_runtime.engine import Engine
from model_runtime.engine_loop import EngineLoop
from model_runtime.parallel.group import TPGroup
from model_runtime.roles import WorkerRole
from tandem_api.tandem.v1 import worker_pb2_grpc
from tandem_client.tls import plaintext_warning
from worker_host.host import EngineLoopAllocator, start_grpc
from worker_host.lifecycle import WorkerLifecycle
from worker_host.metrics import WorkerMetrics
from worker_host.node import describe_node
from worker_host.rank_agents import AgentHub, ShardedReceiver
from worker_host.spec import WorkerSpec

log = logging.getLogger(__name__)
SERVICE = "tandem.v1.DecodeWorker"


class DecodeWorker(WorkerLifecycle):
    def __init__(
        self, spec: WorkerSpec, tp_group: TPGroup | None = None, agents: AgentHub | None = None
    ) -> None:
        """`tp_group`: the ranks of a worker that spans several devices (this process is rank 0; deploy.ranks).
        `agents`: a decode worker's other ranks' KV agents: each rank receives the heads of its own cache."""
        if spec.role not in (WorkerRole.DECODE, WorkerRole.COLOCATED):
            raise ValueError(f"role: a DecodeWorker is 'decode' or 'colocated', got {spec.role.value!r}")
        if tp_group is not None and tp_group.size > 1 and spec.role is WorkerRole.DECODE and agents is None:
            raise ValueError("a decode worker of several devices needs its ranks' KV agents (deploy.ranks)")
        super().__init__(spec)
        self.tp_group = tp_group
        self.agents = agents
        self.receiver: KVReceiver | ShardedReceiver | None = None
        self.service: DecodeService | None = None

    def start(self) -> str:
        """Load the model, open the KV receiver and the gRPC port; returns host:port once ready."""
        spec = self.spec
        engine = Engine(
            spec.engine, emit_text=False, on_progress=self._progress, tp_group=self.tp_group, kv_receiver=True
        )
        self.loop = EngineLoop(engine)
        self.loop.start()
        self._progress("opening the KV receiver and the gRPC port")
        self.service = DecodeService(spec.worker_id, self.loop, None, spec.role.wire, spec.kv_wait_timeout_s)
        self.service.node = describe_node(spec.node_id, self.loop.engine.runner.kv_cache)
        if spec.role is WorkerRole.DECODE:
            engine = self.loop.engine
            warning = spec.tls is None and plaintext_warning(
                f"worker {spec.worker_id}'s KV receiver", spec.transfer.host
            )
            if warning:
                log.warning(warning)
            tls = spec.tls.ssl_context() if spec.tls is not None else None  # KV control connections too
            if self.agents is not None:
                self._progress("waiting for the other ranks' KV agents")
                self.receiver = ShardedReceiver(
                    engine.layout,
                    engine.runner.kv_cache,
                    EngineLoopAllocator(self.loop),
                    spec.transfer,
                    self.agents,
                    on_result=self.service.on_transfer_result,
                    tls=tls,
                )
            else:
                self.receiver = KVReceiver(
                    engine.layout,
                    engine.runner.kv_cache,
                    EngineLoopAllocator(self.loop),
                    spec.transfer,
                    on_result=self.service.on_transfer_result,
                    tls=tls,
                )
            self.service.receiver = self.receiver
            # What the router may name for this worker's pairs: the transports its receiver holds.
            self.service.node = describe_node(spec.node_id, engine.runner.kv_cache, self.receiver.transports)
        self._server, port, _ = start_grpc(
            spec, lambda s: worker_pb2_grpc.add_DecodeWorkerServicer_to_server(self.service, s), [SERVICE]
        )
        self.address = f"{spec.public_host}:{port}"
        self.service.address = self.address
        self.metrics = WorkerMetrics(
            spec, self.loop, self.receiver.stats if self.receiver is not None else None
        )
        self.metrics_address = self.metrics.start()
        log.info("decode worker %s (%s) serving on %s", spec.worker_id, spec.role.value, self.address)
        self.started()
        return self.address

    def _drainable(self) -> DecodeService | None:
        return self.service

    def _transfer(self) -> KVReceiver | ShardedReceiver | None:
        return self.receiver

    def _forget_transfer(self) -> None:
        self.receiver = None
