"""What the controller reads of Ray's nodes: which are alive, and why a worker that waits for a node waits.

Node loss: a worker's slot records the Ray node its actor runs on. Every health round the controller reads the
alive nodes (one GCS call, `ray.nodes()`); the slots of a node that is gone are replaced together, in one
membership change, before any of their heartbeats is asked for. Ray marks a node dead when its raylet stops
answering the GCS health checks (about 15 s with Ray's defaults: a check every 3 s, 5 misses; the head's
`health_check_period_ms` and `health_check_failure_threshold` system config set it).

A replacement (or a new worker) whose actor Ray has not placed yet waits for resources. `placement_wait` says
which: a resource no alive node has (the node that had it is gone; it starts once one joins), or one that
every node holding it has in use. Ray places the waiting actor on its own once a node can take it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class NodeView:
    """Alive nodes: id -> total resources, and id -> labels. Read with `read_nodes`; built by hand in unit
    tests."""

    totals: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    labels: Mapping[str, Mapping[str, str]] = field(default_factory=dict)

    @property
    def alive(self) -> frozenset[str]:
        return frozenset(self.totals)


def node_view(nodes: Iterable[Mapping[str, Any]]) -> NodeView:
    """`ray.nodes()` entries -> the alive nodes, what each has in total, and their labels."""
    alive = [n for n in nodes if n.get("Alive") and n.get("NodeID")]
    return NodeView(
        {str(n["NodeID"]): dict(n.get("Resources") or {}) for n in alive},
        {str(n["NodeID"]): dict(n.get("Labels") or {}) for n in alive},
    )


def read_nodes() -> NodeView:
    import ray

    return node_view(ray.nodes())


def demand(num_gpus: float, resources: Mapping[str, float], ranks: int = 1) -> dict[str, float]:
    """What Ray must find on one node to place a worker (deploy.controller launches CPU workers with num_cpus 0,
    GPU ones with Ray's default of one CPU to place an actor). `ranks`: a worker of several devices needs its
    devices, resources and (on GPUs) one CPU once per rank, all on one node (deploy.ranks.bundles)."""
    wanted = {name: float(amount) * ranks for name, amount in resources.items()}
    if num_gpus > 0:
        wanted["GPU"] = float(num_gpus) * ranks
        wanted.setdefault("CPU", 1.0 * ranks)
    return wanted


def placement_wait(
    wanted: Mapping[str, float],
    view: NodeView,
    available: Mapping[str, float],
    selector: Mapping[str, str] | None = None,
) -> str:
    """Why an actor asking for `wanted` on a node matching `selector` (Ray labels) is not placed: no alive node
    matches the labels, or none of those has the resources at all, else the resources the cluster has none of
    free now (`available`: `ray.available_resources()`). "" when none of these explains it (Ray may be placing
    it this moment, or the free amounts are split over nodes)."""
    selector = selector or {}
    matching = [node for node in view.totals if labels_match(view.labels.get(node, {}), selector)]
    if selector and not matching:
        return f"no alive node has labels {_describe_labels(selector)}; it starts once such a node joins"
    if not wanted:
        return ""
    if not any(_covers(view.totals[node], wanted) for node in matching):
        where = f" with labels {_describe_labels(selector)}" if selector else ""
        return f"no alive node{where} has {_describe(wanted)}; it starts once such a node joins"
    short = {name: amount for name, amount in wanted.items() if available.get(name, 0.0) < amount}
    if short:
        return f"every node with {_describe(short)} has it in use"
    return ""


def labels_match(labels: Mapping[str, str], selector: Mapping[str, str]) -> bool:
    """Ray's label selector on one node's labels: "v" equal, "!v" not equal (or absent), "in(a,b)" one of,
    "!in(a,b)" none of (or absent)."""
    for key, rule in selector.items():
        value = labels.get(key)
        negate = rule.startswith("!")
        body = rule[1:] if negate else rule
        if body.startswith("in(") and body.endswith(")"):
            hit = value in {part.strip() for part in body[3:-1].split(",")}
        else:
            hit = value == body
        if hit == negate:
            return False
    return True


def _describe_labels(selector: Mapping[str, str]) -> str:
    return "{" + ", ".join(f"{key}={rule}" for key, rule in sorted(selector.items())) + "}"


def _covers(total: Mapping[str, float], wanted: Mapping[str, float]) -> bool:
    return all(total.get(name, 0.0) >= amount for name, amount in wanted.items())


def _describe(resources: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{name}: {amount:g}" for name, amount in sorted(resources.items())) + "}"
