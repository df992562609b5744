"""What the router takes from the deployment: its RouterConfig (from the deploy config) and its members (the
controller's live workers as RouterControl endpoints)."""

from __future__ import annotations

from deploy.config import DeployConfig
from deploy.slots import Member
from router.config import RouterConfig
from tandem_api.tandem.v1 import worker_pb2


def router_config(config: DeployConfig) -> RouterConfig:
    """The router must agree with the workers on the context length: take the smallest any pool allows."""
    lens = [
        p.engine.scheduler.max_model_len for p in config.pools().values() if p.engine.scheduler.max_model_len
    ]
    r = config.router
    return RouterConfig(
        host=r.host,
        port=r.port,
        http_port=r.http_port or None,  # 0: no HTTP API
        model=config.model,
        max_model_len=min(lens) if lens else None,
        default_max_tokens=r.default_max_tokens,
        max_inflight=r.max_inflight,
        max_queue=r.max_queue,
        request_timeout_s=r.request_timeout_s,
        poll_interval_s=r.poll_interval_s,
        poll_timeout_s=r.poll_timeout_s,
        dead_after_failed_polls=r.dead_after_failed_polls,
        worker_rpc_timeout_s=r.worker_rpc_timeout_s,
        worker_retries=r.worker_retries,
        local_prefill_max_tokens=r.local_prefill_max_tokens,
        local_prefill_max_queued_tokens=r.local_prefill_max_queued_tokens,
        local_prefill_spill_tokens=r.local_prefill_spill_tokens,
        stream_interval=r.stream_interval,
        lease_ttl_s=config.transfer.lease_ttl_s,
        transfer_kinds=config.transfer.kinds,
        api_keys_file=r.auth.api_keys_file or None,  # "": no keys
        api_keys_reload_s=r.auth.reload_interval_s,
        tls=config.tls.router_server(),
        worker_tls=config.tls.cluster.worker_client() if config.tls.cluster else None,
    )


def endpoints(members: list[Member]) -> list[worker_pb2.WorkerEndpoint]:
    return [
        worker_pb2.WorkerEndpoint(
            worker_id=m.worker_id, role=m.role.wire, address=m.address, draining=m.draining
        )
        for m in members
    ]
