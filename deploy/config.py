"""The deployment config: one YAML file -> frozen, validated dataclasses. Errors name the key path.

model: smollm2-135m-instruct          # served model (HF dir, .gguf, dummy:<shape>, or the embedded default)
mode: disaggregated                   # or colocated (prefill and decode in one worker, same router)
router:   {host, port, http_port, metrics_port, metrics_file_sd, max_queue, max_inflight, request_timeout_s,
           default_max_tokens, local_prefill_max_tokens, local_prefill_max_queued_tokens,
           local_prefill_spill_tokens, ...,
           auth: {api_keys_file, reload_interval_s}}   # API keys and quotas (router/auth); off without a file
prefill:  {replicas, num_gpus, ray_resources, metrics_port, metrics_port_count,
           engine: {cache: {...}, scheduler: {...}, device: {...}}}
decode:   {replicas, num_gpus, engine: {...}}
colocated:{replicas, num_gpus, engine: {...}}   # mode: colocated
transfer: {kinds: [tcp | nccl | cuda_ipc], ...}  # kv_transfer.TransferConfig (or kind: one of them)
ray:      {address: null | auto | ray://..., namespace}
controller: {health_interval_s, heartbeat_timeout_s, restart_limit, drain_timeout_s, routers, admin_key_file}
autoscaler: {enabled, interval_s, window_s, ttft_s, tpot_s, prefill: {min, max}, ...}  # deploy/autoscaler/settings.py
tls:      {router: {cert, key, client_ca, require_client_cert}, cluster: {ca, cert, key, server_name}}  # deploy/tls.py
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from deploy.autoscaler.settings import AutoscalerSettings, parse_autoscaler
from deploy.router_settings import RouterSettings, is_int, parse_router
from deploy.tls import TLSSettings, parse_tls
from kv_transfer import TransferConfig
from model_runtime.config import DECODE_LATE_LAUNCH_MARGIN_S, ConfigError, EngineConfig, dataclass_from_dict
from model_runtime.roles import WorkerRole

MODES = ("disaggregated", "colocated")

# kv_transfer.shard_plan.TP_SIZES (a unit test checks they agree): not imported, the driver stays light.
HANDOFF_TP_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True)
class PoolSettings:
    """One pool of identical workers."""

    replicas: int = 1
    num_gpus: float = 0.0  # per worker; 0 on CPU
    engine: EngineConfig = field(default_factory=EngineConfig)
    # Ray custom resources each worker needs, e.g. {tandem_prefill: 1} to pin the pool to the KubeRay worker
    # group that advertises that resource.
    ray_resources: dict[str, float] = field(default_factory=dict)
    # Ray node labels each worker's node must match (Ray's label selector: "value", "!value", "in(a,b)",
    # "!in(a,b)"), e.g. {"tandem.io/pool": "decode"} for nodes started with `ray start --labels
    # tandem.io/pool=decode`; a worker spanning devices asks it of its node for every rank.
    ray_labels: dict[str, str] = field(default_factory=dict)
    # Where each worker serves its /metrics. 0: an ephemeral port (several workers of a pool share a node, as
    # under `tandem serve`; the file_sd list finds them). A fixed port lets a Kubernetes PodMonitor name it: a
    # worker takes the first free port of metrics_port .. metrics_port + metrics_port_count - 1, so a pod that
    # runs N workers (one per GPU) sets the count to N and exposes those N ports.
    metrics_port: int = 0
    metrics_port_count: int = 1

    def validate(self, where: str) -> None:
        for key, value in self.ray_resources.items():
            if not isinstance(key, str) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"{where}.ray_resources.{key}: must map a name to a positive number")
        for label, selector in self.ray_labels.items():
            if not isinstance(label, str) or not label or not isinstance(selector, str) or not selector:
                raise ConfigError(
                    f"{where}.ray_labels.{label}: must map a label name to a selector string such as "
                    f'"decode", "!decode" or "in(a,b)", got {selector!r}'
                )
        if not isinstance(self.replicas, int) or self.replicas < 0:
            raise ConfigError(f"{where}.replicas: must be an integer >= 0, got {self.replicas!r}")
        if not isinstance(self.num_gpus, (int, float)) or self.num_gpus < 0:
            raise ConfigError(f"{where}.num_gpus: must be >= 0, got {self.num_gpus!r}")
        tp = self.engine.parallel.tensor_parallel_size
        if where != "colocated" and tp not in HANDOFF_TP_SIZES:  # each rank hands over its own KV heads
            raise ConfigError(
                f"{where}.engine.parallel.tensor_parallel_size: a {where} worker hands its KV over between "
                f"workers of {', '.join(map(str, HANDOFF_TP_SIZES))} devices, got {tp}"
            )
        if self.engine.scheduler.async_scheduling and (where == "prefill" or tp > 1):
            raise ConfigError(
                f"{where}.engine.scheduler.async_scheduling: for colocated and decode workers on one device "
                "only (a prefill worker ships its blocks after one token, and tensor-parallel ranks replay the "
                "lead's host inputs)"
            )
        self._validate_metrics_ports(where)

    def _validate_metrics_ports(self, where: str) -> None:
        port, count = self.metrics_port, self.metrics_port_count
        if not is_int(port) or not 0 <= port <= 65535:
            raise ConfigError(
                f"{where}.metrics_port: must be an integer in [0, 65535] (0: an ephemeral port), got {port!r}"
            )
        if not is_int(count) or count < 1:
            raise ConfigError(f"{where}.metrics_port_count: must be an integer >= 1, got {count!r}")
        if port and port + count - 1 > 65535:
            raise ConfigError(
                f"{where}.metrics_port_count: ports {port}..{port + count - 1} run past 65535; "
                f"lower {where}.metrics_port or the count"
            )


@dataclass(frozen=True)
class RaySettings:
    address: str | None = None  # None: start a local Ray; "auto" or an address: join that cluster
    namespace: str = "tandem"


@dataclass(frozen=True)
class ControllerSettings:
    health_interval_s: float = 1.0
    heartbeat_timeout_s: float = 10.0  # a worker whose engine loop has not beaten for this long is replaced
    restart_limit: int = 10  # restarts per worker slot before the controller gives up on it
    drain_timeout_s: float = 30.0
    # Standalone routers (Kubernetes) to push membership to, as host:port; a name that resolves to several
    # addresses (a headless Service) reaches every router pod. Empty: only the in-process router of `serve`.
    routers: tuple[str, ...] = ()
    # Worker-side waits: a prompt's compute on a prefill worker, and a decode worker's whole wait for a
    # prompt's KV (its lease, of term transfer.lease_ttl_s, is renewed meanwhile).
    prefill_timeout_s: float = 600.0
    kv_wait_timeout_s: float = 60.0
    # A file holding an admin API key (admin: true in the routers' key file), sent with the membership pushes
    # to `routers` that ask for keys; read on every push, so a rotated Secret is picked up. "": $TANDEM_API_KEY
    # when set, else no key (then the routers must take the cluster certificate over mutual TLS, or ask for no
    # keys). deploy/publish.py.
    admin_key_file: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.admin_key_file, str):
            raise ConfigError(
                f'controller.admin_key_file: must be the path of a file holding an admin key ("": none), '
                f"got {self.admin_key_file!r}"
            )
        for name in (
            "health_interval_s",
            "heartbeat_timeout_s",
            "drain_timeout_s",
            "prefill_timeout_s",
            "kv_wait_timeout_s",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(f"controller.{name}: must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class DeployConfig:
    model: str = "smollm2-135m-instruct"
    mode: str = "disaggregated"
    router: RouterSettings = field(default_factory=RouterSettings)
    prefill: PoolSettings = field(default_factory=PoolSettings)
    decode: PoolSettings = field(default_factory=PoolSettings)
    colocated: PoolSettings = field(default_factory=lambda: PoolSettings(replicas=0))
    transfer: TransferConfig = field(default_factory=TransferConfig)
    ray: RaySettings = field(default_factory=RaySettings)
    controller: ControllerSettings = field(default_factory=ControllerSettings)
    autoscaler: AutoscalerSettings = field(default_factory=AutoscalerSettings)
    tls: TLSSettings = field(default_factory=TLSSettings)  # absent: plaintext everywhere

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode: must be one of {', '.join(MODES)}, got {self.mode!r}")
        for name in ("prefill", "decode", "colocated"):
            getattr(self, name).validate(name)
        if self.mode == "disaggregated" and (self.prefill.replicas < 1 or self.decode.replicas < 1):
            raise ConfigError(
                "prefill.replicas / decode.replicas: disaggregated mode needs at least one of each"
            )
        if self.mode == "colocated" and self.colocated.replicas < 1:
            raise ConfigError("colocated.replicas: colocated mode needs at least one worker")
        self.autoscaler.check_pools({role: pool.replicas for role, pool in self.pools().items()})
        sizes = {role: pool.engine.parallel.tensor_parallel_size for role, pool in self.pools().items()}
        if self.autoscaler.enabled and self.autoscaler.max_total_workers and len(set(sizes.values())) > 1:
            # The budget counts workers: moving one between pools of different sizes would change the GPUs held.
            spans = ", ".join(f"{role.value} {size}" for role, size in sizes.items())
            raise ConfigError(
                f"autoscaler.max_total_workers: the budget counts workers, and the pools' workers span different "
                f"numbers of devices ({spans}), so moving one between them would change the devices held; set it "
                "to 0 (each pool grows within its own max) or give both pools one tensor_parallel_size"
            )
        if self.router.processes > 1 and self.controller.routers:
            raise ConfigError(
                "router.processes: more than one with controller.routers set; the routers are standalone "
                "already (Kubernetes: the chart's router.replicas), leave router.processes at 1"
            )

    def pools(self) -> dict[WorkerRole, PoolSettings]:
        """role -> pool, for the roles this mode runs."""
        if self.mode == "colocated":
            return {WorkerRole.COLOCATED: self.colocated}
        return {WorkerRole.PREFILL: self.prefill, WorkerRole.DECODE: self.decode}


POOL_KEYS = (
    "engine",
    "metrics_port",
    "metrics_port_count",
    "num_gpus",
    "ray_labels",
    "ray_resources",
    "replicas",
)
TOP_KEYS = {
    "model",
    "mode",
    "router",
    "prefill",
    "decode",
    "colocated",
    "transfer",
    "ray",
    "controller",
    "autoscaler",
    "tls",
}


def parse_config(data: Any, source: str = "config") -> DeployConfig:
    """A parsed YAML mapping -> DeployConfig; raises ConfigError naming the key path."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping, got {type(data).__name__}")
    unknown = sorted(set(data) - TOP_KEYS)
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown key; allowed: {', '.join(sorted(TOP_KEYS))}")
    model = data.get("model", DeployConfig.model)
    if not isinstance(model, str) or not model:
        raise ConfigError(f"model: must be a non-empty string, got {model!r}")
    kwargs: dict[str, Any] = {"model": model, "mode": data.get("mode", DeployConfig.mode)}
    kwargs["router"] = parse_router(data.get("router") or {})
    kwargs["transfer"] = dataclass_from_dict(TransferConfig, data.get("transfer") or {}, "transfer")
    kwargs["ray"] = dataclass_from_dict(RaySettings, data.get("ray") or {}, "ray")
    controller = dict(data.get("controller") or {})
    if "routers" in controller:
        routers = controller["routers"]
        if not isinstance(routers, list) or not all(isinstance(r, str) and ":" in r for r in routers):
            raise ConfigError("controller.routers: must be a list of host:port strings")
        controller["routers"] = tuple(routers)
    kwargs["controller"] = dataclass_from_dict(ControllerSettings, controller, "controller")
    kwargs["autoscaler"] = parse_autoscaler(data.get("autoscaler"))
    kwargs["tls"] = parse_tls(data.get("tls"))
    defaults = {"prefill": 1, "decode": 1, "colocated": 0}
    for role, replicas in defaults.items():
        kwargs[role] = _pool(data.get(role) or {}, role, model, replicas)
    return DeployConfig(**kwargs)


