"""A worker's Prometheus metrics: its own /metrics endpoint, one registry per worker.

    metrics = WorkerMetrics(spec, loop, transfer_stats=receiver.stats)   # or sender.stats, or None
    address = metrics.start()          # "127.0.0.1:40123" (the node's IP when spec.host is a wildcard)
                                       # spec.metrics_port 0: an ephemeral port; else the first free of
                                       # metrics_port .. metrics_port + metrics_port_count - 1
    ...
    metrics.stop()                     # safe twice

Engine gauges (KV blocks, requests) and the KV transfer counters are read when Prometheus scrapes: the engine
part under the loop's lock (loop.call), so one scrape sees one consistent engine state; transfer stats are
kv_transfer's own locked snapshot. Step duration, batch size and prefill tokens are recorded as steps run, from
the StepRecord the engine loop publishes to its step listeners (model_runtime knows nothing of Prometheus).
Every series carries model, role and worker labels.
"""

from __future__ import annotations

import errno
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kv_transfer import FailureReason, TransferStats
from model_runtime import kernel_builds
from model_runtime.engine import Engine
from model_runtime.engine_loop import EngineLoop
from model_runtime.step_record import StepRecord
from worker_host.gil_probe import GilProbe
from worker_host.spec import WorkerSpec

LABELS = ["model", "role", "worker"]
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass(frozen=True)
class EngineGauges:
    """One consistent reading of the engine, taken under the loop's lock."""

    used_blocks: int
    total_blocks: int
    running: int
    waiting: int
    requests_total: int
    cached_prompt_tokens: int
    steps_ahead: int
    launch_misses: int  # launches the late-launch clock timed that found the GPU idle all the same

    @staticmethod
    def read(engine: Engine) -> EngineGauges:
        return EngineGauges(
            used_blocks=engine.pool.num_used,
            total_blocks=engine.pool.usable,
            running=engine.scheduler.num_running,
            waiting=engine.scheduler.num_waiting,
            requests_total=engine.requests_total,
            cached_prompt_tokens=engine.scheduler.cached_tokens_total,
            steps_ahead=engine.steps_ahead,
            launch_misses=engine.launch_clock_stats()[1],
        )


class MetricsPortInUse(OSError):
    """Every port a worker may serve /metrics on is taken (another worker of the pool on the node, or another
    process)."""


def metrics_bind_host(spec: WorkerSpec) -> str:
    """Every interface when the worker's gRPC server takes every interface (multi-node), else loopback."""
    return "0.0.0.0" if spec.host in WILDCARD_HOSTS else "127.0.0.1"


class StepRecorder:
    """Each engine step that ran: its duration, its batch and the prompt tokens it computed (a step listener)."""

    def __init__(self, registry: CollectorRegistry, labels: list[str]) -> None:
        self._duration = Histogram(
            "tandem_step_duration_seconds",
            "Engine step wall time (schedule, model, sample) of steps that ran; with steps scheduled ahead, the "
            "host's cycle of scheduling and launching the next step, then waiting for this one's tokens and "
            "emitting them (about the GPU's step time once the GPU is the bound), a held launch's wait not included",
            LABELS,
            buckets=STEP_BUCKETS,
            registry=registry,
        ).labels(*labels)
        self._batch = Histogram(
            "tandem_batch_size",
            "Sequences in one engine step",
            LABELS,
            buckets=BATCH_BUCKETS,
            registry=registry,
        ).labels(*labels)
        self._prefill = Counter(
            "tandem_prefill_tokens_total", "Prompt tokens computed by this worker", LABELS, registry=registry
        ).labels(*labels)
        phases = Histogram(
            "tandem_first_token_phase_seconds",
            "A prompt's time to first token inside the worker, by phase: waiting (arrival to its first "
            "scheduled step) and prefill (first scheduled step to the end of the step that sampled its first "
            "token)",
            [*LABELS, "phase"],
            buckets=STEP_BUCKETS,
            registry=registry,
        )
        self._waiting = phases.labels(*labels, "waiting")
        self._prefill_phase = phases.labels(*labels, "prefill")

    def observe(self, step: StepRecord) -> None:
        self._duration.observe(step.duration_s)
        self._batch.observe(step.batch_size)
        self._prefill.inc(step.prefill_tokens)
        for first in step.first_tokens:
            self._waiting.observe(first.waiting_s)
            self._prefill_phase.observe(first.prefill_s)


