"""PrefillWorker: one prefill worker process: engine (prefill only) + loop + KV sender + gRPC service."""

from __future__ import annotations

import logging

from kv_transfer import KVSender, SendResult
from model_runtime.engine import Engine
from model_runtime.engine_loop import EngineLoop
from model_runtime.parallel.group import TPGroup
from model_runtime.roles import WorkerRole
from prefill_worker.service import PrefillService
from tandem_api.tandem.v1 import worker_pb2_grpc
from worker_host.host import start_grpc
from worker_host.lifecycle import WorkerLifecycle
from worker_host.metrics import WorkerMetrics
from worker_host.node import describe_node
from worker_host.rank_agents import AgentHub, ShardedSender
from worker_host.spec import WorkerSpec

log = logging.getLogger(__name__)
SERVICE = "tandem.v1.PrefillWorker"


class PrefillWorker(WorkerLifecycle):
    def __init__(
        self, spec: WorkerSpec, tp_group: TPGroup | None = None, agents: AgentHub | None = None
    ) -> None:
        """`tp_group`, `agents`: a worker spanning several devices (this process is rank 0; deploy.ranks) and
        its other ranks' KV agents: every rank sends the heads of its own cache."""
        if spec.role is not WorkerRole.PREFILL:
            raise ValueError(f"role: a PrefillWorker is 'prefill', got {spec.role.value!r}")
        if tp_group is not None and tp_group.size > 1 and agents is None:
            raise ValueError("a prefill worker of several devices needs its ranks' KV agents (deploy.ranks)")
        super().__init__(spec)
        self.tp_group = tp_group
        self.agents = agents
        self.sender: KVSender | ShardedSender | None = None
        self.split: ShardedSender | None = None  # one rank, sending to decode workers of several
        self.service: PrefillService | None = None

    def start(self) -> str:
        spec = self.spec
        engine = Engine(
            spec.engine,
            prefill_only=True,
            emit_text=False,
            on_progress=self._progress,
            tp_group=self.tp_group,
        )
        loop = self.loop = EngineLoop(engine)
        loop.start()

        def release(result: SendResult) -> None:  # the sender no longer reads these blocks
            loop.call(lambda e: e.release_blocks(result.src_block_ids))

        self._progress("opening the KV sender and the gRPC port")
        tls = (
            spec.tls.member_client_context() if spec.tls is not None else None
        )  # to decode workers' KV ports
        layer_groups = spec.transfer.layer_groups
        if self.agents is not None:
            tp = engine.runner.tensor_parallel
            publisher = tp.publisher if tp is not None else None
            if publisher is None:
                raise RuntimeError("a prefill worker of several ranks must be rank 0")
            self._progress("waiting for the other ranks' KV agents")
            self.sender = ShardedSender(
                engine.layout,
                engine.runner.kv_cache,
                spec.transfer,
                self.agents,
                lambda: publisher.published,
                on_release=release,
                tls=tls,
            )
            if layer_groups:
                log.info("transfer.layer_groups %d: not with several ranks; each sends after the prompt's step",
                         layer_groups)  # fmt: skip
                layer_groups = 0
            split = None
        else:
            self.sender = KVSender(
                engine.layout, engine.runner.kv_cache, spec.transfer, on_release=release, tls=tls
            )
            # A decode worker of several ranks takes one transfer per rank: a sender of their own pairs.
            split = ShardedSender(
                engine.layout,
                engine.runner.kv_cache,
                spec.transfer,
                None,
                lambda: 0,
                on_release=release,
                tls=tls,
                recorder=self.sender.recorder,  # its requests count in the worker's KV metrics too
            )
        self.split = split
        self.service = PrefillService(
            spec.worker_id, loop, self.sender, spec.prefill_timeout_s, layer_groups, split
        )
        sender_id = self.sender.instance_id if isinstance(self.sender, KVSender) else b""  # one rank: armable
        self.service.node = describe_node(
            spec.node_id, engine.runner.kv_cache, self.sender.transports, sender_id
        )
        self._server, port, _ = start_grpc(
            spec, lambda s: worker_pb2_grpc.add_PrefillWorkerServicer_to_server(self.service, s), [SERVICE]
        )
        self.address = f"{spec.public_host}:{port}"
        self.service.address = self.address
        self.metrics = WorkerMetrics(spec, self.loop, self.sender.stats)
        self.metrics_address = self.metrics.start()
        log.info("prefill worker %s serving on %s", spec.worker_id, self.address)
        self.started()
        return self.address

    def _drainable(self) -> PrefillService | None:
        return self.service

    def _transfer(self) -> KVSender | ShardedSender | None:
        return self.sender

    def _forget_transfer(self) -> None:
        self.sender = None
        if self.split is not None:
            self.split.close()
            self.split = None
