"""GilProbe: how long a worker's threads wait to run Python, as a Prometheus histogram.

A worker's engine loop, its gRPC handlers and its KV transfer threads share one interpreter lock. When the loop
holds it, a KV receive or a health check waits, and nothing else shows that wait. The probe is a thread that
sleeps PERIOD_S again and again and records how late it wakes up: the time it waited for the lock, plus the
operating system's timer slack (tens of microseconds on an idle host).

    probe = GilProbe(registry, labels); probe.start(); ... probe.stop()

    tandem_worker_gil_wait_seconds{model, role, worker}   (histogram)

It costs one short wake-up every PERIOD_S: 50 a second, each taking the lock for a few microseconds. With the
first period, 5 ms, an idle CPU worker spent about 1.4% of a core on them and its engine loop gave up the lock
200 times a second. How late a wake-up comes does not depend on the period, so 20 ms measures the same with a
quarter of the samples: plenty for a histogram scraped every few seconds.
"""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Histogram

PERIOD_S = 0.02
BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)


class GilProbe:
    def __init__(self, registry: CollectorRegistry, labels: list[str], period_s: float = PERIOD_S) -> None:
        self._late = Histogram(
            "tandem_worker_gil_wait_seconds",
            f"How late a thread of the worker that slept {period_s * 1e3:g} ms woke up: the time it waited for "
            "Python's interpreter lock (which the engine loop, gRPC handlers and KV transfers share) plus the "
            "OS timer slack",
            ["model", "role", "worker"],
            buckets=BUCKETS,
            registry=registry,
        ).labels(*labels)
        self._period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gil-probe", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=1.0)

    def _run(self) -> None:
        while not self._stop.is_set():
            asleep = time.perf_counter()
            time.sleep(self._period_s)
            self._late.observe(max(0.0, time.perf_counter() - asleep - self._period_s))
