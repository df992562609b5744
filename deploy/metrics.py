"""Prometheus wiring for `tandem serve`: the router's /metrics server and the file_sd target list.

Every worker serves its own /metrics (worker_host.metrics) on an ephemeral port and reports it to the
controller; the router's is router.host:router.metrics_port (0: off). With router.metrics_file_sd set, the list
of every live endpoint is rewritten atomically on each membership change, in Prometheus' file_sd format:

    [{"targets": ["127.0.0.1:9464"], "labels": {"component": "router"}},
     {"targets": ["127.0.0.1:40123", ...], "labels": {"component": "decode"}}, ...]

The group label is `component`, not `role`: a target label that a metric also carries would be renamed
`exported_role` by Prometheus (honor_labels: false), and every Tandem metric carries its own role or model.
deploy/prometheus/prometheus.yml scrapes such a list.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, disable_created_metrics, start_http_server

from deploy.config import DeployConfig
from deploy.controller import Publish
from deploy.slots import Member
from model_runtime.roles import WorkerRole
from router.prometheus import PrometheusRouterMetrics

log = logging.getLogger(__name__)
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def scrape_host(host: str) -> str:
    """The address Prometheus (beside `tandem serve`) dials for a server bound to `host`."""
    if host in WILDCARD_HOSTS:
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


class MetricsHTTPServer:
    """prometheus_client's /metrics server over one registry, on host:port (port 0: any free port)."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry) -> None:
        disable_created_metrics()  # process-wide: `_created` samples would double the series Prometheus stores
        try:
            server, thread = start_http_server(port, host, registry)
        except OSError as exc:
            raise OSError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}") from exc
        self._server: WSGIServer | None = server
        self._thread = thread
        self.port = int(server.server_port)
        self.address = f"{scrape_host(host)}:{self.port}"

    def close(self) -> None:
        """Stop serving; safe twice."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
            self._thread.join(timeout=5)


@dataclass(frozen=True)
class TargetGroup:
    """One file_sd entry: these host:port targets share the `component` label."""

    component: str
    targets: tuple[str, ...]

    def to_json(self) -> dict[str, object]:
        return {"targets": list(self.targets), "labels": {"component": self.component}}


def target_groups(router_targets: Sequence[str], members: Sequence[Member]) -> list[TargetGroup]:
    """Router targets first, then one group per worker role, in member order; members without a metrics
    address (not reported yet) are left out, and empty groups are dropped."""
    groups = [TargetGroup("router", tuple(router_targets))] if router_targets else []
    by_role: dict[WorkerRole, list[str]] = {}
    for member in members:
        if member.metrics_address:
            by_role.setdefault(member.role, []).append(member.metrics_address)
    groups += [TargetGroup(str(role), tuple(targets)) for role, targets in by_role.items()]
    return groups


def write_file_sd(path: Path, groups: Sequence[TargetGroup]) -> None:
    """Write the list atomically (temp file in the same directory, then rename): Prometheus never reads half."""
    text = json.dumps([g.to_json() for g in groups], indent=2) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; a Prometheus running as another user must read it
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class ServeMetrics:
    """What `tandem serve` runs for Prometheus. Use: router_metrics for RouterServer, start(), wrap(publish)
    for the controller, close() at the end (safe twice; leaves an empty target list behind)."""

    def __init__(self, config: DeployConfig, in_process_router: bool) -> None:
        settings = config.router
        self._settings = settings
        serve_router = in_process_router and settings.metrics_port != 0
        self.router_metrics = PrometheusRouterMetrics(config.model) if serve_router else None
        # What router.metrics_port serves from this process: the in-process router's metrics; beside standalone
        # routers (Kubernetes), only the autoscaler's when it is on (the routers serve their own).
        self.registry: CollectorRegistry | None = None
        if self.router_metrics is not None:
            self.registry = self.router_metrics.registry
        elif config.autoscaler.enabled and settings.metrics_port != 0:
            self.registry = CollectorRegistry()
        self.file_sd = Path(settings.metrics_file_sd) if settings.metrics_file_sd else None
        self._server: MetricsHTTPServer | None = None
        self._lock = threading.Lock()
        self._members: list[Member] = []
        self._more_routers: tuple[str, ...] = ()  # router.processes > 1: the other router processes' /metrics

    @property
    def router_address(self) -> str:
        """host:port of the in-process router's /metrics ("" when not served)."""
        return self._server.address if self._server is not None and self.router_metrics else ""

    @property
    def address(self) -> str:
        """host:port of this process's /metrics (the router's, or beside standalone routers the autoscaler's)."""
        return self._server.address if self._server is not None else ""

    def start(self) -> None:
        """Serve the router's /metrics (if any) and write the first target list. Raises OSError naming the
        address or path when either cannot be had."""
        if self.registry is not None and self._server is None:
            s = self._settings
            self._server = MetricsHTTPServer(s.host, s.metrics_port, self.registry)
        if self.file_sd is not None:
            self.file_sd.parent.mkdir(parents=True, exist_ok=True)
            self._write(strict=True)

    def wrap(self, publish: Publish) -> Publish:
        """The controller's publish callback, rewriting the target list before passing membership on."""

        def publish_and_write(members: list[Member], generation: int) -> object:
            with self._lock:
                self._members = list(members)
            self._write()
            return publish(members, generation)

        return publish_and_write

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if self.file_sd is not None and self.file_sd.parent.is_dir():
            with self._lock:
                self._members = []
            self._write()

    def add_router_targets(self, addresses: Sequence[str]) -> None:
        """The /metrics of `tandem serve`'s other router processes (router.processes > 1) join the list."""
        with self._lock:
            self._more_routers = (*self._more_routers, *(a for a in addresses if a))
        self._write()

    def _write(self, strict: bool = False) -> None:
        """strict: raise (start-up); otherwise log, since discovery must not take serving down."""
        if self.file_sd is None:
            return
        with self._lock:
            router = [self.router_address] if self.router_address else []
            router += self._more_routers
            groups = target_groups(router, self._members)
            try:
                write_file_sd(self.file_sd, groups)
            except OSError as exc:
                if strict:
                    raise OSError(f"router.metrics_file_sd: cannot write {self.file_sd}: {exc}") from exc
                log.error("cannot write the Prometheus target list %s: %s", self.file_sd, exc)
