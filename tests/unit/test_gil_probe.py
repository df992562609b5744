"""worker_host.gil_probe: a thread that cannot get the interpreter lock shows up as late wake-ups."""

from __future__ import annotations

import random
import time

import pytest
from prometheus_client import CollectorRegistry

from worker_host.gil_probe import GilProbe

pytestmark = pytest.mark.unit
LABELS = ["m", "decode", "w0"]


def _histogram(registry: CollectorRegistry) -> tuple[float, float, dict[float, float]]:
    """(count, sum, cumulative count by upper bound) of tandem_worker_gil_wait_seconds."""
    samples = [s for f in registry.collect() for s in f.samples if s.labels.get("worker") == "w0"]
    count = next(s.value for s in samples if s.name.endswith("_count"))
    total = next(s.value for s in samples if s.name.endswith("_sum"))
    buckets = {float(s.labels["le"]): s.value for s in samples if s.name.endswith("_bucket")}
    return count, total, buckets


def test_a_thread_holding_the_lock_makes_the_probe_wake_late() -> None:
    registry = CollectorRegistry()
    probe = GilProbe(registry, LABELS, period_s=0.001)
    probe.start()
    try:
        time.sleep(0.05)  # the probe is sleeping, not waiting for the lock, when the hold starts
        values = [random.random() for _ in range(2_000_000)]
        start = time.perf_counter()
        values.sort()  # one C call: the interpreter lock is not released until it returns
        held = time.perf_counter() - start
        time.sleep(0.05)
    finally:
        probe.stop()
    count, total, buckets = _histogram(registry)
    assert held > 0.05, f"the sort held the lock only {held * 1e3:.1f} ms: too short to tell"
    assert count >= 10, "the probe kept sampling"
    late_bound = max(b for b in buckets if b <= held / 2)
    assert buckets[late_bound] < count, f"no wake-up later than {late_bound}s while the lock was held"
    assert total >= held / 2


def test_stop_ends_the_thread() -> None:
    probe = GilProbe(CollectorRegistry(), LABELS, period_s=0.001)
    probe.start()
    assert probe.running
    probe.stop()
    assert not probe.running
