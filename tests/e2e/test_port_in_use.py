"""A port another process already serves is refused, not shared: gRPC's default SO_REUSEPORT would let a second
router or worker bind it and take a random part of the first one's connections (two `tandem serve` clusters
given one router.port would each get about half of the clients)."""

from __future__ import annotations

import asyncio
import socket
from concurrent import futures

import grpc
import pytest

from model_runtime.config import EngineConfig
from model_runtime.roles import WorkerRole
from router.config import RouterConfig
from router.model import ServedModel
from router.server import RouterServer
from worker_host.host import start_grpc
from worker_host.spec import WorkerSpec

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_second_router_on_the_same_port_fails_naming_the_field(served_model: ServedModel) -> None:
    port = free_port()

    async def run() -> None:
        first = RouterServer(RouterConfig(host="127.0.0.1", port=port, http_port=None), model=served_model)
        await first.start()
        try:
            second = RouterServer(
                RouterConfig(host="127.0.0.1", port=port, http_port=None), model=served_model
            )
            with pytest.raises(
                OSError, match=rf"router\.port: cannot bind the router to 127\.0\.0\.1:{port}"
            ):
                await second.start()
            await second.stop(0)
        finally:
            await first.stop(0)

    asyncio.run(run())


def test_a_worker_port_held_by_another_server_is_refused() -> None:
    held = grpc.server(futures.ThreadPoolExecutor(1))
    port = held.add_insecure_port("127.0.0.1:0")
    held.start()
    try:
        spec = WorkerSpec("w0", WorkerRole.DECODE, EngineConfig(model="dummy:tiny-llama"), port=port)
        with pytest.raises(RuntimeError, match=f"w0: cannot listen on 127.0.0.1:{port}"):
            start_grpc(spec, lambda server: None, [])
    finally:
        held.stop(0)
