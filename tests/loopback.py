"""Ports and gRPC health on 127.0.0.1, for tests that start servers: one copy of each, shared by every tier.

A free port is found by binding port 0 and closing the socket, so another process may take it before the test
binds it; tests accept that small race rather than hold sockets open across a subprocess start.
"""

from __future__ import annotations

import socket
from contextlib import ExitStack

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(count: int) -> list[int]:
    """`count` distinct free ports (all held open together, so none repeats)."""
    with ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]


def consecutive_free_ports(count: int) -> int:
    """The first of `count` consecutive ports that are free right now (for a server that takes a port range)."""
    for _ in range(50):
        first = free_port()
        if first + count > 65535:
            continue
        with ExitStack() as stack:
            try:
                for port in range(first, first + count):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
        return first
    raise RuntimeError(f"no {count} consecutive free ports found")


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def health(address: str, service: str = "", timeout_s: float = 2.0) -> int | None:
    """The grpc.health.v1 status of `service` ("" is the whole server) at `address`, or None when no answer
    came (nothing listening, the deadline passed, an unknown service)."""
    try:
        with grpc.insecure_channel(address) as channel:
            request = health_pb2.HealthCheckRequest(service=service)
            return int(health_pb2_grpc.HealthStub(channel).Check(request, timeout=timeout_s).status)
    except grpc.RpcError:
        return None
