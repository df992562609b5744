"""The parts a worker process is built from; PrefillWorker.start and DecodeWorker.start assemble them.

    EngineLoopAllocator   the engine's block pool as kv_transfer's BlockAllocator (calls run on the loop thread)
    start_grpc            a sync gRPC server (a thread per open stream) with the standard health service
    OpenCalls             the request streams a service has open; drain waits until none is left
    wait_idle             drain: wait until no request stream is open and the engine holds no request

Lifecycle (worker_host.lifecycle.WorkerLifecycle; stop is safe twice or on a half-started worker):
    start:  engine (weights, KV cache) -> loop thread -> role-specific parts (KV sender/receiver) -> gRPC
    ready:  `address` is set and Status answers READY
    drain:  new requests get UNAVAILABLE; running ones finish (up to the drain timeout)
    stop:   gRPC server (cancels streams) -> KV transfer (in-flight transfers fail, blocks return) -> loop
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from model_runtime.engine import Engine
from model_runtime.engine_loop import EngineLoop
from tandem_client.tls import plaintext_warning
from worker_host.spec import WorkerSpec

log = logging.getLogger(__name__)


def take_blocks(engine: Engine, num_blocks: int) -> list[int] | None:
    """`num_blocks` blocks from the engine's pool, or None when there is no room (on the engine thread)."""
    return engine.pool.allocate(num_blocks) if engine.pool.can_allocate(num_blocks) else None


class EngineLoopAllocator:
    """The engine's block pool as kv_transfer's BlockAllocator. It takes no lock of its own: every call is queued
    onto the engine loop's thread (EngineLoop.call), which serializes it with the engine's steps."""

    def __init__(self, loop: EngineLoop) -> None:
        self._loop = loop

    def allocate(self, num_blocks: int) -> list[int] | None:
        return self._loop.call(lambda engine: take_blocks(engine, num_blocks))

    def free(self, block_ids: Sequence[int]) -> None:
        self._loop.call(lambda e: e.pool.free(list(block_ids)))


def start_grpc(
    spec: WorkerSpec, register: Callable[[grpc.Server], None], service_names: Sequence[str]
) -> tuple[grpc.Server, int, health.HealthServicer]:
    """A sync gRPC server (one thread per open stream) with the standard health service; with spec.tls it
    takes only TLS connections from peers that present a certificate from the cluster CA."""
    server = grpc.server(
        concurrent.futures.ThreadPoolExecutor(
            spec.max_concurrent_rpcs, thread_name_prefix=f"{spec.worker_id}-rpc"
        ),
        maximum_concurrent_rpcs=spec.max_concurrent_rpcs,
        # No SO_REUSEPORT (gRPC's default): a worker given a port another process holds fails to bind instead
        # of sharing it and taking a random part of its calls.
        options=[("grpc.max_receive_message_length", 64 * 2**20), ("grpc.so_reuseport", 0)],
    )
    register(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        port = _bind(server, spec)
    except RuntimeError:  # grpcio raises where older releases returned 0
        port = 0
    if port == 0:
        raise RuntimeError(f"worker {spec.worker_id}: cannot listen on {spec.host}:{spec.port}")
    server.start()
    for name in ("", *service_names):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, port, health_servicer


def _bind(server: grpc.Server, spec: WorkerSpec) -> int:
    address = f"{spec.host}:{spec.port}"
    if spec.tls is not None:
        return server.add_secure_port(address, spec.tls.server_credentials())
    warning = plaintext_warning(f"worker {spec.worker_id}'s gRPC server", spec.host)
    if warning:
        log.warning(warning)
    return server.add_insecure_port(address)


class OpenCalls:
    """Request streams (Prefill / Decode calls) open on a service. A call's whole life counts, not only the
    part the engine sees: a decode call waiting for its KV, a prefill call whose KV is still being shipped."""

    def __init__(self) -> None:
        self._count = 0
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        return self._count

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        with self._lock:
            self._count += 1
        try:
            yield
        finally:
            with self._lock:
                self._count -= 1


def wait_idle(loop: EngineLoop, calls: OpenCalls, timeout_s: float) -> bool:
    """Drain: wait until no request stream is open and the engine holds no request (True), or the timeout
    passes (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if calls.count == 0 and not loop.call(lambda e: e.has_unfinished()):
            return True
        time.sleep(0.05)
    return False
