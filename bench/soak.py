"""Soak a running Tandem service: mixed traffic with random cancels and short deadlines for --duration seconds,
then check that everything returned to baseline and that the counts reconcile.

    python -m bench.soak --server 127.0.0.1:50051 --duration 3600 [--concurrency 16] [--metrics URL]
        [--pid SERVE_PID] [--json out.json]

Each of `concurrency` closed-loop clients repeats: pick a prompt (1..max_prompt_words words) and max_tokens,
then either let it finish (deadline 120 s), cancel it after a random delay (cancel_fraction), or give it a short
deadline (deadline_fraction). At the end: every worker holds zero KV blocks and leases, the router holds no
request, and (with --metrics, the router's /metrics URL) the router recorded exactly one outcome per request
that reached it (accepted = ok + failed + cancelled), matching what the clients saw (see reconcile()). With
--pid the process's RSS is sampled every 5 s. Exit code 0 when all checks pass. tests/e2e/test_soak.py runs the
same loop in CI (60 s, and on until 56 requests were sent).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from tandem_client import AsyncClient, Client
from tandem_client.errors import TandemError

WORDS = [
    "river",
    "light",
    "seven",
    "quiet",
    "engine",
    "paper",
    "orbit",
    "maple",
    "signal",
    "harbor",
    "copper",
    "violet",
    "thunder",
    "garden",
]
OK, CANCELLED = "OK", "CANCELLED"


@dataclass(frozen=True)
class SoakConfig:
    address: str
    duration_s: float
    concurrency: int = 8
    cancel_fraction: float = 0.25
    deadline_fraction: float = 0.1
    max_prompt_words: int = 120
    max_tokens: int = 48
    seed: int = 0
    # Go on past duration_s until this many requests were sent, but never past max_duration_s: a soak that must
    # show N requests through a fault gets them on a slow or loaded host too, and still ends.
    min_requests: int = 0
    max_duration_s: float | None = None


@dataclass
class SoakReport:
    """Outcomes as the clients saw them: "OK", "CANCELLED" (cancelled by the client), or a gRPC status name."""

    sent: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    tokens: int = 0
    seconds: float = 0.0
    rss_mib: list[float] = field(default_factory=list)

    @property
    def failed(self) -> int:
        return self.sent - self.outcomes[OK] - self.outcomes[CANCELLED]


async def _one(client: AsyncClient, rng: random.Random, config: SoakConfig, report: SoakReport) -> None:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, config.max_prompt_words)))
    max_tokens = rng.randint(1, config.max_tokens)
    roll = rng.random()
    timeout = rng.uniform(0.2, 1.5) if roll >= 1 - config.deadline_fraction else 120.0
    task = asyncio.ensure_future(
        client.generate(prompt, max_tokens=max_tokens, temperature=0.8, ignore_eos=True, timeout=timeout)
    )
    report.sent += 1
    if roll < config.cancel_fraction:
        await asyncio.wait([task], timeout=rng.uniform(0.0, 1.5))
        task.cancel()
    try:
        result = await task
    except asyncio.CancelledError:
        report.outcomes[CANCELLED] += 1
    except TandemError as exc:
        report.outcomes[exc.code.name] += 1
        if exc.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED):
            await asyncio.sleep(0.1)  # back off as a real client would (no worker now, or the router is full)
    else:
        report.outcomes[OK] += 1
        report.tokens += len(result.token_ids)


class _Clock:
    """When the loops stop: at duration_s, or later while fewer than min_requests were sent (up to
    max_duration_s)."""

    def __init__(self, config: SoakConfig, report: SoakReport) -> None:
        self.start = time.monotonic()
        self.stop_at = self.start + config.duration_s
        self.hard_stop = self.start + max(config.duration_s, config.max_duration_s or config.duration_s)
        self.min_requests = config.min_requests
        self.report = report

    def running(self) -> bool:
        now = time.monotonic()
        return now < self.stop_at or (self.report.sent < self.min_requests and now < self.hard_stop)


async def _client_loop(config: SoakConfig, index: int, clock: _Clock, report: SoakReport) -> None:
    rng = random.Random(config.seed * 1000 + index)
    async with AsyncClient(config.address, retries=0) as client:
        while clock.running():
            await _one(client, rng, config, report)


async def _sample_rss(pid: int, clock: _Clock, report: SoakReport) -> None:
    import psutil

    process = psutil.Process(pid)
    while clock.running():
        report.rss_mib.append(round(process.memory_info().rss / 2**20, 1))
        await asyncio.sleep(5.0)


async def run_soak(config: SoakConfig, pid: int | None = None) -> SoakReport:
    """The traffic loop; returns when the clock has run out (see _Clock) and every request in flight has ended."""
    report = SoakReport()
    clock = _Clock(config, report)
    loops = [_client_loop(config, i, clock, report) for i in range(config.concurrency)]
    if pid is not None:
        loops.append(_sample_rss(pid, clock, report))
    await asyncio.gather(*loops)
    report.seconds = time.monotonic() - clock.start
    return report


def busy_resources(address: str) -> list[str]:
    """What still holds KV blocks, leases or requests ([] when the service is back to idle)."""
    with Client(address) as client:
        status = client.status(timeout=10)
    busy = [
        f"{w.worker_id}: {w.kv_blocks_used} blocks, {w.active_leases} leases, {w.running_requests} running"
        for w in status.workers
        if w.kv_blocks_used or w.active_leases or w.running_requests
    ]
    if status.router.in_flight_requests or status.router.queued_requests:
        busy.append(
            f"router: {status.router.in_flight_requests} in flight, {status.router.queued_requests} queued"
        )
    if not status.workers:
        busy.append("no workers in the membership")
    return busy


def wait_until_idle(address: str, timeout_s: float) -> list[str]:
    """Poll until idle; returns what was still busy at the end ([] on success)."""
    deadline = time.monotonic() + timeout_s
    while True:
        busy = busy_resources(address)
        if not busy or time.monotonic() > deadline:
            return busy
        time.sleep(0.25)


def router_outcomes(metrics_url: str) -> Counter[str]:
    """tandem_requests_total by status from the router's /metrics ("ok", "CANCELLED", ...)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    counts: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        if family.name == "tandem_requests":
            for sample in family.samples:
                if sample.name == "tandem_requests_total":
                    counts[sample.labels["status"]] += int(sample.value)
    return counts


