"""The deploy config's `tls` section: which listeners use TLS, from which PEM files (absent: plaintext).

tls:
  router:                         # the router's public gRPC API and its OpenAI HTTP API (server TLS)
    cert: /etc/tandem/tls/router/tls.crt
    key: /etc/tandem/tls/router/tls.key
    client_ca: ""                 # CA bundle client certificates must chain to ("" : none asked for)
    require_client_cert: false    # true: refuse clients without one (needs client_ca)
  cluster:                        # router <-> workers, controller -> routers: mutual TLS from one cluster CA
    ca: /etc/tandem/tls/cluster/ca.crt
    cert: /etc/tandem/tls/cluster/tls.crt     # every router, worker and controller holds one from that CA
    key: /etc/tandem/tls/cluster/tls.key
    server_name: tandem-worker    # the name worker certificates carry (routers dial workers by IP)

With `cluster` set, a worker serves only peers that present a certificate from `ca` (the router, the controller,
health checks holding one); the router checks the worker's certificate for `server_name`. The controller dials
routers (controller.routers) with its cluster certificate and checks the router's certificate against the
cluster CA for the routers' host name, so a router certificate for the public API should come from that CA (or
its CA be appended to the `ca` bundle).

Files are checked when the file is loaded (`load_config`), on the machine that loads it; a worker on another
node reads its copy when it starts (on Kubernetes every pod mounts the same Secrets at the same paths).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from model_runtime.config import ConfigError
from tandem_client.tls import ServerTLS, TLSError, TLSFiles

DEFAULT_WORKER_NAME = "tandem-worker"
ROUTER_KEYS = ("cert", "key", "client_ca", "require_client_cert")
CLUSTER_KEYS = ("ca", "cert", "key", "server_name")


@dataclass(frozen=True)
class ClusterTLS:
    """tls.cluster: one CA and this cluster member's certificate; see the module docstring."""

    ca: str = ""
    cert: str = ""
    key: str = ""
    server_name: str = DEFAULT_WORKER_NAME

    def __post_init__(self) -> None:
        for name in CLUSTER_KEYS:
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ConfigError(f"tls.cluster.{name}: must be a non-empty string, got {value!r}")

    def worker_server(self) -> ServerTLS:
        """A worker's server: its certificate, and only clients with a certificate from the cluster CA."""
        return ServerTLS(
            self.cert, self.key, client_ca=self.ca, require_client_cert=True, where="tls.cluster"
        )

    def worker_client(self) -> TLSFiles:
        """The router's channels to workers: the cluster CA, its own certificate, the workers' name."""
        return TLSFiles(self.ca, self.cert, self.key, self.server_name, where="tls.cluster")


@dataclass(frozen=True)
class TLSSettings:
    router: ServerTLS | None = None
    cluster: ClusterTLS | None = None

    def router_server(self) -> ServerTLS | None:
        """The routers' public port: tls.router, whose client certificates may also come from the cluster CA
        (the controller's pushes and the in-pod health probes hold cluster certificates)."""
        if self.router is None or self.cluster is None or not self.router.client_ca:
            return self.router
        return replace(self.router, cluster_ca=self.cluster.ca)

    def router_client(self) -> TLSFiles | None:
        """How the controller dials the routers' public port: None (plaintext) unless tls.router is set;
        then the cluster CA and certificate when tls.cluster is set, else the system's roots."""
        if self.router is None:
            return None
        if self.cluster is None:
            return TLSFiles(where="tls.router")
        return TLSFiles(self.cluster.ca, self.cluster.cert, self.cluster.key, where="tls.cluster")

    def check_files(self) -> None:
        """Read every configured file once; ConfigError naming the first one missing, unreadable or not PEM."""
        router = self.router_server()
        try:
            if router is not None:
                router.check()
            if self.cluster is not None:
                self.cluster.worker_server().check()
                self.cluster.worker_client().check()
        except TLSError as exc:
            raise ConfigError(str(exc)) from None


def parse_tls(data: Any) -> TLSSettings:
    if data is None:
        return TLSSettings()
    if not isinstance(data, dict):
        raise ConfigError(f"tls: must be a mapping (router, cluster), got {type(data).__name__}")
    unknown = sorted(set(data) - {"router", "cluster"})
    if unknown:
        raise ConfigError(f"tls.{unknown[0]}: unknown key; allowed: cluster, router")
    router = _section(data.get("router"), "router", ROUTER_KEYS)
    cluster = _section(data.get("cluster"), "cluster", CLUSTER_KEYS)
    try:
        return TLSSettings(
            router=ServerTLS(**router, where="tls.router") if router else None,
            cluster=ClusterTLS(**cluster) if cluster else None,
        )
    except TLSError as exc:
        raise ConfigError(str(exc)) from None


def _section(data: Any, name: str, keys: tuple[str, ...]) -> dict[str, Any]:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"tls.{name}: must be a mapping ({', '.join(keys)}), got {type(data).__name__}")
    unknown = sorted(set(data) - set(keys))
    if unknown:
        raise ConfigError(f"tls.{name}.{unknown[0]}: unknown key; allowed: {', '.join(keys)}")
    return dict(data)
