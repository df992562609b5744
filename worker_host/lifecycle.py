"""WorkerLifecycle: what both worker roles do the same way once started: drain and stop.

Stop order (safe twice, safe on a half-started worker): metrics endpoint -> gRPC server (cancels open streams,
whose handlers release their blocks and leases) -> the role's KV transfer object (in-flight transfers fail,
blocks return only once nothing can still write them) -> the engine loop.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
from typing import Any, Protocol

from model_runtime import kernel_builds
from model_runtime.engine_loop import EngineLoop
from model_runtime.heap import freeze_startup_objects, thaw
from worker_host.host import OpenCalls, wait_idle
from worker_host.metrics import WorkerMetrics
from worker_host.spec import WorkerSpec

log = logging.getLogger(__name__)

# A worker process runs its engine loop on one thread and its KV transfers and gRPC calls on others. Python
# makes a thread that wants the GIL wait up to the switch interval (5 ms by default) while the engine loop runs
# Python code; a KV receive takes the GIL a few times per handoff, which cost tens of ms per request in the
# service (tandem_kv_transfer_phase_seconds). 0.5 ms keeps those waits short; it changes nothing while the
# other threads sleep.
SWITCH_INTERVAL_S = 0.0005
# An operator's (or a benchmark's) override, in seconds: the trade-off is the engine thread's eager steps, which
# other threads interrupt once per interval when they want the GIL, against those threads' waits.
SWITCH_INTERVAL_ENV = "TANDEM_GIL_SWITCH_INTERVAL_S"


def switch_interval() -> float:
    text = os.environ.get(SWITCH_INTERVAL_ENV)
    if not text:
        return SWITCH_INTERVAL_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 1e-6 <= value <= 0.1):
        raise ValueError(f"{SWITCH_INTERVAL_ENV}: must be seconds in [1e-6, 0.1], got {text!r}")
    return value


class Drainable(Protocol):
    draining: threading.Event
    open_calls: OpenCalls


class Closable(Protocol):
    def close(self) -> None: ...


class WorkerLifecycle:
    def __init__(self, spec: WorkerSpec) -> None:
        interval = switch_interval()
        sys.setswitchinterval(interval)
        if interval != SWITCH_INTERVAL_S:
            log.warning("GIL switch interval %g ms (%s)", interval * 1e3, SWITCH_INTERVAL_ENV)
        self.spec = spec
        self.loop: EngineLoop | None = None
        self._server: Any = None
        self.address = ""
        self.metrics: WorkerMetrics | None = None
        self.metrics_address = ""  # host:port of this worker's Prometheus /metrics
        self.stage = "starting"  # where start() is: the controller shows it while the worker loads
        self._frozen = False  # started(): the start-up's objects are out of the collector's way until stop()
        if spec.engine.device.device.startswith(
            "cuda"
        ):  # a CPU engine builds none (and skips importing Triton)
            kernel_builds.watch()  # Triton kernels built after started() are logged and counted

    def _progress(self, stage: str) -> None:
        self.stage = stage
        log.info("worker %s: %s", self.spec.worker_id, stage)

    def _drainable(self) -> Drainable | None:
        raise NotImplementedError

    def _transfer(self) -> Closable | None:
        raise NotImplementedError

    def _forget_transfer(self) -> None:
        raise NotImplementedError

    def drain(self) -> bool:
        """Refuse new requests and wait for running ones, their KV handoffs included (True when all finished
        in time)."""
        service = self._drainable()
        if service is None or self.loop is None:
            return True
        service.draining.set()
        return wait_idle(self.loop, service.open_calls, self.spec.drain_timeout_s)

    def started(self) -> None:
        """The role's start() is done: freeze what it built (model_runtime.heap); a Triton kernel built from
        here on held up a step (model_runtime.kernel_builds)."""
        freeze_startup_objects()
        kernel_builds.mark_started()
        self._frozen = True

    def stop(self) -> None:
        if self._frozen:  # what start-up built may be garbage from here on
            thaw()
            self._frozen = False
        if self.metrics is not None:
            self.metrics.stop()
            self.metrics = None
        if self._server is not None:
            self._server.stop(grace=1.0).wait(5.0)
            self._server = None
        transfer = self._transfer()
        if transfer is not None:
            transfer.close()
            self._forget_transfer()
        if self.loop is not None:
            engine = self.loop.engine
            self.loop.stop()
            self.loop = None
            try:
                engine.close()  # a worker of several devices: its other ranks leave their step loop
            except Exception as exc:  # a rank already gone; the controller ends the rest with this actor
                log.warning("worker %s: the other ranks did not stop cleanly: %s", self.spec.worker_id, exc)
