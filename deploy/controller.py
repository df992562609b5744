"""The controller: starts the worker pools on Ray, watches them, replaces dead or hung workers, and tells the
router who is alive. It is the only owner of worker membership.

    slot = (role, index); each slot holds at most one live actor. Every health_interval_s:
        actor dead (Ray says so)         -> replace it (new actor, new address)
        engine loop silent too long      -> kill and replace it (a hung step)
        heartbeat unanswered MISSED_LIMIT checks in a row -> kill and replace it (a hung or stopped process;
                                            one slow answer on a loaded host is not enough)
    Membership changes are pushed to the router as a whole set with an increasing generation.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from deploy.actors import WorkerProcess
from deploy.config import DeployConfig
from model_runtime.roles import WorkerRole
from worker_host.host import WorkerSpec

log = logging.getLogger(__name__)
RAY_START_ATTEMPTS = 2  # a local Ray node that timed out starting gets one more try
STAGE_POLL_S = 5.0  # while workers load: how often their start-up stage is asked for (shown on change)
MISSED_LIMIT = 2  # consecutive unanswered heartbeats that make a live actor count as hung

Publish = Callable[[list["Member"], int], object]


@dataclass(frozen=True)
class Member:
    worker_id: str
    role: WorkerRole
    address: str
    metrics_address: str = ""  # host:port of the worker's /metrics ("" when it serves none)


@dataclass
class Slot:
    role: WorkerRole
    index: int
    spec: WorkerSpec
    num_gpus: float
    resources: dict[str, float]
    actor: Any = None
    address: str = ""
    metrics_address: str = ""
    restarts: int = 0
    given_up: bool = False
    missed: int = 0  # consecutive heartbeat checks that timed out

    @property
    def worker_id(self) -> str:
        return self.spec.worker_id


def worker_spec(config: DeployConfig, role: WorkerRole, index: int) -> WorkerSpec:
    """The spec of worker `index` of the `role` pool: its pool's engine and metrics ports, the cluster's settings."""
    pool = config.pools()[role]
    host = "127.0.0.1" if config.ray.address is None else "0.0.0.0"  # a joined cluster: reachable from peers
    return WorkerSpec(
        host=host,
        worker_id=f"{role}-{index}",
        role=role,
        engine=pool.engine,
        transfer=config.transfer,
        drain_timeout_s=config.controller.drain_timeout_s,
        prefill_timeout_s=config.controller.prefill_timeout_s,
        kv_wait_timeout_s=config.controller.kv_wait_timeout_s,
        metrics_port=pool.metrics_port,
        metrics_port_count=pool.metrics_port_count,
    )


class Controller:
    def __init__(self, config: DeployConfig, publish: Publish) -> None:
        self.config = config
        self._publish = publish
        self._generation = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.slots: list[Slot] = []
        self._actor_class: Any = None

    # --- lifecycle -------------------------------------------------------------------------------------
    def connect(self) -> None:
        """Start a local Ray or join config.ray.address. Call it from the main thread before installing signal
        handlers: Ray installs its own for SIGTERM, and ours must be the ones that stay."""
        import ray

        if not ray.is_initialized():
            # A local cluster stays on loopback; a joined one is whatever the cluster says.
            node_ip = "127.0.0.1" if self.config.ray.address is None else None
            if node_ip is not None:
                # Ray 2.60 on Linux swaps a loopback node address for the host's routable one unless this is 0;
                # a local cluster must keep all of its traffic on 127.0.0.1.
                os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
            for attempt in range(1, RAY_START_ATTEMPTS + 1):
                try:
                    ray.init(
                        _node_ip_address=node_ip,
                        address=self.config.ray.address,
                        namespace=self.config.ray.namespace,
                        include_dashboard=False,
                        logging_level=logging.WARNING,
                        log_to_driver=False,
                    )
                    return
                except Exception as exc:  # a local node that times out starting on a loaded host: retry once
                    if self.config.ray.address is not None or attempt == RAY_START_ATTEMPTS:
                        raise
                    log.warning("Ray did not start (%s); trying again", exc)
                    ray.shutdown()

    def start(self, progress: Callable[[str], None] = lambda _: None) -> None:
        """Start every pool and wait until each worker serves (or raise)."""
        import ray

        self.connect()
        self._actor_class = ray.remote(WorkerProcess)
        for role, pool in self.config.pools().items():
            for i in range(pool.replicas):
                spec = worker_spec(self.config, role, i)
                self.slots.append(Slot(role, i, spec, pool.num_gpus, dict(pool.ray_resources)))
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
                    slot.metrics_address = self._metrics_address(slot)
                    progress(f"{worker_id} ready on {slot.address}")
                    del pending[worker_id]
            if not pending or time.monotonic() - last_poll < STAGE_POLL_S:
                continue
            last_poll = time.monotonic()
            for worker_id in pending:
                stage = self._startup_stage(slots[worker_id])
                if stage and shown.get(worker_id) != stage:
                    shown[worker_id] = stage
                    progress(f"{worker_id} ({last_poll - started:.0f} s): {stage}")

    @staticmethod
    def _startup_stage(slot: Slot) -> str:
        """The loading worker's own account of where it is; "" when it cannot say now."""
        import ray

        try:
            return str(ray.get(slot.actor.startup_stage.remote(), timeout=2))
        except Exception:  # busy or not up yet: progress lines never hold up start-up
            return ""

    def _launch(self, slot: Slot) -> Any:
        """Create the slot's actor and ask it to start; returns the ObjectRef of its address."""
        options: dict[str, Any] = {
            "num_gpus": slot.num_gpus,
            "name": f"tandem-{slot.worker_id}-{slot.restarts}",
            "max_restarts": 0,
            "max_concurrency": 4,
            "resources": slot.resources,
        }
        if slot.num_gpus == 0:
            options["num_cpus"] = 0  # CPU workers share the host; torch threads are set per worker
        slot.actor = self._actor_class.options(**options).remote(slot.spec)
        return slot.actor.start.remote()

    def stop(self, drain: bool = True) -> None:
        """Drain the workers (if asked), stop them and leave no actor behind. Safe to call twice."""
        import ray

        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        actors = [s.actor for s in self.slots if s.actor is not None]
        if drain and actors:
            self._quiet_get([a.drain.remote() for a in actors], self.config.controller.drain_timeout_s + 5)
        if actors:
            self._quiet_get([a.stop.remote() for a in actors], 15)
        for actor in actors:
            ray.kill(actor, no_restart=True)
        for slot in self.slots:
            slot.actor = None

    @staticmethod
    def _quiet_get(refs: list, timeout: float) -> None:
        import ray

        try:
            ray.get(refs, timeout=timeout)
        except Exception as exc:  # a worker already gone cannot drain; stopping continues regardless
            log.warning("while stopping workers: %s", exc)

    # --- membership ------------------------------------------------------------------------------------
    def members(self) -> list[Member]:
        return [
            Member(s.worker_id, s.role, s.address, s.metrics_address)
            for s in self.slots
            if s.actor is not None and s.address
        ]

    def _announce(self) -> None:
        with self._lock:
            self._generation += 1
            members, generation = self.members(), self._generation
        self._publish(members, generation)

    # --- health ----------------------------------------------------------------------------------------
    def _watch(self) -> None:
        interval = self.config.controller.health_interval_s
        while not self._stop.wait(interval):
            changed = False
            for slot in self.slots:
                if self._stop.is_set():
                    return
                if slot.actor is not None and not self._healthy(slot):
                    changed |= self._replace(slot)
            if changed:
                self._announce()

    def _healthy(self, slot: Slot) -> bool:
        import ray

        try:
            age = ray.get(
                slot.actor.heartbeat_age.remote(), timeout=max(2.0, self.config.controller.health_interval_s)
            )
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
        if age > self.config.controller.heartbeat_timeout_s:
            log.warning("worker %s: engine loop silent for %.1fs", slot.worker_id, age)
            return False
        return True

    def _replace(self, slot: Slot) -> bool:
        """Kill the slot's actor and start a new one. Its address leaves membership at once."""
        import ray

        old = slot.actor
        slot.actor, slot.address, slot.metrics_address, slot.missed = None, "", "", 0
        self._announce()  # stop routing to it before the (slow) restart
        ray.kill(old, no_restart=True)
        if slot.restarts >= self.config.controller.restart_limit:
            slot.given_up = True
            log.error("worker %s: restart limit (%d) reached; leaving it down", slot.worker_id, slot.restarts)
            return True
        slot.restarts += 1
        try:
            slot.address = ray.get(self._launch(slot), timeout=600)
            slot.metrics_address = self._metrics_address(slot)
            log.warning("worker %s restarted (%d) on %s", slot.worker_id, slot.restarts, slot.address)
        except Exception as exc:
            log.error("worker %s failed to restart: %s", slot.worker_id, exc)
            slot.actor = None
        return True

    def _metrics_address(self, slot: Slot) -> str:
        """The started worker's /metrics host:port; "" when it cannot say (metrics never block serving)."""
        import ray

        try:
            return str(ray.get(slot.actor.metrics_address.remote(), timeout=10))
        except Exception as exc:
            log.warning("worker %s did not report its metrics address: %s", slot.worker_id, exc)
            return ""

    # --- introspection (tests, tandem status) ----------------------------------------------------------
    def worker_pid(self, worker_id: str) -> int:
        import ray

        slot = next(s for s in self.slots if s.worker_id == worker_id)
        return int(ray.get(slot.actor.process_id.remote(), timeout=10))
