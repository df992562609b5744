"""`RouterMetrics`: the router's counting hooks in one place.

The router calls these methods and nothing else; this base class keeps plain in-process counters (tests read
them). The observability work subclasses it to back the same hooks with prometheus-client.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from router.recent_latency import RecentLatency

LAG_KEPT = 1000


@dataclass(frozen=True)
class RequestRecord:
    """How one accepted request ended. `outcome` is a finish reason ("stop", "length", "abort") for a stream
    that got its Final message, else the lower-case gRPC status name ("deadline_exceeded", ...)."""

    outcome: str
    prompt_tokens: int
    completion_tokens: int
    e2e_seconds: float
    queue_seconds: float | None = None
    ttft_seconds: float | None = None
    protocol: str = "grpc"  # the front door: "grpc" or "http" (router.pipeline.Protocol)
    key: str = ""  # the API key's name ("" when the router asks for no keys)
    priority: str = "interactive"  # the key's class (router.admission.Priority)


class RouterMetrics:
    def __init__(self) -> None:
        self.outcomes: Counter[str] = Counter()
        self.protocols: Counter[str] = Counter()  # accepted requests by front door ("grpc", "http")
        self.rejections: Counter[str] = Counter()
        self.worker_failures: Counter[str] = Counter()
        self.retries: Counter[str] = Counter()
        self.placements: Counter[str] = Counter()
        self.pairs: Counter[str] = Counter()  # "transport:nodes" of disaggregated attempts
        self.auth_failures: Counter[str] = Counter()  # by reason: missing, invalid, revoked, not_admin
        self.key_rejections: Counter[str] = Counter()  # "key:reason"
        self.priorities: Counter[str] = Counter()  # accepted requests by class
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.loop_lags: list[float] = []  # the last LAG_KEPT probe readings (router.loop_lag)
        # The last minutes' TTFT/TPOT per request, for the SLO autoscaler (deploy.autoscaler).
        self.recent = RecentLatency()

    def request_done(self, record: RequestRecord) -> None:
        """Once per request that passed validation and admission."""
        self.outcomes[record.outcome] += 1
        self.protocols[record.protocol] += 1
        self.priorities[record.priority] += 1
        self.prompt_tokens += record.prompt_tokens
        self.completion_tokens += record.completion_tokens
        self._record_recent(record)

    def _record_recent(self, record: RequestRecord) -> None:
        ttft = record.ttft_seconds
        if ttft is None:
            if record.outcome != "deadline_exceeded":
                return  # cancelled or failed before its first token: says nothing about the SLOs
            ttft = record.e2e_seconds  # never got a first token: its TTFT is at least its whole time
        gaps = record.completion_tokens - 1
        tpot = (record.e2e_seconds - ttft) / gaps if gaps >= 1 and record.ttft_seconds is not None else None
        self.recent.record(ttft, None if tpot is None else max(0.0, tpot))

    def request_rejected(self, code: str, protocol: str = "grpc") -> None:
        """A request refused before it reached a worker (bad input, unknown model, router full)."""
        self.rejections[code] += 1

    def auth_failed(self, reason: str, protocol: str = "grpc") -> None:
        """A request refused with UNAUTHENTICATED (also counted by request_rejected): its key was missing,
        invalid, revoked, or not an admin key where one is needed."""
        self.auth_failures[reason] += 1

    def key_rejected(self, key: str, priority: str, reason: str) -> None:
        """An authenticated request refused: "requests", "tokens", "concurrency" (the key's own quota),
        "overload" (the router was full), "shed" (a queued batch request gave its place to an interactive one)."""
        self.key_rejections[f"{key}:{reason}"] += 1

    def worker_failed(self, worker_id: str, code: str) -> None:
        """A worker call or poll failed (the worker, not the request, is at fault)."""
        self.worker_failures[f"{worker_id}:{code}"] += 1

    def request_retried(self, reason: str) -> None:
        """A request moved to another worker ("no_room", "worker_failed")."""
        self.retries[reason] += 1

    def paired(self, transport: str, nodes: str) -> None:
        """One disaggregated attempt started on a pair: its KV transport ("" unknown) and whether both workers
        share a node ("same", "cross", "unknown"; router.pairs)."""
        self.pairs[f"{transport or 'unknown'}:{nodes}"] += 1

    def loop_lagged(self, seconds: float) -> None:
        """How late the router's event-loop probe woke up (router.loop_lag): every request's work and every
        token's relay run on that one loop, so a late wake-up is what each of them waits for too."""
        self.loop_lags.append(seconds)
        del self.loop_lags[:-LAG_KEPT]

    def placed(self, reason: str) -> None:
        """One attempt placed; `reason` says where its prompt runs and why (router.placement: "prefill_worker",
        "local_short", "local_cached", "local_spill", "colocated")."""
        self.placements[reason] += 1
