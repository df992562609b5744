"""The deploy config's router section (deploy.config): where the router listens, its limits, local prefill and
spill, the stream interval, how many router processes, and router.auth, each validated with errors naming the
key path; and the value checks the rest of the deploy config shares."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from model_runtime.config import ConfigError, dataclass_from_dict
from router.config import MAX_STREAM_INTERVAL

MAX_ROUTER_PROCESSES = 64


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # YAML `true` is no port number


def is_number(value: object) -> bool:
    return is_int(value) or isinstance(value, float)


@dataclass(frozen=True)
class AuthSettings:
    """router.auth: API keys on the router's public APIs (router/auth/keys.py documents the key file).
    api_keys_file "" (the default) asks for no keys; reload_interval_s is how often its mtime is checked."""

    api_keys_file: str = ""
    reload_interval_s: float = 2.0

    def __post_init__(self) -> None:
        if not isinstance(self.api_keys_file, str):
            raise ConfigError(
                f'router.auth.api_keys_file: must be the path of the API key file ("": no keys), '
                f"got {self.api_keys_file!r}"
            )
        if not is_number(self.reload_interval_s) or not self.reload_interval_s > 0:
            raise ConfigError(
                f"router.auth.reload_interval_s: must be a number of seconds > 0, got {self.reload_interval_s!r}"
            )


@dataclass(frozen=True)
class RouterSettings:
    host: str = "127.0.0.1"
    port: int = 50051
    http_port: int = 8000  # the OpenAI-compatible HTTP API on host:http_port; 0 disables it (gRPC only)
    metrics_port: int = 9464  # 0 disables the metrics endpoint
    max_queue: int = 256
    max_inflight: int = 256
    request_timeout_s: float = 600.0
    default_max_tokens: int = 256
    # Prometheus file_sd list (.json) that `tandem serve` rewrites with the router's and every live worker's
    # /metrics address on each membership change; "" writes none (deploy/metrics.py).
    metrics_file_sd: str = ""
    # How the router watches workers and waits on them (router/config.py documents each).
    poll_interval_s: float = 0.5
    poll_timeout_s: float = 1.0
    dead_after_failed_polls: int = 3
    worker_rpc_timeout_s: float = 10.0
    worker_retries: int = 2
    # Local prefill: a request whose decode worker would compute at most this many prompt tokens (short, or
    # mostly in its prefix cache) is prefilled there, while its queued prompt tokens stay within the second
    # setting; 0 turns it off (router/placement.py, LocalPrefill).
    local_prefill_max_tokens: int = 0
    local_prefill_max_queued_tokens: int = 2048
    # Spill: any prompt is prefilled on its decode worker while every prefill worker has at least this many prompt
    # tokens queued and the decode worker's own queue stays within it; 0 turns it off (LocalPrefill).
    local_prefill_spill_tokens: int = 0
    # Output tokens gathered per message to a client (the first token and the last ones go at once); 1: every
    # step's tokens as they come. Larger values cut the router's CPU per token (router.config.RouterConfig).
    stream_interval: int = 1
    auth: AuthSettings = field(default_factory=AuthSettings)
    # `tandem serve` / the Ray job: how many router processes relay requests (one relays on the order of 10k
    # tokens/s). The first runs in the serving process on the ports above; process i (1, 2, ...) is a standalone
    # router on port + i, and on http_port + i and metrics_port + i where those are on. The controller pushes the
    # worker set to every one; each places its own requests. On Kubernetes the chart's router.replicas does this.
    processes: int = 1

    def __post_init__(self) -> None:
        for name in ("poll_interval_s", "poll_timeout_s", "worker_rpc_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"router.{name}: must be > 0 seconds, got {getattr(self, name)}")
        if self.dead_after_failed_polls < 1 or self.worker_retries < 0:
            raise ConfigError("router.dead_after_failed_polls / router.worker_retries: must be >= 1 / >= 0")
        if not isinstance(self.metrics_file_sd, str) or (
            self.metrics_file_sd and not self.metrics_file_sd.endswith(".json")
        ):
            raise ConfigError(
                f"router.metrics_file_sd: must be a path ending in .json (Prometheus reads file_sd by "
                f"extension) or empty, got {self.metrics_file_sd!r}"
            )
        for name in ("port", "http_port", "metrics_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ConfigError(f"router.{name}: must be in [0, 65535], got {getattr(self, name)}")
        if self.http_port and self.http_port in (self.port, self.metrics_port):
            raise ConfigError(
                f"router.http_port: {self.http_port} is taken by router.port or router.metrics_port; "
                "pick another (0 turns the HTTP API off)"
            )
        if not is_int(self.processes) or not 1 <= self.processes <= MAX_ROUTER_PROCESSES:
            raise ConfigError(
                f"router.processes: must be an integer in [1, {MAX_ROUTER_PROCESSES}], got {self.processes!r}"
            )
        self._check_port_ranges()
        for name in ("max_queue", "max_inflight", "default_max_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"router.{name}: must be >= 1, got {getattr(self, name)}")
        if not self.request_timeout_s > 0:
            raise ConfigError(f"router.request_timeout_s: must be > 0, got {self.request_timeout_s}")
        if self.local_prefill_spill_tokens < 0:
            raise ConfigError(
                f"router.local_prefill_spill_tokens: must be >= 0 (0: off), got {self.local_prefill_spill_tokens}"
            )
        if not is_int(self.stream_interval) or not 1 <= self.stream_interval <= MAX_STREAM_INTERVAL:
            raise ConfigError(
                f"router.stream_interval: must be an integer in [1, {MAX_STREAM_INTERVAL}] (output tokens per "
                f"client message), got {self.stream_interval!r}"
            )
        if self.local_prefill_max_tokens < 0 or self.local_prefill_max_queued_tokens < 1:
            raise ConfigError(
                "router.local_prefill_max_tokens / router.local_prefill_max_queued_tokens: must be >= 0 / >= 1, "
                f"got {self.local_prefill_max_tokens} / {self.local_prefill_max_queued_tokens}"
            )

    def process_ports(self, index: int) -> RouterSettings:
        """These settings for router process `index` (0: the serving process's own): every port that is on
        (not 0) moved up by index."""
        if not 0 <= index < self.processes:
            raise ValueError(f"router process {index}: there are {self.processes}")
        return replace(
            self,
            port=self.port + index if self.port else 0,
            http_port=self.http_port + index if self.http_port else 0,
            metrics_port=self.metrics_port + index if self.metrics_port else 0,
        )

    def _check_port_ranges(self) -> None:
        """With several processes, each of port, http_port and metrics_port that is on takes `processes`
        consecutive ports: the ranges must fit below 65536 and must not overlap."""
        if self.processes == 1:
            return
        ranges = [(n, getattr(self, n)) for n in ("port", "http_port", "metrics_port") if getattr(self, n)]
        for name, first in ranges:
            if first + self.processes - 1 > 65535:
                raise ConfigError(
                    f"router.{name}: {self.processes} router processes need ports {first}-"
                    f"{first + self.processes - 1}, past 65535"
                )
        for i, (name, first) in enumerate(ranges):
            for other, start in ranges[i + 1 :]:
                if abs(first - start) < self.processes:
                    raise ConfigError(
                        f"router.{other}: with router.processes {self.processes}, router.{name} and "
                        f"router.{other} each take {self.processes} consecutive ports, and {first} and {start} "
                        f"overlap; space them at least {self.processes} apart"
                    )


def parse_router(data: Any) -> RouterSettings:
    if not isinstance(data, dict):
        raise ConfigError(f"router: must be a mapping, got {type(data).__name__}")
    auth = data.get("auth") or {}
    if not isinstance(auth, dict):
        raise ConfigError(f"router.auth: must be a mapping (api_keys_file, reload_interval_s), got {auth!r}")
    fields = {**data, "auth": dataclass_from_dict(AuthSettings, auth, "router.auth")}
    return dataclass_from_dict(RouterSettings, fields, "router")  # type: ignore[no-any-return]
