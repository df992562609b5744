"""`PrometheusRouterMetrics`: the router's counting hooks (router.metrics) backed by prometheus-client.

    metrics = PrometheusRouterMetrics(model="smollm2-135m-instruct")
    server = RouterServer(config, metrics=metrics)     # RouterServer calls track_admission() itself
    prometheus_client.start_http_server(9464, registry=metrics.registry)

Every metric is in one private registry (tests and several routers in one process do not collide). Labels are
bounded: model, protocol ("grpc" or "http": the front door), status (a gRPC status name or "ok"), finish_reason,
reason, worker, code, priority ("interactive", "batch"), key (an API key's name from the key file: as many as
the operator wrote, never the secret); never a request id.

Inter-token latency: the hooks see a request once, when it ends, so each request adds its decode time
(end - first token) spread evenly over its completion_tokens - 1 gaps. Count and sum are exact; quantiles are
those of per-request mean gaps, not of single gaps.
"""

from __future__ import annotations

import bisect
import itertools
import math
import threading
from collections.abc import Iterable
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from router.metrics import RequestRecord, RouterMetrics

# 1 ms .. 10 min: a TTFT can be milliseconds, a long generation minutes.
LAG_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)
FINISH_REASONS = ("stop", "length", "abort")
OK = "ok"
PROTOCOLS = ("grpc", "http")  # router.pipeline.Protocol
PRIORITIES = ("interactive", "batch")  # router.admission.Priority


class AdmissionState(Protocol):
    """What the running/waiting gauges read (router.admission.Admission)."""

    @property
    def queued(self) -> int: ...

    @property
    def in_flight(self) -> int: ...


def status_label(outcome: str) -> str:
    """RequestRecord.outcome -> the `status` label: "ok" for a stream that ended with its Final message,
    else the gRPC status name ("INVALID_ARGUMENT", "DEADLINE_EXCEEDED", ...)."""
    return OK if outcome in FINISH_REASONS else outcome.upper()