def _pool(data: Any, where: str, model: str, default_replicas: int) -> PoolSettings:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: must be a mapping, got {type(data).__name__}")
    unknown = sorted(set(data) - set(POOL_KEYS))
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: unknown key; allowed: {', '.join(POOL_KEYS)}")
    resources = data.get("ray_resources") or {}
    if not isinstance(resources, dict):
        raise ConfigError(f"{where}.ray_resources: must be a mapping of resource name to amount")
    labels = data.get("ray_labels") or {}
    if not isinstance(labels, dict):
        raise ConfigError(f"{where}.ray_labels: must be a mapping of label name to selector")
    engine_data = dict(data.get("engine") or {})
    if "model" in engine_data:
        raise ConfigError(f"{where}.engine.model: set the model once, at the top level")
    engine = EngineConfig.from_dict({**engine_data, "model": model}, f"{where}.engine")
    if where in ("colocated", "decode") and _ahead_by_default(engine_data, engine):
        engine = replace(engine, scheduler=replace(engine.scheduler, async_scheduling=True))
    if where == "decode" and not _said(engine_data, "late_launch_margin_s"):
        engine = replace(
            engine, scheduler=replace(engine.scheduler, late_launch_margin_s=DECODE_LATE_LAUNCH_MARGIN_S)
        )
    return PoolSettings(
        replicas=data.get("replicas", default_replicas),
        num_gpus=data.get("num_gpus", 0.0),
        engine=engine,
        ray_resources=dict(resources),
        ray_labels=dict(labels),
        metrics_port=data.get("metrics_port", 0),
        metrics_port_count=data.get("metrics_port_count", 1),
    )


