"""Real registries for the metrics unit tests: a router's and a worker's, populated by real calls.

router = populated_router_metrics()                       # every router hook called once or more
with running_worker(tmp_path, "decode") as w:             # tiny engine on its loop, WorkerMetrics over it
    w.generate([5, 6, 7], max_tokens=3)                   # one request through the engine loop
    text = exposition(w.metrics.registry)
"""

from __future__ import annotations

import queue
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from deploy.metrics import MetricsHTTPServer
from kv_transfer import FailureReason
from kv_transfer.stats import StatsRecorder
from model_runtime.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from model_runtime.engine import Engine, StepOutput
from model_runtime.engine_loop import EngineLoop
from model_runtime.request import SamplingParams
from router.metrics import RequestRecord
from router.prometheus import PrometheusRouterMetrics
from tests.model.tiny_models import write_tiny_hf
from worker_host.metrics import WorkerMetrics
from worker_host.spec import WorkerSpec

MODEL = "tiny"
_model_lock = threading.Lock()


def exposition(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()


def scrape(address: str) -> str:
    """GET http://address/metrics, as Prometheus does."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        return str(reply.read().decode())


def served_router_text(metrics: PrometheusRouterMetrics) -> str:
    """What Prometheus reads from a router's /metrics (deploy.metrics' server, as `tandem serve` runs it)."""
    server = MetricsHTTPServer("127.0.0.1", 0, metrics.registry)
    try:
        return scrape(server.address)
    finally:
        server.close()


def samples(registry: CollectorRegistry) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """(sample name, labels) -> value, from the text a scrape would read."""
    out = {}
    for family in text_string_to_metric_families(exposition(registry)):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """The one sample `name` whose labels include `labels` (raises when none or several match)."""
    found = [v for (n, ls), v in samples(registry).items() if n == name and set(labels.items()) <= set(ls)]
    if len(found) != 1:
        raise AssertionError(f"{name}{labels}: expected one sample, found {len(found)}")
    return found[0]


def all_samples(registry: CollectorRegistry) -> list[Sample]:
    return [s for f in text_string_to_metric_families(exposition(registry)) for s in f.samples]


def populated_router_metrics() -> PrometheusRouterMetrics:
    metrics = PrometheusRouterMetrics(MODEL)
    metrics.request_done(RequestRecord("stop", 10, 5, e2e_seconds=3.0, queue_seconds=0.5, ttft_seconds=1.0))
    metrics.request_done(RequestRecord("deadline_exceeded", 7, 0, e2e_seconds=9.0, queue_seconds=0.2))
    metrics.request_rejected("invalid_argument")
    metrics.request_done(RequestRecord("length", 4, 2, e2e_seconds=1.0, key="team-a", priority="batch"))
    metrics.auth_failed("invalid", "http")
    metrics.key_rejected("team-a", "batch", "requests")
    metrics.worker_failed("decode-0", "unavailable")
    metrics.request_retried("no_room")
    return metrics


@dataclass
class RunningWorker:
    loop: EngineLoop
    metrics: WorkerMetrics
    transfers: StatsRecorder

    def generate(self, prompt: list[int], max_tokens: int) -> list[StepOutput]:
        """Run one greedy request to its end through the engine loop; returns its outputs."""
        rid = f"r{self.loop.engine.requests_total}"
        outputs: queue.Queue[StepOutput] = queue.Queue()
        self.loop.subscribe(rid, outputs.put)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        self.loop.call(lambda e: e.add_request(rid, prompt, params))
        got = [outputs.get(timeout=30)]
        while got[-1].finish_reason is None:
            got.append(outputs.get(timeout=30))
        self.loop.unsubscribe(rid)
        return got


def tiny_model(directory: Path) -> Path:
    with _model_lock:
        return write_tiny_hf(directory)


@contextmanager
def running_worker(tmp_path: Path, role: str, ahead: bool = False) -> Iterator[RunningWorker]:
    """`ahead`: the engine schedules each step ahead (scheduler.async_scheduling; colocated only)."""
    config = EngineConfig(
        model=str(tiny_model(tmp_path)),
        cache=CacheConfig(block_size=4, num_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, async_scheduling=ahead),
        device=DeviceConfig(device="cpu"),
    )
    loop = EngineLoop(Engine(config))
    loop.start()
    transfers = StatsRecorder()
    transfers.record_ok(4096, 0.003, phases={"stream": 0.002}, armed=True)
    transfers.record_failure(FailureReason.LEASE_EXPIRED)
    transfers.record_refused("tls_handshake")
    spec = WorkerSpec(worker_id=f"{role}-0", role=role, engine=config)
    # Like the workers: decode reads its receiver's stats, prefill its sender's, colocated has neither.
    stats = None if role == "colocated" else lambda: transfers.snapshot(active_leases=2, active_transfers=1)
    metrics = WorkerMetrics(spec, loop, stats)
    try:
        yield RunningWorker(loop, metrics, transfers)
    finally:
        metrics.stop()
        loop.stop()