class PrometheusRouterMetrics(RouterMetrics):
    def __init__(self, model: str, registry: CollectorRegistry | None = None) -> None:
        super().__init__()
        self.model = model
        self.registry = registry if registry is not None else CollectorRegistry()
        self._admission: AdmissionState | None = None
        self._define_request_metrics()
        self._define_key_metrics()
        self._define_latency_metrics()
        self.registry.register(_AdmissionCollector(self))
        # Present (at 0) from the start, so rate() and the dashboard see the first request.
        for protocol in PROTOCOLS:
            self._requests.labels(model, protocol, OK)
            self._ttft.labels(model, protocol)
            self._e2e.labels(model, protocol)
        for metric in (self._prompt_tokens, self._generation_tokens, self._queue):
            metric.labels(model)
        for priority in PRIORITIES:
            self._priority_requests.labels(model, priority, OK)

    def _define_request_metrics(self) -> None:
        r = self.registry
        self._requests = Counter(
            "tandem_requests_total",
            'Requests by front door and final gRPC status ("ok": the stream ended with its Final message)',
            ["model", "protocol", "status"],
            registry=r,
        )
        self._success = Counter(
            "tandem_request_success_total",
            "Requests that ended with a Final message, by front door and finish reason",
            ["model", "protocol", "finish_reason"],
            registry=r,
        )
        self._prompt_tokens = Counter(
            "tandem_prompt_tokens_total",
            "Prompt tokens of requests that reached a worker",
            ["model"],
            registry=r,
        )
        self._generation_tokens = Counter(
            "tandem_generation_tokens_total", "Output tokens sent to clients", ["model"], registry=r
        )
        self._retries = Counter(
            "tandem_request_retries_total",
            'Requests moved to another worker ("no_room", "worker_failed", "resumed")',
            ["model", "reason"],
            registry=r,
        )
        self._placements = Counter(
            "tandem_placements_total",
            "Placed attempts by where the prompt runs: prefill_worker, local_short / local_cached / local_spill "
            "(prefilled on the decode worker: a short prompt / mostly in its prefix cache / the prefill workers' "
            "queues are long), colocated",
            ["model", "reason"],
            registry=r,
        )
        self._pairs = Counter(
            "tandem_kv_pairs_total",
            "Disaggregated attempts by the KV transport of their prefill/decode pair (unknown: a worker did not "
            "advertise its node and transports) and whether both workers share a node (same, cross, unknown)",
            ["model", "transport", "nodes"],
            registry=r,
        )
        self._worker_failures = Counter(
            "tandem_worker_failures_total",
            "Failed worker calls and status polls, as the router saw them",
            ["model", "worker", "code"],
            registry=r,
        )

    def _define_key_metrics(self) -> None:
        r = self.registry
        self._auth_failures = Counter(
            "tandem_auth_failures_total",
            "Requests refused UNAUTHENTICATED, by why: missing, invalid, revoked (key), not_admin",
            ["model", "protocol", "reason"],
            registry=r,
        )
        self._key_requests = Counter(
            "tandem_key_requests_total",
            "Accepted requests by API key (its name), class and final status",
            ["model", "key", "priority", "status"],
            registry=r,
        )
        self._key_rejections = Counter(
            "tandem_key_rejections_total",
            "Authenticated requests refused RESOURCE_EXHAUSTED: requests, tokens, concurrency (the key's quota), "
            "overload (router full), shed (a queued batch request gave its place to an interactive one)",
            ["model", "key", "priority", "reason"],
            registry=r,
        )
        self._priority_requests = Counter(
            "tandem_priority_requests_total",
            "Accepted requests by priority class and final status (interactive without API keys)",
            ["model", "priority", "status"],
            registry=r,
        )

    def _define_latency_metrics(self) -> None:
        def histogram(name: str, doc: str, labels: tuple[str, ...] = ("model",)) -> Histogram:
            return Histogram(name, doc, labels, buckets=LATENCY_BUCKETS, registry=self.registry)

        by_protocol = ("model", "protocol")
        self._ttft = histogram(
            "tandem_time_to_first_token_seconds", "Arrival to first output token", by_protocol
        )
        self._itl = RepeatedHistogram(
            "tandem_inter_token_latency_seconds",
            "Time between output tokens (each request's decode time spread evenly over its gaps)",
            self.model,
        )
        self.registry.register(self._itl)
        self._e2e = histogram(
            "tandem_e2e_request_latency_seconds", "Arrival to end of the request", by_protocol
        )
        self._queue = histogram(
            "tandem_request_queue_seconds", "Arrival to the first worker call (admission and KV reservation)"
        )
        self._loop_lag = Histogram(
            "tandem_router_event_loop_lag_seconds",
            "How late a probe on the router's event loop woke up: what every request's work and every relayed "
            "token waits for there (near 0 when the router keeps up; milliseconds and more when it is saturated)",
            ["model"],
            buckets=LAG_BUCKETS,
            registry=self.registry,
        ).labels(self.model)

    def track_admission(self, admission: AdmissionState) -> None:
        """Read tandem_requests_running/waiting from this admission bound at scrape time."""
        self._admission = admission

    def admission_counts(self) -> tuple[int, int]:
        """(running, waiting) now; (0, 0) before track_admission."""
        a = self._admission
        return (0, 0) if a is None else (a.in_flight, a.queued)

    # --- RouterMetrics hooks ---------------------------------------------------------------------------
    def request_done(self, record: RequestRecord) -> None:
        super().request_done(record)
        m, protocol, status = self.model, record.protocol, status_label(record.outcome)
        self._requests.labels(m, protocol, status).inc()
        self._priority_requests.labels(m, record.priority, status).inc()
        if record.key:
            self._key_requests.labels(m, record.key, record.priority, status).inc()
        if record.outcome in FINISH_REASONS:
            self._success.labels(m, protocol, record.outcome).inc()
        self._prompt_tokens.labels(m).inc(record.prompt_tokens)
        self._generation_tokens.labels(m).inc(record.completion_tokens)
        self._e2e.labels(m, protocol).observe(record.e2e_seconds)
        if record.queue_seconds is not None:
            self._queue.labels(m).observe(record.queue_seconds)
        if record.ttft_seconds is not None:
            self._ttft.labels(m, protocol).observe(record.ttft_seconds)
            self._observe_gaps(record)

    def _observe_gaps(self, record: RequestRecord) -> None:
        gaps = record.completion_tokens - 1
        if gaps < 1 or record.ttft_seconds is None:
            return
        self._itl.observe(max(0.0, record.e2e_seconds - record.ttft_seconds) / gaps, gaps)

    def request_rejected(self, code: str, protocol: str = "grpc") -> None:
        super().request_rejected(code, protocol)
        self._requests.labels(self.model, protocol, code.upper()).inc()

    def auth_failed(self, reason: str, protocol: str = "grpc") -> None:
        super().auth_failed(reason, protocol)
        self._auth_failures.labels(self.model, protocol, reason).inc()

    def key_rejected(self, key: str, priority: str, reason: str) -> None:
        super().key_rejected(key, priority, reason)
        self._key_rejections.labels(self.model, key, priority, reason).inc()

    def worker_failed(self, worker_id: str, code: str) -> None:
        super().worker_failed(worker_id, code)
        self._worker_failures.labels(self.model, worker_id, code.upper()).inc()

    def request_retried(self, reason: str) -> None:
        super().request_retried(reason)
        self._retries.labels(self.model, reason).inc()

    def loop_lagged(self, seconds: float) -> None:
        super().loop_lagged(seconds)
        self._loop_lag.observe(seconds)

    def placed(self, reason: str) -> None:
        super().placed(reason)
        self._placements.labels(self.model, reason).inc()

    def paired(self, transport: str, nodes: str) -> None:
        super().paired(transport, nodes)
        self._pairs.labels(self.model, transport or "unknown", nodes).inc()


class _AdmissionCollector(Collector):
    """The admission counters, read when Prometheus scrapes (plain ints written by the event loop)."""

    def __init__(self, metrics: PrometheusRouterMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[GaugeMetricFamily]:
        running, waiting = self._metrics.admission_counts()
        model = self._metrics.model
        for name, doc, value in (
            ("tandem_requests_running", "Requests placed on workers now", running),
            ("tandem_requests_waiting", "Accepted requests waiting for a slot", waiting),
        ):
            family = GaugeMetricFamily(name, doc, labels=["model"])
            family.add_metric([model], value)
            yield family


class RepeatedHistogram(Collector):
    """A histogram (labelled by model) that takes `count` equal observations in one O(1) call: a request's
    inter-token gaps all share its mean, and a long generation must not cost one observe() per token on the
    router's event loop."""

    def __init__(
        self, name: str, documentation: str, model: str, buckets: tuple[float, ...] = LATENCY_BUCKETS
    ) -> None:
        self._name, self._doc, self._model = name, documentation, model
        self._bounds = (*buckets, math.inf)
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float, count: int = 1) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self._bounds, value)] += count  # le: value <= bound
            self._sum += value * count

    def collect(self) -> Iterable[HistogramMetricFamily]:
        with self._lock:
            cumulative = list(itertools.accumulate(self._counts))
            total = self._sum
        family = HistogramMetricFamily(self._name, self._doc, labels=["model"])
        buckets = [(floatToGoString(b), float(c)) for b, c in zip(self._bounds, cumulative, strict=True)]
        family.add_metric([self._model], buckets, total)
        yield family