def _ahead_by_default(engine_data: dict, engine: EngineConfig) -> bool:
    """Colocated and decode workers on one device schedule each step ahead (scheduler.async_scheduling) unless
    the config says otherwise. Colocated on one H200 it served 1.06-1.16x the output tokens offline and cut the
    TPOT p50 of decode-heavy traffic by 19-50% in the service; with one decode worker behind three prefill
    workers on 4x H200 the prefill-heavy capacity went from 20 to at least 28 req/s and the gap between a
    client's first and second token shrank (docs/performance.md, "Step-ahead scheduling" and "Decode workers
    scheduling ahead")."""
    return not _said(engine_data, "async_scheduling") and engine.parallel.tensor_parallel_size == 1


def _said(engine_data: dict, key: str) -> bool:
    """Whether a pool's engine section sets scheduler.<key> itself."""
    scheduler = engine_data.get("scheduler")
    return isinstance(scheduler, dict) and key in scheduler


def load_config(path: str | Path | None) -> DeployConfig:
    if (
        path is None
    ):  # the defaults of an empty file, per-pool ones included (DeployConfig() has only the fields')
        return parse_config({})
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read the config file ({exc.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from None
    config = parse_config(data, str(p))
    config.tls.check_files()  # a missing or unreadable certificate stops start-up, naming its field
    return config
