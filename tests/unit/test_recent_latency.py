"""router.recent_latency: the router's recent TTFT/TPOT window (what the SLO autoscaler reads), fed through the
RouterMetrics hook, and the windows of several routers merged over Admin.Status (deploy.autoscaler.routers)."""

from __future__ import annotations

import asyncio
import math
import random
import re

import grpc
import grpc.aio
import pytest

from deploy.autoscaler.routers import RouterLatency
from router.admission import Admission
from router.metrics import RequestRecord, RouterMetrics
from router.pool import WorkerPool
from router.recent_latency import BOUNDS, MAX_WINDOW_S, LatencyCounts, RecentLatency, bucket_quantile
from router.servicers import AdminService
from tandem_api.tandem.v1 import admin_pb2, admin_pb2_grpc
from tests.fake_clock import ManualClock
from tests.loopback import free_port

pytestmark = pytest.mark.unit


def exact_p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[math.ceil(0.9 * len(ordered)) - 1]


def test_the_bucketed_p90_is_within_five_percent_of_the_exact_one() -> None:
    rng = random.Random(7)
    for _ in range(50):
        values = [rng.lognormvariate(-1.0, 1.2) for _ in range(rng.randint(1, 400))]
        recent = RecentLatency()
        for v in values:
            recent.record(v, None)
        p90 = recent.stats(60).ttft_p90_s
        assert p90 is not None and abs(p90 / exact_p90(values) - 1) <= 0.05, (p90, exact_p90(values))
    assert bucket_quantile([0] * (len(BOUNDS) + 1)) is None
    assert BOUNDS[0] == 0.001 and BOUNDS[-1] >= MAX_WINDOW_S


def test_only_the_requests_that_ended_in_the_window_count() -> None:
    clock = ManualClock(1000.0)
    recent = RecentLatency(clock)
    for _ in range(10):
        recent.record(5.0, 0.5)  # an old burst of slow requests
    clock.now += 20
    for _ in range(10):
        recent.record(0.1, None)  # recent one-token requests: a TTFT, no TPOT
    stats = recent.stats(10)
    assert stats.requests == 10 and stats.tpot_requests == 0 and stats.tpot_p90_s is None
    assert stats.ttft_p90_s == pytest.approx(0.1, rel=0.05)
    wide = recent.stats(30)
    assert wide.requests == 20 and wide.tpot_requests == 10
    assert wide.ttft_p90_s == pytest.approx(5.0, rel=0.05)
    clock.now += MAX_WINDOW_S + 1
    recent.record(0.2, 0.01)  # recording drops what is older than the longest window
    assert recent.stats(MAX_WINDOW_S + 100).requests == 1


def test_the_metrics_hook_records_ttft_tpot_and_deadline_misses_but_not_cancels() -> None:
    metrics = RouterMetrics()
    # 11 tokens in 2.5 s after a 0.5 s TTFT: 10 gaps of 0.2 s.
    metrics.request_done(RequestRecord("length", 10, 11, e2e_seconds=2.5, ttft_seconds=0.5))
    metrics.request_done(RequestRecord("stop", 10, 1, e2e_seconds=0.3, ttft_seconds=0.3))  # no gap: no TPOT
    metrics.request_done(RequestRecord("deadline_exceeded", 10, 0, e2e_seconds=30.0))  # TTFT >= 30 s
    metrics.request_done(RequestRecord("cancelled", 10, 0, e2e_seconds=9.0))  # says nothing
    counts = metrics.recent.counts(60)
    assert sum(counts.ttft) == 3 and sum(counts.tpot) == 1
    stats = counts.stats()
    assert stats.tpot_p90_s == pytest.approx(0.2, rel=0.05)
    assert stats.ttft_p90_s == pytest.approx(30.0, rel=0.05)


async def _serve_admin(recent: RecentLatency) -> tuple[grpc.aio.Server, str]:
    metrics = RouterMetrics()
    pool = WorkerPool(
        poll_interval_s=1,
        poll_timeout_s=1,
        dead_after_failed_polls=1,
        max_message_bytes=1 << 20,
        metrics=metrics,
    )
    server = grpc.aio.server()
    admin_pb2_grpc.add_AdminServicer_to_server(AdminService(pool, Admission(1, 1), None, recent), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def test_the_windows_of_several_routers_add_up_over_admin_status() -> None:
    fast, slow = RecentLatency(), RecentLatency()
    for i in range(90):
        fast.record(0.1 + i / 1000, 0.02)
    for _ in range(30):
        slow.record(4.0, 0.3)

    async def scenario() -> tuple:
        servers = [await _serve_admin(r) for r in (fast, slow)]
        try:
            targets = [address for _, address in servers] + [f"127.0.0.1:{free_port()}"]  # one router is down
            merged = await asyncio.to_thread(RouterLatency(targets, timeout_s=1.0), 60.0)
            async with grpc.aio.insecure_channel(servers[0][1]) as channel:
                plain = await admin_pb2_grpc.AdminStub(channel).Status(admin_pb2.StatusRequest())
            return merged, plain
        finally:
            for server, _ in servers:
                await server.stop(0)

    merged, plain = asyncio.run(scenario())
    both = RecentLatency()
    for r in (fast, slow):
        counts = r.counts(60)
        assert counts == LatencyCounts.from_proto(counts.to_proto(), "here")
    for i in range(90):
        both.record(0.1 + i / 1000, 0.02)
    for _ in range(30):
        both.record(4.0, 0.3)
    # 120 requests, 30 of them slow: the p90 is a slow one, although one router alone never sees it so.
    assert merged == both.stats(60)
    assert merged.requests == 120 and merged.ttft_p90_s == pytest.approx(4.0, rel=0.05)
    assert not plain.router.HasField("recent_latency")  # not asked for: not sent


def test_counts_from_another_bucket_layout_are_refused_naming_the_router() -> None:
    message = admin_pb2.RecentLatency(window_seconds=10, ttft_counts=[1, 2, 3])
    expected = "router 10.0.0.7:50051: recent_latency.ttft_counts has 3 buckets"
    with pytest.raises(ValueError, match=re.escape(expected)):
        LatencyCounts.from_proto(message, "router 10.0.0.7:50051")
