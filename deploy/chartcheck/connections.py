"""How the parts find each other: the rendered Tandem config loads with deploy.config and asks Ray for exactly
what the worker groups offer; the controller targets this RayCluster and reads the config where it is mounted; the
routers listen, probe and get pushed to on the ports the config names; the workers serve /metrics on the ports
their pods expose and the PodMonitors scrape."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import yaml

from deploy.chartcheck.objects import (
    container_ports,
    group_custom_resources,
    labels_of,
    named_ports,
    selector_matches,
    worker_groups,
)
from deploy.chartcheck.render import Manifest, Rendering, object_name
from deploy.chartcheck.tls_checks import check_certificates, check_tls_mounts, check_tls_probes
from deploy.config import DeployConfig, PoolSettings, parse_config
from model_runtime.roles import WorkerRole

CONFIG_DIR = "/etc/tandem"
CONFIG_KEY = "tandem.yaml"
CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_KEY}"


def config_map(r: Rendering) -> Manifest:
    maps = [cm for cm in r.objects("ConfigMap") if CONFIG_KEY in (cm.get("data") or {})]
    if len(maps) != 1:
        raise LookupError(f"{r.label}: expected one ConfigMap with {CONFIG_KEY}, found {len(maps)}")
    return maps[0]


def rendered_config(r: Rendering) -> DeployConfig:
    """The Tandem config exactly as the pods will load it (raises deploy's ConfigError when it does not load)."""
    return parse_config(
        yaml.safe_load(config_map(r)["data"][CONFIG_KEY]), f"{r.label} ConfigMap {CONFIG_KEY}"
    )


def check_config(r: Rendering) -> list[str]:
    """Pools match the worker groups: each pool requests its group's custom resource, the groups offer exactly
    the units and at least the GPUs that the pool's workers need, and each worker's ranks fit one pod."""
    config = rendered_config(r)
    found = (
        []
        if config.mode == r.values["mode"]
        else [f"config mode {config.mode}, values say {r.values['mode']}"]
    )
    groups = worker_groups(r)
    for role, pool in config.pools().items():
        group = groups.get(role)
        if group is None:
            found.append(f"config pool {role} has no RayCluster worker group")
            continue
        resource = f"tandem_{role}"
        if pool.ray_resources != {resource: 1}:
            found.append(f"config {role}.ray_resources is {pool.ray_resources}, want {{{resource}: 1}}")
            continue
        found += _placement_problems(role, pool, group)
        if pool.num_gpus == 0 and "tcp" not in config.transfer.kinds:
            found.append(f"{role}: CPU workers with transfer.kinds {list(config.transfer.kinds)} (need tcp)")
        found += _autoscaler_problems(role, config, pool, group)
    return found + _router_config_problems(r, config)


def workers_per_pod(role: str, pool: PoolSettings, group: dict[str, Any]) -> int:
    """How many of the pool's workers one pod of the group holds whole. A worker is tensor_parallel_size ranks,
    each one placement group bundle of num_gpus GPUs and one unit of the role's resource; the group is
    STRICT_PACK, so all its bundles land on one Ray node, that is one pod."""
    ranks = pool.engine.parallel.tensor_parallel_size
    fits = int(group_custom_resources(group).get(f"tandem_{role}", 0) // ranks)
    if pool.num_gpus > 0:
        gpus = int(group["rayStartParams"]["num-gpus"])
        fits = min(fits, int(gpus / (pool.num_gpus * ranks) + 1e-9))
    return fits


def _placement_problems(role: str, pool: PoolSettings, group: dict[str, Any]) -> list[str]:
    """The group offers exactly the resource units the pool's ranks ask for, at least their GPUs, and room for
    every worker's ranks together in one pod (with exact units, that leaves no pod a stranded unit)."""
    resource, ranks, pods = f"tandem_{role}", pool.engine.parallel.tensor_parallel_size, group["replicas"]
    units = group_custom_resources(group).get(resource, 0)
    gpus = int(group["rayStartParams"]["num-gpus"])
    found = []
    need = pool.replicas * ranks
    each = f" ({ranks} ranks each)" if ranks > 1 else ""
    if units * pods != need:
        found.append(
            f"{role}: {pool.replicas} workers need {need} {resource}{each}, the group offers {units * pods}"
        )
    if pool.num_gpus * need > gpus * pods + 1e-9:
        found.append(f"{role}: workers need {pool.num_gpus * need} GPUs, the group has {gpus * pods}")
    per_pod = workers_per_pod(role, pool, group)
    if per_pod * pods < pool.replicas:
        found.append(
            f"{role}: a pod ({units} {resource}, {gpus} GPUs) holds {per_pod} whole workers of {ranks} ranks "
            f"(a worker's ranks share one pod), {per_pod * pods} in {pods} pods, short of {pool.replicas}"
        )
    return found


def _autoscaler_problems(
    role: WorkerRole, config: DeployConfig, pool: PoolSettings, group: dict[str, Any]
) -> list[str]:
    """The SLO autoscaler never asks for more workers than the group's pods can ever hold."""
    if not config.autoscaler.enabled:
        return []
    most = workers_per_pod(role, pool, group) * group["maxReplicas"]
    bounds = config.autoscaler.bounds(role)
    if bounds.max > most:
        return [f"autoscaler.{role}.max is {bounds.max} workers, the group holds at most {most}"]
    return []


def _router_config_problems(r: Rendering, config: DeployConfig) -> list[str]:
    found = []
    if config.router.host != "0.0.0.0":
        found.append(f"config router.host is {config.router.host}; pods must listen on 0.0.0.0")
    headless = [s for s in r.objects("Service") if s["spec"].get("clusterIP") == "None"]
    want = [
        f"{s['metadata']['name']}.{r.namespace}.svc:{p['port']}" for s in headless for p in s["spec"]["ports"]
    ]
    if list(config.controller.routers) != want or len(want) != 1:
        found.append(
            f"config controller.routers is {list(config.controller.routers)}, want the headless Service {want}"
        )
    if headless and not headless[0]["spec"].get("publishNotReadyAddresses"):
        found.append("headless router Service must publish not-ready pods (the controller makes them ready)")
    router = _router_container(r)
    ports = {p["name"]: p["containerPort"] for p in router.get("ports", [])}
    want_ports = {"grpc": config.router.port, "metrics": config.router.metrics_port}
    if config.router.http_port:  # the OpenAI-compatible HTTP API (0: off, no port)
        want_ports["http"] = config.router.http_port
    if ports != want_ports:
        found.append(
            f"router ports {ports} differ from the config's {want_ports} (router.port, metrics_port, http_port)"
        )
    for probe in ("startupProbe", "readinessProbe"):  # TLS routers: tls_checks.check_tls_probes
        if (
            config.tls.router is None
            and (router.get(probe) or {}).get("grpc", {}).get("port") != config.router.port
        ):
            found.append(f"router {probe} must be a gRPC health probe on port {config.router.port}")
    # Liveness checks only that the router listens: health is NOT_SERVING while no worker pair is ready.
    if (router.get("livenessProbe") or {}).get("tcpSocket", {}).get("port") != config.router.port:
        found.append(f"router livenessProbe must be a TCP probe on port {config.router.port}")
    return found


def _router_container(r: Rendering) -> dict[str, Any]:
    deployments = [d for d in r.objects("Deployment") if d["metadata"]["name"].endswith("-router")]
    if len(deployments) != 1:
        raise LookupError(f"{r.label}: expected one router Deployment, found {len(deployments)}")
    container: dict[str, Any] = deployments[0]["spec"]["template"]["spec"]["containers"][0]
    return container


def mounts_config(template: Manifest, container: dict[str, Any], config_map_name: str) -> bool:
    """Does this container see the config ConfigMap at CONFIG_DIR?"""
    volumes = {
        v["name"]: v["configMap"]["name"] for v in template["spec"].get("volumes") or [] if "configMap" in v
    }
    return any(
        m["mountPath"] == CONFIG_DIR and volumes.get(m["name"]) == config_map_name
        for m in container.get("volumeMounts") or []
    )


def check_controller(r: Rendering) -> list[str]:
    """The RayJob runs deploy.job against this release's RayCluster, on a head that has the config mounted."""
    job, cluster = r.one("RayJob")["spec"], r.one("RayCluster")
    found = []
    if job.get("clusterSelector") != {"ray.io/cluster": cluster["metadata"]["name"]}:
        found.append(
            f"RayJob clusterSelector {job.get('clusterSelector')} does not name RayCluster {cluster['metadata']['name']}"
        )
    if job.get("entrypoint") != f"python -m deploy.job --config {CONFIG_PATH}":
        found.append(f"RayJob entrypoint {job.get('entrypoint')!r} is not deploy.job with {CONFIG_PATH}")
    if job.get("shutdownAfterJobFinishes") is not False or job.get("backoffLimit", 0) != 0:
        found.append("RayJob on an existing cluster needs shutdownAfterJobFinishes false and no backoffLimit")
    head = cluster["spec"]["headGroupSpec"]["template"]
    name = config_map(r)["metadata"]["name"]
    if not mounts_config(head, head["spec"]["containers"][0], name):
        found.append(f"Ray head does not mount ConfigMap {name} at {CONFIG_DIR} (the controller runs there)")
    router = next(d for d in r.objects("Deployment") if d["metadata"]["name"].endswith("-router"))["spec"][
        "template"
    ]
    if not mounts_config(router, _router_container(r), name):
        found.append(f"router does not mount ConfigMap {name} at {CONFIG_DIR}")
    if CONFIG_PATH not in _router_container(r).get("command", []):
        found.append(f"router command does not read {CONFIG_PATH}")
    return found


def check_test_hook(r: Rendering) -> list[str]:
    """`helm test` has a Pod that checks the router Service's gRPC health."""
    tests = [h for h in r.hooks if h["metadata"]["annotations"].get("helm.sh/hook") == "test"]
    if len(tests) != 1 or tests[0]["kind"] != "Pod":
        return [f"expected one helm.sh/hook: test Pod, found {len(tests)}"]
    env = {e["name"]: e.get("value") for e in tests[0]["spec"]["containers"][0].get("env", [])}
    service = next(s for s in r.objects("Service") if s["metadata"]["name"].endswith("-router"))
    want = f"{service['metadata']['name']}:{next(p['port'] for p in service['spec']['ports'] if p['name'] == 'grpc')}"
    return (
        []
        if env.get("TANDEM_ROUTER") == want
        else [f"test Pod targets {env.get('TANDEM_ROUTER')}, want {want}"]
    )


def check_ray_ports(r: Rendering) -> list[str]:
    """KubeRay's well-known ports on the head, `metrics` on every Ray pod (the PodMonitor scrapes it)."""
    cluster = r.one("RayCluster")["spec"]
    names, _ = container_ports(cluster["headGroupSpec"]["template"])
    found = [
        f"Ray head has no {p} port"
        for p in ("gcs-server", "dashboard", "client", "metrics")
        if p not in names
    ]
    for group in cluster.get("workerGroupSpecs", []):
        if "metrics" not in container_ports(group["template"])[0]:
            found.append(f"worker group {group['groupName']} has no metrics port")
    return found


def worker_metrics_port_name(index: int) -> str:
    """The container port of a pod's index-th Tandem worker's /metrics (helm/tandem/templates/_helpers.tpl)."""
    return f"w{index}-metrics"


def check_worker_metrics(r: Rendering) -> list[str]:
    """Each pool's workers serve /metrics on fixed ports that their pods expose by name (one per worker of a pod,
    the same numbers as the config's metrics_port range) and, with the PodMonitor on, that a worker PodMonitor
    scrapes: selecting the pool's pods, never the head, with a `component` (not `role`) target label."""
    config, groups = rendered_config(r), worker_groups(r)
    found = []
    for role, pool in config.pools().items():
        group = groups.get(role)
        if group is None:
            continue  # check_config reports it
        per_pod = workers_per_pod(role, pool, group)
        want = {worker_metrics_port_name(i): pool.metrics_port + i for i in range(per_pod)}
        if pool.metrics_port == 0 or pool.metrics_port_count != per_pod:
            found.append(
                f"config {role}.metrics_port {pool.metrics_port} / metrics_port_count "
                f"{pool.metrics_port_count}: want a fixed port and one port per worker of a pod ({per_pod})"
            )
        exposed = {n: p for n, p in named_ports(group["template"]).items() if n.endswith("-metrics")}
        if exposed != want:
            found.append(f"{role}: worker metrics container ports {exposed}, want {want} (from the config)")
        if r.objects("PodMonitor"):
            found += _worker_monitor_problems(r, role, group, sorted(want))
    return found


def _worker_monitor_problems(r: Rendering, role: str, group: Manifest, ports: list[str]) -> list[str]:
    head = r.one("RayCluster")["spec"]["headGroupSpec"]["template"]
    scraping = [
        m
        for m in r.objects("PodMonitor")
        if {e["port"] for e in m["spec"]["podMetricsEndpoints"]} & set(ports)
        and selector_matches(m["spec"]["selector"], labels_of(group["template"]))
    ]
    if len(scraping) != 1:
        return [f"{role}: {len(scraping)} PodMonitors scrape its worker metrics ports, want 1"]
    monitor, found = scraping[0], []
    endpoints = monitor["spec"]["podMetricsEndpoints"]
    if sorted(e["port"] for e in endpoints) != ports:
        found.append(f"{object_name(monitor)}: endpoints {[e['port'] for e in endpoints]}, want {ports}")
    if selector_matches(monitor["spec"]["selector"], labels_of(head)):
        found.append(f"{object_name(monitor)}: selects the Ray head, which runs no Tandem worker")
    found += [
        f"{object_name(monitor)}: endpoint {e['port']} sets target label role (tandem_* series carry their own)"
        for e in endpoints
        if any(rl.get("targetLabel") == "role" for rl in e.get("relabelings") or [])
    ]
    return found


def check_tls(r: Rendering) -> list[str]:
    """The certificate files the config names are mounted where they are read; probes and Certificates fit."""
    config = rendered_config(r)
    return check_tls_mounts(r, config) + check_tls_probes(r, config) + check_certificates(r, config)


CONNECTION_CHECKS: tuple[Callable[[Rendering], list[str]], ...] = (
    check_config,
    check_tls,
    check_controller,
    check_test_hook,
    check_ray_ports,
    check_worker_metrics,
)
