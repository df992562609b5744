"""Helpers the worker services share: bounded waits inside a gRPC handler, and the Status reply."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from typing import TypeVar

import grpc

from model_runtime.engine_loop import EngineLoop
from tandem_api.tandem.v1 import admin_pb2
from worker_host.node import WorkerNode

T = TypeVar("T")
POLL_S = 0.1  # how often a waiting handler re-checks that its call is still alive


class CallEnded(Exception):
    """The RPC was cancelled or its deadline passed while the handler waited: stop quietly, clean up."""


def wait_for(
    q: queue.Queue[T],
    context: grpc.ServicerContext,
    loop: EngineLoop,
    deadline: float,
    what: str,
    still_waiting: Callable[[], object] | None = None,
) -> T:
    """The next item of `q`, never waiting past the call's life, the engine's life or `deadline`.
    `still_waiting` runs at each poll while the call lives (a decode call renews its KV lease there)."""
    while True:
        try:
            return q.get(timeout=POLL_S)
        except queue.Empty:
            if not context.is_active():
                raise CallEnded() from None
            if not loop.alive:
                context.abort(grpc.StatusCode.UNAVAILABLE, "the worker's engine loop stopped")
            if time.monotonic() > deadline:
                context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"timed out waiting for {what}")
            if still_waiting is not None:
                still_waiting()


def worker_info(
    loop: EngineLoop,
    *,
    worker_id: str,
    role: admin_pb2.WorkerRole,
    address: str,
    draining: bool,
    active_leases: int,
    known_prefix_version: int = 0,
    node: WorkerNode | None = None,
) -> admin_pb2.WorkerInfo:
    """Built from the counters the loop published last: answers at once even while a long step runs. The prefix
    cache's block hashes come only when the caller's `known_prefix_version` is out of date. `node`: where the
    worker runs and its KV transports (None until start() has described them: the fields stay empty)."""
    if draining:
        state = admin_pb2.WORKER_STATE_DRAINING
    else:
        state = admin_pb2.WORKER_STATE_READY if loop.alive else admin_pb2.WORKER_STATE_DEAD
    c, prefix = loop.counters, loop.prefix
    engine = loop.engine
    info = admin_pb2.WorkerInfo(
        worker_id=worker_id,
        role=role,
        address=address,
        state=state,
        kv_blocks_used=c.kv_blocks_used,
        kv_blocks_total=c.kv_blocks_total,
        running_requests=c.running,
        waiting_requests=c.waiting,
        active_leases=active_leases,
        queued_prefill_tokens=c.queued_prompt_tokens,
        model=engine.config.model,
        layout_fingerprint=engine.layout.whole().fingerprint(),  # pairs across TP sizes
        kv_block_size=engine.layout.block_size,
        prefix_cache_version=prefix.version,
        cached_block_hashes=prefix.block_hashes if prefix.version != known_prefix_version else (),
        cached_prompt_tokens_total=c.cached_prompt_tokens_total,
        requests_total=c.requests_total,
        last_heartbeat_age_seconds=time.monotonic() - loop.last_beat,
        busy_seconds_total=loop.busy_seconds,
        devices=engine.config.parallel.tensor_parallel_size,
    )
    if node is not None:
        info.node_id = node.node_id
        info.kv_transports.extend(node.kv_transport_values)
        info.kv_gpu_uuid = node.kv_gpu_uuid
        info.kv_sender_id = node.kv_sender_id
    return info