class WorkerCollector(Collector):
    """Engine gauges, liveness and KV transfer stats, read at scrape time."""

    def __init__(
        self, loop: EngineLoop, labels: list[str], transfer_stats: Callable[[], TransferStats] | None
    ) -> None:
        self._loop = loop
        self._labels = labels
        self._transfer_stats = transfer_stats
        self._receiver = labels[1] != "prefill"  # decode: the receiver side (leases); prefill: the sender

    def collect(self) -> Iterable[Metric]:
        yield self._gauge("tandem_worker_up", "1 while the worker's engine loop runs", int(self._loop.alive))
        g = self._loop.call(EngineGauges.read)
        yield self._gauge("tandem_kv_cache_used_blocks", "KV blocks in use (ref count > 0)", g.used_blocks)
        yield self._gauge("tandem_kv_cache_total_blocks", "Usable KV blocks", g.total_blocks)
        usage = g.used_blocks / g.total_blocks if g.total_blocks else 0.0
        yield self._gauge("tandem_kv_cache_usage_ratio", "Used / usable KV blocks (0-1)", usage)
        yield self._gauge("tandem_engine_requests_running", "Requests the engine is running", g.running)
        yield self._gauge("tandem_engine_requests_waiting", "Requests queued in the engine", g.waiting)
        yield self._counter("tandem_engine_requests_total", "Requests the engine accepted", g.requests_total)
        yield self._counter(
            "tandem_prefix_cache_hit_tokens_total",
            "Prompt tokens taken from the prefix cache instead of computed",
            g.cached_prompt_tokens,
        )
        yield self._counter(
            "tandem_engine_steps_ahead_total",
            "Engine steps scheduled and launched while the step before them ran (scheduler.async_scheduling; "
            "stays 0 on a worker that waits for each step's tokens)",
            g.steps_ahead,
        )
        yield self._counter(
            "tandem_engine_launch_waits_total",
            "Steps the engine loop held back until shortly before the running step's end, so that requests "
            "arriving meanwhile joined them (scheduler.late_launch)",
            self._loop.launch_waits,
        )
        yield self._counter(
            "tandem_engine_launch_wait_seconds_total",
            "Time the engine loop spent holding steps back (scheduler.late_launch), running calls meanwhile",
            self._loop.launch_wait_seconds,
        )
        yield self._counter(
            "tandem_engine_launch_misses_total",
            "Steps held back (scheduler.late_launch) whose launch still found the GPU idle: the clock's estimate "
            "was too long, and the GPU waited for the host (each miss widens its margin a little)",
            g.launch_misses,
        )
        builds = kernel_builds.counts()
        compiled = CounterMetricFamily(
            "tandem_kernel_builds_total",
            "Triton kernel variants compiled or loaded in this worker's process, during start-up or after it "
            "(each one after start-up held up the engine step that launched it; the worker's log names it)",
            labels=[*LABELS, "when"],
        )
        compiled.add_metric([*self._labels, "startup"], builds.startup)
        compiled.add_metric([*self._labels, "after_start"], builds.after_start)
        yield compiled
        if self._transfer_stats is not None:
            yield from self._transfer(self._transfer_stats())

    def _transfer(self, stats: TransferStats) -> Iterable[Metric]:
        seconds = HistogramMetricFamily(
            "tandem_kv_transfer_seconds", "Duration of KV transfers that completed", labels=LABELS
        )
        buckets = [(floatToGoString(bound), float(count)) for bound, count in stats.seconds_buckets]
        seconds.add_metric(self._labels, buckets, stats.seconds_sum)
        yield seconds
        phases = HistogramMetricFamily(
            "tandem_kv_transfer_phase_seconds",
            "Where completed KV transfers spent their time, by phase (kv_transfer SendResult / TransferResult "
            "phases; decode workers add admit: landed -> in the batch)",
            labels=[*LABELS, "phase"],
        )
        for name, phase in sorted(stats.phases.items()):
            bounds = [(floatToGoString(bound), float(count)) for bound, count in phase.buckets]
            phases.add_metric([*self._labels, name], bounds, phase.seconds_sum)
        yield phases
        yield self._counter(
            "tandem_kv_transfer_bytes_total", "KV bytes moved by completed transfers", stats.bytes_ok
        )
        failures = CounterMetricFamily(
            "tandem_kv_transfer_failures_total", "Failed KV transfers by reason", labels=[*LABELS, "reason"]
        )
        for reason in FailureReason:  # every reason at 0 from the start, so rate() sees the first failure
            failures.add_metric([*self._labels, reason.name.lower()], stats.failures.get(reason, 0))
        yield failures
        if self._receiver:
            yield self._gauge(
                "tandem_kv_leases_active", "KV leases reserved, not yet landed", stats.active_leases
            )
            refused = CounterMetricFamily(
                "tandem_kv_refused_total",
                "KV control connections or transfers refused before any byte landed (a failed TLS handshake, "
                "a forged, spent or cancelled lease handle), by reason",
                labels=[*LABELS, "reason"],
            )
            for why, count in sorted(stats.refused.items()):
                refused.add_metric([*self._labels, why], count)
            yield refused
            yield self._counter(
                "tandem_kv_transfers_armed_total",
                "Completed KV transfers that landed through a cuda_ipc doorbell (copies queued at reservation, "
                "started by the sender's GPU)",
                stats.armed_ok,
            )
        else:
            yield self._gauge("tandem_kv_transfers_active", "KV sends in progress", stats.active_transfers)

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=LABELS)
        family.add_metric(self._labels, value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=LABELS)
        family.add_metric(self._labels, value)
        return family


