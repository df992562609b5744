"""What the controller asks of its workers' actors, one slot or many at once: heartbeats, the node an actor
was placed on (or why it is not placed yet), start-up stages, metrics addresses. Every call is bounded; a
worker that cannot answer is reported, never waited for."""

from __future__ import annotations

import logging
import time
from typing import Any

from deploy.config import ControllerSettings
from deploy.nodes import demand, placement_wait, read_nodes
from deploy.ranks import bundles
from deploy.slots import Slot

log = logging.getLogger("deploy.controller")
MISSED_LIMIT = (
    2  # consecutive unanswered heartbeats that make a live actor count as hung (one slow answer on a
)
# loaded host is not enough)
PLACEMENT_REPORT_S = 3.0  # an actor not placed after this long: say what it waits for


def actor_options(slot: Slot) -> dict[str, Any]:
    """Ray options of the slot's worker actor. A worker of several devices gets a new STRICT_PACK placement group
    (`slot.group`; its actor is rank 0, in bundle 0: deploy.ranks); the pool's labels select the node."""
    options: dict[str, Any] = {
        "num_gpus": slot.num_gpus,
        "name": f"tandem-{slot.worker_id}-{slot.restarts}",
        "max_restarts": 0,
        "max_concurrency": 4,
        "resources": slot.resources,
    }
    if slot.num_gpus == 0:
        options["num_cpus"] = 0  # CPU workers share the host; torch threads are set per worker
    size = slot.spec.engine.parallel.tensor_parallel_size
    if size > 1:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        slot.group = placement_group(
            bundles(size, slot.num_gpus, slot.resources),
            strategy="STRICT_PACK",
            name=options["name"],
            bundle_label_selector=[dict(slot.labels) for _ in range(size)] if slot.labels else None,
        )
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            slot.group, placement_group_bundle_index=0
        )
    elif slot.labels:
        options["label_selector"] = dict(slot.labels)
    return options


def unhealthy(slots: list[Slot], settings: ControllerSettings) -> list[Slot]:
    """Ask every worker in `slots` for its heartbeat at once; those that failed the check."""
    import ray

    if not slots:
        return []
    refs = [slot.actor.heartbeat_age.remote() for slot in slots]
    ray.wait(refs, num_returns=len(refs), timeout=max(2.0, settings.health_interval_s))
    return [slot for slot, ref in zip(slots, refs) if not _healthy(slot, ref, settings.heartbeat_timeout_s)]


def _healthy(slot: Slot, heartbeat: Any, heartbeat_timeout_s: float) -> bool:
    import ray

    try:
        age = ray.get(heartbeat, timeout=0)
    except ray.exceptions.GetTimeoutError:
        slot.missed += 1
        if slot.missed < MISSED_LIMIT:
            log.warning("worker %s did not answer a heartbeat (%d in a row)", slot.worker_id, slot.missed)
            return True
        log.warning(
            "worker %s failed its health check: %d heartbeats unanswered", slot.worker_id, slot.missed
        )
        return False
    except Exception as exc:  # the actor died (RayActorError and kin): no point waiting
        log.warning("worker %s failed its health check: %s", slot.worker_id, type(exc).__name__)
        return False
    slot.missed = 0
    if age > heartbeat_timeout_s:
        log.warning("worker %s: engine loop silent for %.1fs", slot.worker_id, age)
        return False
    return True


def kill(actor: Any, group: Any = None) -> None:
    """Kill a worker's actor (rank 0 of a worker of several devices: Ray ends the ranks it started with it),
    then remove its placement group, if any."""
    import ray

    if actor is not None:
        try:
            ray.kill(actor, no_restart=True)
        except Exception as exc:  # already gone with its node
            log.warning("while killing a worker actor: %s", exc)
    if group is not None:
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(group)
        except Exception as exc:
            log.warning("while removing a worker's placement group: %s", exc)


def note_node(slot: Slot) -> None:
    """Record the node a started worker runs on (the loss of that node replaces it)."""
    import ray

    try:
        if slot.placed is not None:
            slot.node_id = str(ray.get(slot.placed, timeout=10))
    except Exception as exc:
        log.warning("worker %s did not say its Ray node: %s", slot.worker_id, exc)
    slot.placed, slot.waiting = None, ""


def note_waits(slots: list[Slot]) -> None:
    """For starting slots whose actor Ray has not placed for a while: why (`Slot.waiting`, logged once per
    change). Placed ones learn their node."""
    import ray

    unplaced = []
    for slot in slots:
        if slot.placed is None:
            continue
        ready, _ = ray.wait([slot.placed], timeout=0)
        if ready:
            note_node(slot)
        elif time.monotonic() - slot.launched_at >= PLACEMENT_REPORT_S:
            unplaced.append(slot)
    if not unplaced:
        return
    try:
        view, available = read_nodes(), ray.available_resources()
    except Exception as exc:
        log.warning("cannot read Ray's nodes: %s", exc)
        return
    for slot in unplaced:
        size = slot.spec.engine.parallel.tensor_parallel_size
        reason = placement_wait(demand(slot.num_gpus, slot.resources, size), view, available, slot.labels)
        if reason != slot.waiting:
            slot.waiting = reason
            if reason:
                log.warning("worker %s is not placed: %s", slot.worker_id, reason)


def startup_stage(slot: Slot) -> str:
    """The loading worker's own account of where it is; "" when it cannot say now."""
    import ray

    try:
        return str(ray.get(slot.actor.startup_stage.remote(), timeout=2))
    except Exception:  # busy or not up yet: progress lines never hold up start-up
        return ""


def metrics_address(slot: Slot) -> str:
    """The started worker's /metrics host:port; "" when it cannot say (metrics never block serving)."""
    import ray

    try:
        return str(ray.get(slot.actor.metrics_address.remote(), timeout=10))
    except Exception as exc:
        log.warning("worker %s did not report its metrics address: %s", slot.worker_id, exc)
        return ""


def quiet_get(refs: list, timeout: float) -> None:
    """Wait for `refs` (drain or stop calls) up to `timeout`; a worker already gone only gets a warning."""
    import ray

    try:
        ray.get(refs, timeout=timeout)
    except Exception as exc:  # a worker already gone cannot drain; stopping continues regardless
        log.warning("while stopping workers: %s", exc)
