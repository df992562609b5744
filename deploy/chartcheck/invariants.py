"""What must hold between the rendered objects, beyond each object's own schema: labels, selectors that select,
ports that exist, GPU limits and Ray resources that match the values, and a Tandem config that loads.

Every check returns readable findings (empty when it holds); deploy.chartcheck.check_all runs them all.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from deploy.chartcheck.objects import (
    LABEL_KEYS,
    container_ports,
    group_custom_resources,
    labels_of,
    pod_templates,
    selector_matches,
    worker_groups,
)
from deploy.chartcheck.render import Manifest, Rendering, object_name

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
GPU = "nvidia.com/gpu"


def check_labels(r: Rendering) -> list[str]:
    """Every object and pod template carries the recommended labels with the release's values."""
    expected = {"app.kubernetes.io/instance": r.release, "app.kubernetes.io/part-of": "tandem"}
    expected["app.kubernetes.io/managed-by"] = "Helm"
    found = []
    owners = [(object_name(d), labels_of(d)) for d in r.manifests + r.hooks]
    owners += [(f"{name} pod template", labels_of(t)) for name, t in pod_templates(r)]
    for name, labels in owners:
        missing = [key for key in LABEL_KEYS if not labels.get(key)]
        if missing:
            found.append(f"{name}: missing labels {', '.join(missing)}")
        found += [
            f"{name}: label {k}={labels[k]!r}, want {v!r}"
            for k, v in expected.items()
            if labels.get(k, v) != v
        ]
        found += [
            f"{name}: label {k} starts with 'raycluster' (KubeRay reserves it)"
            for k in labels
            if k.startswith("raycluster")
        ]
    for doc in r.manifests + r.hooks:
        name = (doc.get("metadata") or {}).get("name", "")
        if not DNS_LABEL.match(name) or len(name) > 63:
            found.append(f"{object_name(doc)}: name {name!r} is not a DNS label of at most 63 characters")
    return found


def check_workload_selectors(r: Rendering) -> list[str]:
    """A Deployment's selector must select its own pod template."""
    found = []
    for doc in r.objects("Deployment"):
        selector = doc["spec"]["selector"]
        if not selector_matches(selector, labels_of(doc["spec"]["template"])):
            found.append(f"{object_name(doc)}: selector {selector} does not match its pod template labels")
    return found


def check_services(r: Rendering) -> list[str]:
    """Each Service selects at least one pod template, and every selected pod serves every targetPort."""
    found = []
    for svc in r.objects("Service"):
        selected = [
            (n, t)
            for n, t in pod_templates(r)
            if selector_matches({"matchLabels": svc["spec"]["selector"]}, labels_of(t))
        ]
        if not selected:
            found.append(
                f"{object_name(svc)}: selector {svc['spec']['selector']} matches no pod in the release"
            )
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for pod_name, template in selected:
                names, numbers = container_ports(template)
                if target not in names and target not in numbers:
                    found.append(f"{object_name(svc)}: targetPort {target!r} is not a port of {pod_name}")
    return found


def check_monitors(r: Rendering) -> list[str]:
    """ServiceMonitor endpoints name a port of a selected Service; PodMonitor endpoints a port of every selected pod."""
    found = []
    for mon in r.objects("ServiceMonitor"):
        services = [
            s for s in r.objects("Service") if selector_matches(mon["spec"]["selector"], labels_of(s))
        ]
        for endpoint in mon["spec"]["endpoints"]:
            serving = [s for s in services if endpoint["port"] in {p.get("name") for p in s["spec"]["ports"]}]
            if len(serving) != 1:
                found.append(
                    f"{object_name(mon)}: port {endpoint['port']!r} is on {len(serving)} selected Services, want 1"
                )
    for mon in r.objects("PodMonitor"):
        pods = [
            (n, t) for n, t in pod_templates(r) if selector_matches(mon["spec"]["selector"], labels_of(t))
        ]
        if not pods:
            found.append(f"{object_name(mon)}: selector matches no pod in the release")
        for endpoint in mon["spec"]["podMetricsEndpoints"]:
            found += [
                f"{object_name(mon)}: {n} has no port {endpoint['port']!r}"
                for n, t in pods
                if endpoint["port"] not in container_ports(t)[0]
            ]
    for cm in r.objects("ConfigMap"):
        if labels_of(cm).get("grafana_dashboard") is not None:
            found += _dashboard_problems(cm)
    return found


