"""Pushing worker membership to standalone routers (Kubernetes: every pod behind a headless Service).

The controller calls `publish(members, generation)` on every change; a background thread re-sends the last set
every `interval_s`, so a router pod that starts later (or restarted) learns the membership within one interval.
Each target "name:port" is resolved on every round, so new pods behind a headless name are reached.
With TLS on the routers (deploy config tls.router), each pod is dialled by IP and its certificate is checked
for the target's name, as a client dialling the name would (`RouterDialer`). A router that asks for API keys
takes a worker set only with an admin key or over mutual TLS with a cluster certificate
(router.auth.control): the publisher sends `api_key()` (controller.admin_key_file, else $TANDEM_API_KEY) when
there is one, and its cluster certificate when tls.cluster is set.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Sequence

import grpc

from deploy.router_inputs import endpoints
from deploy.slots import Member
from tandem_api.tandem.v1 import worker_pb2, worker_pb2_grpc
from tandem_client.channel import API_KEY_ENV, auth_metadata
from tandem_client.tls import TLSFiles

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


class RouterDialer:
    """Channels to router pods: plaintext, or with `tls` (read once, here) a TLS channel that checks the pod's
    certificate for the name it was resolved from (tls.server_name, when set, wins)."""

    def __init__(self, tls: TLSFiles | None) -> None:
        self._tls = tls
        self._credentials = tls.channel_credentials() if tls is not None else None

    def channel(self, address: str, target: str) -> grpc.Channel:
        if self._tls is None or self._credentials is None:
            return grpc.insecure_channel(address)
        host = target.rpartition(":")[0].strip("[]")
        return grpc.secure_channel(address, self._credentials, options=self._tls.channel_options(host))


class AdminKeyError(ValueError):
    """controller.admin_key_file cannot be used; the message names the field and the file."""


def admin_key_reader(path: str) -> Callable[[], str | None]:
    """The controller's admin key for its pushes: read from `path` on every call (a Kubernetes Secret update
    arrives without a restart), or $TANDEM_API_KEY when path is "". Raises AdminKeyError now when `path` cannot
    be read or is empty, so a bad setting fails at start; a later failed read keeps the last good key."""
    if not path:
        return lambda: os.environ.get(API_KEY_ENV) or None
    last = _read_key(path)

    def current() -> str | None:
        nonlocal last
        try:
            last = _read_key(path)
        except AdminKeyError as exc:
            log.warning("%s; pushing with the key read before", exc)
        return last

    return current


def _read_key(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            key = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise AdminKeyError(f"controller.admin_key_file: cannot read {path!r} ({exc})") from None
    if not key:
        raise AdminKeyError(f"controller.admin_key_file: {path!r} is empty")
    return key


class RouterPublisher:
    def __init__(
        self,
        targets: Sequence[str],
        interval_s: float = 2.0,
        timeout_s: float = 2.0,
        tls: TLSFiles | None = None,
        api_key: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.targets = tuple(targets)
        self._api_key = api_key
        self._dialer = RouterDialer(tls)
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

    def set_targets(self, targets: Sequence[str]) -> None:
        """Push to these from now on (a restarted router process on new ports), starting now."""
        self.targets = tuple(targets)
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
        try:
            metadata = auth_metadata(self._api_key())
        except ValueError:  # never the key itself in a log
            log.error(
                "controller.admin_key_file: the key has spaces or unprintable characters; pushing without"
            )
            metadata = ()
        for target in self.targets:
            for address in resolve_all(target):
                self._send(address, target, message, metadata)

    def _send(
        self,
        address: str,
        target: str,
        message: worker_pb2.WorkerSet,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> None:
        try:
            with self._dialer.channel(address, target) as channel:
                stub = worker_pb2_grpc.RouterControlStub(channel)
                stub.SetWorkers(message, timeout=self.timeout_s, metadata=metadata)
        except grpc.RpcError as exc:
            log.info("router %s did not take the membership: %s", address, exc.code())
