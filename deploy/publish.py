"""Pushing worker membership to standalone routers (Kubernetes: every pod behind a headless Service).

The controller calls `publish(members, generation)` on every change; a background thread re-sends the last set
every `interval_s`, so a router pod that starts later (or restarted) learns the membership within one interval.
Each target "name:port" is resolved on every round, so new pods behind a headless name are reached.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Sequence

import grpc

from deploy.router_inputs import endpoints
from deploy.slots import Member
from tandem_api.tandem.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)


def resolve_all(target: str) -> list[str]:
    """Every address a "host:port" resolves to, as "ip:port" (IPv6 bracketed)."""
    host, _, port = target.rpartition(":")
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (OSError, ValueError) as exc:
        log.warning("cannot resolve router %s: %s", target, exc)
        return []
    addrs = sorted({str(info[4][0]) for info in infos})
    return [f"[{a}]:{port}" if ":" in a else f"{a}:{port}" for a in addrs]


class RouterPublisher:
    def __init__(self, targets: Sequence[str], interval_s: float = 2.0, timeout_s: float = 2.0) -> None:
        self.targets = tuple(targets)
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._last: worker_pb2.WorkerSet | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="router-publisher", daemon=True)
        self._thread.start()

    def publish(self, members: list[Member], generation: int) -> None:
        with self._lock:
            self._last = worker_pb2.WorkerSet(workers=endpoints(members), generation=generation)
        self._send_all()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._send_all()

    def _send_all(self) -> None:
        with self._lock:
            message = self._last
        if message is None:
            return
        for target in self.targets:
            for address in resolve_all(target):
                self._send(address, message)

    def _send(self, address: str, message: worker_pb2.WorkerSet) -> None:
        try:
            with grpc.insecure_channel(address) as channel:
                worker_pb2_grpc.RouterControlStub(channel).SetWorkers(message, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            log.info("router %s did not take the membership: %s", address, exc.code())