def reconcile(report: SoakReport, before: Counter[str], after: Counter[str]) -> list[str]:
    """Problems with the counts ([] when they reconcile). The router records exactly one outcome per request
    that reached it; only a request the client cancelled at once can miss it (cancelled before it was sent).
    A request the client saw finish (OK) the router counts finished; one the client cancelled or let time out
    may have finished on the router just before, so the router's "ok" lies between the two."""
    delta = after - before
    problems = []
    unseen = report.sent - sum(delta.values())
    if not 0 <= unseen <= report.outcomes[CANCELLED]:
        problems.append(
            f"router recorded {sum(delta.values())} outcomes for {report.sent} requests: {dict(delta)}"
        )
    ok_client = report.outcomes[OK]
    ended_early = report.outcomes[CANCELLED] + report.outcomes["DEADLINE_EXCEEDED"]
    if not ok_client <= delta["ok"] <= ok_client + ended_early:
        problems.append(
            f"router ok {delta['ok']} vs client ok {ok_client} (+{ended_early} cancelled/expired)"
        )
    for bad in ("INTERNAL", "UNKNOWN"):
        if delta[bad] or report.outcomes[bad]:
            problems.append(f"{bad}: router {delta[bad]}, clients {report.outcomes[bad]}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", default="127.0.0.1:50051")
    parser.add_argument("--duration", type=float, required=True, help="seconds of traffic")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--cancel-fraction", type=float, default=0.25)
    parser.add_argument("--deadline-fraction", type=float, default=0.1)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--min-requests", type=int, default=0, help="go on past --duration until this many were sent"
    )
    parser.add_argument("--max-duration", type=float, help="... but not past this many seconds")
    parser.add_argument("--metrics", help="router /metrics URL, e.g. http://127.0.0.1:9464/metrics")
    parser.add_argument("--pid", type=int, help="sample this process's RSS (the tandem serve process)")
    parser.add_argument("--json", type=Path, help="write the report here")
    args = parser.parse_args(argv)
    config = SoakConfig(
        args.server,
        args.duration,
        args.concurrency,
        args.cancel_fraction,
        args.deadline_fraction,
        max_tokens=args.max_tokens,
        seed=args.seed,
        min_requests=args.min_requests,
        max_duration_s=args.max_duration,
    )
    before = router_outcomes(args.metrics) if args.metrics else Counter()
    report = asyncio.run(run_soak(config, args.pid))
    problems = [f"still busy: {b}" for b in wait_until_idle(args.server, 60.0)]
    if args.metrics:
        problems += reconcile(report, before, router_outcomes(args.metrics))
    summary = {**asdict(config), **asdict(report), "failed": report.failed, "problems": problems}
    text = json.dumps(summary, indent=2, default=dict)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 1 if problems else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (TandemError, grpc.RpcError, OSError) as exc:
        print(f"soak: {exc}", file=sys.stderr)
        sys.exit(2)
