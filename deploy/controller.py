"""The controller: starts the worker pools on Ray, watches them, replaces dead or hung workers, and tells the
router who is alive. It is the only owner of worker membership.

    slot = (role, index); each slot holds at most one live actor. Every health_interval_s:
        its Ray node is gone             -> replace it, with every other worker of that node, in the same
                                            membership change as the round's failed heartbeats (deploy.nodes)
        actor dead (Ray says so)         -> replace it (new actor, new address)
        engine loop silent too long      -> kill and replace it (a hung step)
        heartbeat unanswered MISSED_LIMIT checks in a row -> kill and replace it (a hung or stopped process;
                                            one slow answer on a loaded host is not enough)
    Heartbeats go to every worker at once. A replacement starts in the background and joins the membership once
    it serves; one that Ray cannot place (no node has its resources) waits, and `pool_sizes` says why.
    Membership changes are pushed to the router as a whole set with an increasing generation.

Pool sizes change at run time (`scale`, behind Admin.Scale and `tandem scale`); every round the watcher brings
each pool to its target:
    too few   -> new slots (the next indexes); each joins the membership once its worker serves
    too many  -> slots that are still starting are stopped first; then the highest-indexed serving ones are
                 marked draining in the membership (routers place nothing new on them), drained on their own
                 thread (the worker refuses new calls and waits for its open ones, KV handoffs included, up to
                 drain_timeout_s), taken out of the membership, stopped and killed
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from deploy import local_ray
from deploy.actors import WorkerProcess
from deploy.config import DeployConfig
from deploy.nodes import read_nodes
from deploy.slot_checks import (
    actor_options,
    kill,
    metrics_address,
    note_node,
    note_waits,
    quiet_get,
    startup_stage,
    unhealthy,
)
from deploy.slots import Member, Slot, worker_spec
from model_runtime.roles import WorkerRole
from router.scaling import PoolSize

log = logging.getLogger(__name__)
RAY_START_ATTEMPTS = 3  # a local Ray node that failed to start (deploy/local_ray.py) gets two more tries
STAGE_POLL_S = 5.0  # while workers load: how often their start-up stage is asked for (shown on change)
MAX_POOL_SIZE = 1024  # a sanity bound on one pool's target

Publish = Callable[[list["Member"], int], object]


class Controller:
    def __init__(self, config: DeployConfig, publish: Publish) -> None:
        self.config = config
        self._publish = publish
        self._generation = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.slots: list[Slot] = []  # changed under _lock; other threads read copies
        self._actor_class: Any = None
        pools = config.pools()
        self._targets = {role: pool.replicas for role, pool in pools.items()}
        self._next_index = {role: pool.replicas for role, pool in pools.items()}
        self._wake = threading.Event()  # scale() wakes the watcher at once
        # The SLO autoscaler's last decision (set by `tandem serve` when it runs one), for `tandem status`.
        self.autoscaler_status: Callable[[], str] = lambda: ""
        self._drainers: list[threading.Thread] = []

    # --- lifecycle -------------------------------------------------------------------------------------
    def connect(self) -> None:
        """Start a local Ray or join config.ray.address. Call it from the main thread before installing signal
        handlers: Ray installs its own for SIGTERM, and ours must be the ones that stay."""
        # A local cluster stays on loopback; a joined one is whatever the cluster says.
        node_ip = "127.0.0.1" if self.config.ray.address is None else None
        if node_ip is not None:
            local_ray.prepare_environment()  # before `import ray`, which reads some of it once
        import ray

        if not ray.is_initialized():
            if node_ip is not None and os.environ.get("RAY_ADDRESS"):
                log.warning(
                    "RAY_ADDRESS=%s is ignored: without ray.address (--ray-address) Tandem starts a Ray of "
                    "its own",
                    os.environ["RAY_ADDRESS"],
                )
            # No address: "local", a private Ray. Ray's own default (None) would join whatever cluster RAY_ADDRESS
            # or the last `ray start` on this machine names, workers and all.
            address = self.config.ray.address or "local"
            for attempt in range(1, RAY_START_ATTEMPTS + 1):
                try:
                    ray.init(
                        _node_ip_address=node_ip,
                        address=address,
                        namespace=self.config.ray.namespace,
                        include_dashboard=False,
                        logging_level=logging.WARNING,
                        log_to_driver=False,
                    )
                    return
                except Exception as exc:  # a local node that times out starting on a loaded host: try again
                    if self.config.ray.address is not None:
                        raise
                    session = local_ray.newest_session()
                    why = local_ray.failed_start_logs(session) if session else ""
                    ray.shutdown()
                    # A failed start's GCS and raylet outlive it.
                    stopped = local_ray.stop_failed_start(session) if session else 0
                    if attempt == RAY_START_ATTEMPTS:
                        raise RuntimeError(
                            f"{exc} (after {attempt} tries{'; its logs: ' + why if why else ''})"
                        ) from exc
                    log.warning(
                        "Ray did not start, try %d of %d (%s%s); stopped its %d processes, trying again",
                        attempt,
                        RAY_START_ATTEMPTS,
                        exc,
                        f"; its logs: {why}" if why else "",
                        stopped,
                    )

    def start(self, progress: Callable[[str], None] = lambda _: None) -> None:
        """Start every pool and wait until each worker serves (or raise)."""
        import ray

        self.connect()
        self._actor_class = ray.remote(WorkerProcess)
        for role, pool in self.config.pools().items():
            for i in range(pool.replicas):
                spec = worker_spec(self.config, role, i)
                slot = Slot(role, i, spec, pool.num_gpus, dict(pool.ray_resources), dict(pool.ray_labels))
                self.slots.append(slot)
        self._await_started({slot.worker_id: self._launch(slot) for slot in self.slots}, progress)
        self._announce()
        self._thread = threading.Thread(target=self._watch, name="controller", daemon=True)
        self._thread.start()

    def _await_started(self, pending: dict[str, Any], progress: Callable[[str], None]) -> None:
        """Wait until every worker serves (a failed start raises here). While they load, which can take
        minutes for a large model, each worker's stage is shown whenever it changes."""
        import ray

        slots = {slot.worker_id: slot for slot in self.slots}
        shown: dict[str, str] = {}
        started = last_poll = time.monotonic()
        while pending:
            ready, _ = ray.wait(list(pending.values()), num_returns=1, timeout=1.0)
            for worker_id, ref in list(pending.items()):
                if ref in ready:
                    slot = slots[worker_id]
                    slot.address = ray.get(ref)
                    slot.metrics_address = metrics_address(slot)
                    note_node(slot)
                    progress(f"{worker_id} ready on {slot.address}")
                    del pending[worker_id]
            if not pending or time.monotonic() - last_poll < STAGE_POLL_S:
                continue
            last_poll = time.monotonic()
            note_waits([slots[worker_id] for worker_id in pending])
            for worker_id in pending:
                slot = slots[worker_id]
                stage = f"not placed: {slot.waiting}" if slot.waiting else startup_stage(slot)
                if stage and shown.get(worker_id) != stage:
                    shown[worker_id] = stage
                    progress(f"{worker_id} ({last_poll - started:.0f} s): {stage}")

    def _launch(self, slot: Slot) -> Any:
        """Create the slot's actor and ask it to start; returns the ObjectRef of its address."""
        options = actor_options(slot)
        slot.actor = self._actor_class.options(**options).remote(slot.spec)
        slot.placed, slot.node_id, slot.waiting = slot.actor.node_id.remote(), "", ""
        slot.launched_at = time.monotonic()
        return slot.actor.start.remote(slot.group, slot.num_gpus)

    def stop(self, drain: bool = True) -> None:
        """Drain the workers (if asked), stop them and leave no actor behind. Safe to call twice."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for drainer in self._drainers:  # slots being removed finish draining first (bounded by the drain)
            drainer.join(timeout=self.config.controller.drain_timeout_s + 20)
        # Only workers that started can drain or stop; an actor still waiting for a node would never answer.
        started = [s.actor for s in self.slots if s.actor is not None and s.address]
        if drain and started:
            quiet_get([a.drain.remote() for a in started], self.config.controller.drain_timeout_s + 5)
        if started:
            quiet_get([a.stop.remote() for a in started], 15)
        for slot in self.slots:
            kill(slot.actor, slot.group)
            slot.actor = slot.group = None

    # --- membership ------------------------------------------------------------------------------------
    def members(self) -> list[Member]:
        return [
            Member(s.worker_id, s.role, s.address, s.metrics_address, s.draining)
            for s in self.slots
            if s.actor is not None and s.address and s.starting is None
        ]

    def _announce(self) -> None:
        with self._lock:
            self._generation += 1
            members, generation = self.members(), self._generation
        self._publish(members, generation)

    # --- health ----------------------------------------------------------------------------------------
    def _watch(self) -> None:
        interval = self.config.controller.health_interval_s
        while not self._stop.is_set():
            self._wake.wait(interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            changed = self._resize()
            failed = unhealthy([s for s in self.slots if s.serving], self.config.controller)
            if self._stop.is_set():
                return
            lost = self._lost_to_nodes()  # read after the heartbeats: a node that just died is seen as such
            doomed = lost + [slot for slot in failed if slot not in lost]
            if doomed:
                changed |= self._replace(doomed)
            note_waits([s for s in self.slots if s.starting is not None])
            if changed:
                self._announce()

    # --- pool sizes ------------------------------------------------------------------------------------
    def scale(self, targets: Mapping[WorkerRole, int]) -> list[PoolSize]:
        """Set pools' targets (router.scaling.Scaler); the watcher adds or drains workers right away."""
        pools = self.config.pools()
        for role, replicas in targets.items():
            if role not in pools:
                names = ", ".join(r.value for r in pools)
                raise ValueError(f"{role.value}: this deployment runs {self.config.mode}, with pools {names}")
            if not 1 <= replicas <= MAX_POOL_SIZE:
                raise ValueError(f"{role.value}: replicas must be in [1, {MAX_POOL_SIZE}], got {replicas}")
        with self._lock:
            self._targets.update(targets)
        log.warning("scale: %s", ", ".join(f"{role.value} -> {n}" for role, n in targets.items()))
        self._wake.set()
        return self.pool_sizes()

    def pool_sizes(self) -> list[PoolSize]:
        with self._lock:
            slots, targets = list(self.slots), dict(self._targets)
        sizes = []
        for role, target in targets.items():
            mine = [s for s in slots if s.role is role and not s.given_up]
            ready = sum(s.serving for s in mine)
            draining = sum(s.draining for s in mine)
            waiting = "; ".join(f"{s.worker_id}: {s.waiting}" for s in mine if s.waiting and not s.serving)
            sizes.append(PoolSize(role, target, ready, len(mine) - ready - draining, draining, waiting))
        return sizes

    def _resize(self) -> bool:
        """One round towards the targets; True when the membership changed (workers that started serving)."""
        changed = self._collect_started()
        with self._lock:
            targets = dict(self._targets)
        for role, target in targets.items():
            with self._lock:
                live = [s for s in self.slots if s.role is role and not s.draining and not s.given_up]
            for _ in range(target - len(live)):
                self._add_slot(role)
            surplus = len(live) - target
            if surplus > 0:
                # Starting ones first (nothing runs there yet), then the newest serving ones.
                victims = sorted(live, key=lambda s: (s.serving, -s.index))[:surplus]
                self._remove(victims)
        return changed

    def _add_slot(self, role: WorkerRole) -> None:
        pool = self.config.pools()[role]
        index = self._next_index[role]
        self._next_index[role] += 1
        slot = Slot(
            role,
            index,
            worker_spec(self.config, role, index),
            pool.num_gpus,
            dict(pool.ray_resources),
            dict(pool.ray_labels),
        )
        slot.starting = self._launch(slot)
        with self._lock:
            self.slots.append(slot)
        log.warning("worker %s starting (scale up)", slot.worker_id)

    def _collect_started(self) -> bool:
        """Slots added at run time whose worker now serves join the membership; a failed start is dropped
        (the next round starts another)."""
        import ray

        changed = False
        for slot in [s for s in self.slots if s.starting is not None]:
            ready, _ = ray.wait([slot.starting], timeout=0)
            if not ready:
                continue
            ref, slot.starting = slot.starting, None
            try:
                slot.address = ray.get(ref)
            except Exception as exc:
                log.error("worker %s failed to start: %s", slot.worker_id, exc)
                if slot.restarts:  # a replacement: start another, within the slot's restart limit
                    kill(slot.actor, slot.group)
                    slot.actor = slot.group = None
                    self._relaunch(slot)
                else:
                    self._forget(slot)
                continue
            slot.metrics_address = metrics_address(slot)
            note_node(slot)
            verb = f"restarted ({slot.restarts})" if slot.restarts else "joined"
            log.warning("worker %s %s on %s", slot.worker_id, verb, slot.address)
            changed = True
        return changed

    def _remove(self, victims: list[Slot]) -> None:
        """Stop slots that do not serve yet at once; drain the serving ones: routers learn they are draining
        before the worker refuses new calls."""
        draining = []
        for slot in victims:
            if slot.serving:
                slot.draining = True
                draining.append(slot)
            else:
                self._forget(slot)
        if not draining:
            return
        self._announce()
        for slot in draining:
            log.warning("worker %s draining (scale down)", slot.worker_id)
            thread = threading.Thread(target=self._retire, args=(slot,), name=f"drain-{slot.worker_id}")
            self._drainers = [t for t in self._drainers if t.is_alive()] + [thread]
            thread.start()

    def _retire(self, slot: Slot) -> None:
        """On its own thread: drain the worker, take it out of the membership, stop and kill it."""
        import ray

        actor = slot.actor
        try:
            drained = ray.get(actor.drain.remote(), timeout=self.config.controller.drain_timeout_s + 5)
        except Exception as exc:
            drained = False
            log.warning("worker %s did not drain: %s", slot.worker_id, exc)
        if not drained:
            log.warning(
                "worker %s: requests still open after the drain; they resume elsewhere", slot.worker_id
            )
        self._forget(slot, stop=True)
        log.warning("worker %s removed", slot.worker_id)

    def _forget(self, slot: Slot, stop: bool = False) -> None:
        """Take the slot out (and out of the membership), then stop its worker and kill its actor."""
        actor, group = slot.actor, slot.group
        with self._lock:
            slot.actor = slot.group = None
            if slot in self.slots:
                self.slots.remove(slot)
        if stop:
            self._announce()
        if actor is not None and stop:
            quiet_get([actor.stop.remote()], 15)
        kill(actor, group)

    def _lost_to_nodes(self) -> list[Slot]:
        """The workers of every Ray node that is no longer alive (deploy.nodes), whether or not their heartbeats
        have failed yet: they are replaced together."""
        try:
            alive = read_nodes().alive
        except Exception as exc:  # the GCS is briefly unreachable: the heartbeats still catch dead workers
            log.warning("cannot read Ray's nodes: %s", exc)
            return []
        lost: dict[str, list[Slot]] = {}
        for slot in self.slots:
            if slot.actor is not None and slot.node_id and slot.node_id not in alive and not slot.draining:
                lost.setdefault(slot.node_id, []).append(slot)
        for node_id, slots in lost.items():
            names = ", ".join(slot.worker_id for slot in slots)
            log.warning("Ray node %s is gone: replacing its workers %s", node_id[:12], names)
        return [slot for slots in lost.values() for slot in slots]

    def _replace(self, slots: list[Slot]) -> bool:
        """Take the slots' workers out of the membership (one change: routers fail their open calls over at
        once), kill them and start new ones, which join once they serve (_collect_started)."""
        old = []
        for slot in slots:
            old.append((slot.actor, slot.group))
            slot.actor, slot.group, slot.address, slot.metrics_address, slot.missed = None, None, "", "", 0
            slot.starting, slot.placed, slot.node_id = None, None, ""
        self._announce()  # stop routing to them before anything slow
        for actor, group in old:
            kill(actor, group)
        for slot in slots:
            self._relaunch(slot)
        return True

    def _relaunch(self, slot: Slot) -> None:
        if slot.restarts >= self.config.controller.restart_limit:
            slot.given_up = True
            log.error("worker %s: restart limit (%d) reached; leaving it down", slot.worker_id, slot.restarts)
            return
        slot.restarts += 1
        slot.starting = self._launch(slot)
        log.warning("worker %s restarting (%d)", slot.worker_id, slot.restarts)

    # --- introspection (tests, tandem status) ----------------------------------------------------------
    def worker_pid(self, worker_id: str) -> int:
        import ray

        slot = next(s for s in self.slots if s.worker_id == worker_id)
        return int(ray.get(slot.actor.process_id.remote(), timeout=10))