class WorkerMetrics:
    def __init__(
        self,
        spec: WorkerSpec,
        loop: EngineLoop,
        transfer_stats: Callable[[], TransferStats] | None = None,
    ) -> None:
        self.spec = spec
        self.registry = CollectorRegistry()
        labels = [spec.engine.model, spec.role, spec.worker_id]
        self._steps = StepRecorder(self.registry, labels)
        self.registry.register(WorkerCollector(loop, labels, transfer_stats))
        loop.add_step_listener(self._steps.observe)
        self._gil = GilProbe(self.registry, labels)
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        self.address = ""

    def start(self) -> str:
        """Serve /metrics (spec.metrics_port, or an ephemeral port); returns the host:port Prometheus should
        scrape. Raises MetricsPortInUse when every allowed fixed port is taken."""
        if self._server is None:
            # This process exports Prometheus text: drop the `_created` samples of every counter and histogram
            # (Prometheus 2 stores each as one more gauge series, doubling the series count for nothing).
            disable_created_metrics()
            server, self._thread = serve_metrics(self.spec, self.registry)
            self._server = server
            self._gil.start()
            self.address = f"{self.spec.public_host}:{server.server_port}"
        return self.address

    def stop(self) -> None:
        self._gil.stop()
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


def metrics_ports(spec: WorkerSpec) -> range:
    """The ports this worker may bind, in the order it tries them."""
    if spec.metrics_port == 0:
        return range(0, 1)
    return range(spec.metrics_port, spec.metrics_port + spec.metrics_port_count)


def serve_metrics(spec: WorkerSpec, registry: CollectorRegistry) -> tuple[WSGIServer, threading.Thread]:
    """Bind the first free port of metrics_ports(spec). Safe against the pool's other workers starting at the
    same time: bind() itself decides who gets a port (the server sets SO_REUSEADDR, which on Linux still refuses
    a second listener). A replaced worker cannot race its predecessor for the port: Ray frees the slot's
    resources, and so places the new actor, only once the old process is gone."""
    host = metrics_bind_host(spec)
    for port in metrics_ports(spec):
        try:
            return start_http_server(port, host, registry)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or port == 0:
                raise OSError(
                    exc.errno,
                    f"worker {spec.worker_id}: cannot serve /metrics on {host}:{port}: {exc.strerror}",
                ) from exc
    raise MetricsPortInUse(errno.EADDRINUSE, _ports_taken_message(spec, host))


def _ports_taken_message(spec: WorkerSpec, host: str) -> str:
    ports = metrics_ports(spec)
    key = f"{spec.role}.metrics_port"
    if len(ports) == 1:
        taken = f"metrics port {ports[0]} on {host} is already in use"
        more = "run one worker of the pool per node"
    else:
        taken = f"metrics ports {ports[0]}-{ports[-1]} on {host} are all in use"
        more = f"raise {key}_count to the number of workers per node"
    return (
        f"worker {spec.worker_id}: {taken} (another worker of the pool on this node, or another process); "
        f"set {key}: 0 for an ephemeral port, or {more}"
    )