def _dashboard_problems(cm: Manifest) -> list[str]:
    if labels_of(cm)["grafana_dashboard"] != "1":
        return [f'{object_name(cm)}: label grafana_dashboard must be "1" for the Grafana sidecar']
    try:
        dashboards = [json.loads(text) for text in cm["data"].values()]
    except json.JSONDecodeError as exc:
        return [f"{object_name(cm)}: dashboard JSON does not parse: {exc}"]
    return [f"{object_name(cm)}: a dashboard without panels" for d in dashboards if not d.get("panels")]


def check_ray_cluster(r: Rendering) -> list[str]:
    """String rayStartParams, a GPU-free head, and worker groups sized exactly as the values say (a fixed size,
    or with ray.autoscaling.enabled the pool's minReplicas..maxReplicas)."""
    cluster = r.one("RayCluster")
    spec = cluster["spec"]
    found = []
    params = [("head", spec["headGroupSpec"].get("rayStartParams", {}))]
    params += [(g["groupName"], g.get("rayStartParams", {})) for g in spec.get("workerGroupSpecs", [])]
    for where, group_params in params:
        found += [
            f"{where}: rayStartParams.{k} is {type(v).__name__}, must be a string"
            for k, v in group_params.items()
            if not isinstance(v, str)
        ]
    if spec["headGroupSpec"].get("rayStartParams", {}).get("num-cpus") != "0":
        found.append('head: rayStartParams.num-cpus must be "0" so that no worker is placed on the head')
    roles = ["colocated"] if r.values["mode"] == "colocated" else ["prefill", "decode"]
    if sorted(worker_groups(r)) != sorted(roles):
        found.append(
            f"RayCluster worker groups {sorted(worker_groups(r))}, want {sorted(roles)} for mode {r.values['mode']}"
        )
    autoscaling = bool((r.values["ray"].get("autoscaling") or {}).get("enabled"))
    if spec.get("enableInTreeAutoscaling", False) is not autoscaling:
        found.append(f"enableInTreeAutoscaling is {spec.get('enableInTreeAutoscaling')}, want {autoscaling}")
    for role, group in worker_groups(r).items():
        if role in roles:
            found += _group_problems(role, group, r.values[role], autoscaling)
    return found


def _group_problems(role: str, group: dict[str, Any], values: dict[str, Any], autoscaling: bool) -> list[str]:
    gpus, replicas = values["gpusPerWorker"], values["replicas"]
    want = {"replicas": replicas, "minReplicas": replicas, "maxReplicas": replicas}
    if autoscaling:
        want["minReplicas"] = values.get("minReplicas") or replicas
        want["maxReplicas"] = values.get("maxReplicas") or replicas
    found = [f"{role}: {k} is {group.get(k)}, want {v}" for k, v in want.items() if group.get(k) != v]
    if group.get("rayStartParams", {}).get("num-gpus") != str(gpus):
        found.append(
            f"{role}: rayStartParams.num-gpus is {group.get('rayStartParams', {}).get('num-gpus')!r}, want {str(gpus)!r}"
        )
    for container in group["template"]["spec"]["containers"]:
        limits = (container.get("resources") or {}).get("limits") or {}
        limit = limits.get(GPU, 0)
        if str(limit) != str(gpus):
            found.append(
                f"{role}: container {container['name']} {GPU} limit is {limit!r}, want {gpus} (gpusPerWorker)"
            )
    want = {f"tandem_{role}": max(gpus, 1)}  # one unit per device: each rank of a worker takes one
    if group_custom_resources(group) != want:
        found.append(f"{role}: advertises custom resources {group_custom_resources(group)}, want {want}")
    return found


CHECKS: tuple[Callable[[Rendering], list[str]], ...] = (
    check_labels,
    check_workload_selectors,
    check_services,
    check_monitors,
    check_ray_cluster,
)
