"""Reading rendered objects: labels, pod templates, ports, Kubernetes label-selector semantics, Ray worker
groups. Shared by the invariant and connection checks."""

from __future__ import annotations

import json
from typing import Any

from deploy.chartcheck.render import Manifest, Rendering, object_name

# The Helm-recommended labels the chart puts on every object and pod.
LABEL_KEYS = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
    "app.kubernetes.io/component",
    "app.kubernetes.io/part-of",
    "app.kubernetes.io/managed-by",
    "helm.sh/chart",
)


def labels_of(obj: dict[str, Any]) -> dict[str, str]:
    """Labels of an object or of a pod template (both keep them in metadata.labels)."""
    return dict((obj.get("metadata") or {}).get("labels") or {})


def pod_templates(r: Rendering) -> list[tuple[str, Manifest]]:
    """(description, template) for every pod the release creates: workloads, Ray groups, the RayJob submitter
    and hook Pods. A template has `metadata` and `spec` like a Pod."""
    found: list[tuple[str, Manifest]] = []
    for doc in r.manifests:
        kind, spec = doc["kind"], doc.get("spec") or {}
        if kind in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            found.append((object_name(doc), spec["template"]))
        elif kind == "RayCluster":
            found.append((f"{object_name(doc)} head", spec["headGroupSpec"]["template"]))
            found += [
                (f"{object_name(doc)} group {g['groupName']}", g["template"])
                for g in spec.get("workerGroupSpecs", [])
            ]
        elif kind == "RayJob" and "submitterPodTemplate" in spec:
            found.append((f"{object_name(doc)} submitter", spec["submitterPodTemplate"]))
        elif kind == "Pod":
            found.append((object_name(doc), doc))
    found += [(object_name(doc), doc) for doc in r.hooks if doc["kind"] == "Pod"]
    return found


def container_ports(template: Manifest) -> tuple[set[str], set[int]]:
    """Names and numbers of every container port of a pod template."""
    names: set[str] = set()
    numbers: set[int] = set()
    for container in template["spec"].get("containers", []):
        for port in container.get("ports") or []:
            numbers.add(port["containerPort"])
            if "name" in port:
                names.add(port["name"])
    return names, numbers


def named_ports(template: Manifest) -> dict[str, int]:
    """Name -> number of every named container port of a pod template."""
    return {
        port["name"]: port["containerPort"]
        for container in template["spec"].get("containers", [])
        for port in container.get("ports") or []
        if "name" in port
    }


def selector_matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Kubernetes LabelSelector semantics: every matchLabels pair and every matchExpression must hold. An empty
    selector is treated as matching nothing here: the chart never means 'select everything'."""
    match_labels = selector.get("matchLabels") or {}
    expressions = selector.get("matchExpressions") or []
    if not match_labels and not expressions:
        return False
    if any(labels.get(k) != v for k, v in match_labels.items()):
        return False
    return all(_expression_holds(e, labels) for e in expressions)


def _expression_holds(expression: dict[str, Any], labels: dict[str, str]) -> bool:
    key, operator, values = expression["key"], expression["operator"], expression.get("values") or []
    if operator == "In":
        return labels.get(key) in values
    if operator == "NotIn":
        return labels.get(key) not in values
    if operator == "Exists":
        return key in labels
    if operator == "DoesNotExist":
        return key not in labels
    raise ValueError(f"matchExpressions: unknown operator {operator!r}")


def worker_groups(r: Rendering) -> dict[str, dict[str, Any]]:
    return {g["groupName"]: g for g in r.one("RayCluster")["spec"]["workerGroupSpecs"]}


def group_custom_resources(group: dict[str, Any]) -> dict[str, float]:
    """The custom resources a worker group advertises. KubeRay hands rayStartParams to a shell, so `resources`
    is JSON wrapped in double quotes with the inner quotes escaped: '"{\\"tandem_prefill\\": 1}"'."""
    raw = group.get("rayStartParams", {}).get("resources")
    if raw is None:
        return {}
    if not (isinstance(raw, str) and len(raw) >= 2 and raw[0] == raw[-1] == '"'):
        raise ValueError(
            f"group {group['groupName']}: rayStartParams.resources must be a quoted JSON string, got {raw!r}"
        )
    parsed: dict[str, float] = json.loads(raw[1:-1].replace('\\"', '"'))
    return parsed
