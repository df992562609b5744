"""The autoscaler's loop: every interval_s, the routers' latency window, the workers' load (deploy.autoscaler.load)
and the controller's pool sizes go into the policy (deploy.autoscaler.policy), and its new targets go to the
controller (`Scaler.scale`, the same call as Admin.Scale). The controller alone creates and drains workers; this
loop only asks.

Every decision that changes or wants to change a pool is logged at WARNING on the logger `tandem.autoscaler`,
one line naming the measured p90s, the targets and the change, and counted in
tandem_autoscaler_decisions_total{pool, direction (up | down | blocked), reason}.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter

from deploy.autoscaler.load import LoadTracker, WorkerSource
from deploy.autoscaler.policy import AutoscalePolicy, Decision, Direction, describe
from deploy.autoscaler.settings import AutoscalerSettings
from router.recent_latency import WindowStats
from router.scaling import Scaler

log = logging.getLogger("tandem.autoscaler")

LatencySource = Callable[[float], WindowStats]  # window_s -> the p90s of the requests that ended in it


class AutoscalerMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.decisions = Counter(
            "tandem_autoscaler_decisions_total",
            "Autoscaler decisions per pool: up / down (the target changed), blocked (a persistent miss that "
            "the pool's max or the worker budget kept from growing it), by reason",
            ["pool", "direction", "reason"],
            registry=self.registry,
        )

    def count(self, decision: Decision) -> None:
        for change in decision.changes:
            self.decisions.labels(change.role.value, change.direction.value, change.reason).inc()


class Autoscaler:
    def __init__(
        self,
        settings: AutoscalerSettings,
        scaler: Scaler,
        latency: LatencySource,
        workers: WorkerSource,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.load = LoadTracker(workers)
        self.policy = AutoscalePolicy(settings)
        self.metrics = AutoscalerMetrics(registry)
        self.last_decision = ""  # the last line logged ("" before the first decision)
        self._scaler = scaler
        self._latency = latency
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        s = self.settings
        log.warning(
            "autoscaler on: every %gs over %gs, targets p90 ttft %gs / tpot %gs",
            s.interval_s,
            s.window_s,
            s.ttft_s,
            s.tpot_s,
        )
        self._thread = threading.Thread(target=self._run, name="autoscaler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop evaluating (a change already asked for stays asked for). Safe to call twice."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.settings.interval_s):
            try:
                self.step()
            except Exception:  # a failed evaluation (a router unreachable, a refused target): try next time
                log.exception("autoscaler: evaluation failed")

    def step(self) -> Decision:
        """One evaluation: read, decide, log, count, apply."""
        pools = {p.role: p for p in self._scaler.pool_sizes()}
        window = self._latency(self.settings.window_s)
        now = self._clock()
        self.load.read(now)
        decision = self.policy.evaluate(window, pools, now, self.load.loads(self.settings.window_s))
        line = describe(window, self.settings, decision)
        if not decision.changes:
            log.debug("%s", line)
            return decision
        self.last_decision = f"{time.strftime('%H:%M:%S')} {line}"
        log.warning("%s", line)
        self.metrics.count(decision)
        targets = decision.targets()
        if targets:
            self._scaler.scale(targets)
        return decision


__all__ = ["Autoscaler", "AutoscalerMetrics", "Direction", "LatencySource", "WorkerSource"]
