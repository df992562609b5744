"""The values behind Tandem's metrics: router hooks, a real engine's gauges and step records, KV transfer stats,
the /metrics servers and the file_sd list `tandem serve` writes."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import urllib.error
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from deploy.config import DeployConfig, parse_config
from deploy.metrics import MetricsHTTPServer, ServeMetrics, TargetGroup, target_groups, write_file_sd
from deploy.router_settings import RouterSettings
from deploy.slots import Member
from kv_transfer import FailureReason
from model_runtime.config import ConfigError, EngineConfig
from router.admission import Admission
from router.config import RouterConfig
from router.metrics import RequestRecord
from router.prometheus import PrometheusRouterMetrics, status_label
from router.server import RouterServer
from tests.loopback import free_port
from tests.unit.metrics_support import MODEL, running_worker, samples, scrape, value
from worker_host.metrics import metrics_bind_host
from worker_host.spec import WorkerSpec

pytestmark = pytest.mark.unit


# --- router --------------------------------------------------------------------------------------------
def test_status_label_is_ok_for_a_finished_stream_and_the_grpc_name_otherwise() -> None:
    assert [status_label(o) for o in ("stop", "length", "abort")] == ["ok"] * 3
    assert status_label("invalid_argument") == "INVALID_ARGUMENT"
    assert status_label("deadline_exceeded") == "DEADLINE_EXCEEDED"


def test_a_finished_request_counts_once_with_its_tokens_and_latencies() -> None:
    m = PrometheusRouterMetrics(MODEL)
    m.request_done(RequestRecord("length", 10, 5, e2e_seconds=3.0, queue_seconds=0.5, ttft_seconds=1.0))
    r = m.registry
    assert value(r, "tandem_requests_total", protocol="grpc", status="ok") == 1
    assert value(r, "tandem_request_success_total", protocol="grpc", finish_reason="length") == 1
    assert value(r, "tandem_prompt_tokens_total") == 10
    assert value(r, "tandem_generation_tokens_total") == 5
    assert value(r, "tandem_time_to_first_token_seconds_sum", protocol="grpc") == 1.0
    assert value(r, "tandem_time_to_first_token_seconds_bucket", protocol="grpc", le="1.0") == 1
    assert value(r, "tandem_time_to_first_token_seconds_bucket", protocol="grpc", le="0.5") == 0
    assert value(r, "tandem_request_queue_seconds_sum") == 0.5
    assert value(r, "tandem_e2e_request_latency_seconds_count", protocol="grpc") == 1
    # 5 tokens -> 4 gaps sharing the 2 s between the first token and the end
    assert value(r, "tandem_inter_token_latency_seconds_count") == 4
    assert value(r, "tandem_inter_token_latency_seconds_sum") == pytest.approx(2.0)
    assert value(r, "tandem_inter_token_latency_seconds_bucket", le="0.25") == 0  # each gap: 0.5 s
    assert value(r, "tandem_inter_token_latency_seconds_bucket", le="0.5") == 4
    assert value(r, "tandem_inter_token_latency_seconds_bucket", le="+Inf") == 4
    assert m.outcomes["length"] == 1 and m.completion_tokens == 5  # the base class's counters still count


def test_requests_and_refusals_count_per_api_key_and_per_priority_class() -> None:
    m = PrometheusRouterMetrics(MODEL)
    m.request_done(RequestRecord("stop", 3, 2, e2e_seconds=1.0, key="web", priority="interactive"))
    m.request_done(
        RequestRecord("resource_exhausted", 3, 0, e2e_seconds=1.0, key="nightly", priority="batch")
    )
    m.request_done(RequestRecord("stop", 3, 2, e2e_seconds=1.0))  # no keys: interactive, no key series
    m.key_rejected("nightly", "batch", "shed")
    m.key_rejected("web", "interactive", "requests")
    m.auth_failed("revoked", "http")
    r = m.registry
    assert value(r, "tandem_key_requests_total", key="web", priority="interactive", status="ok") == 1
    assert (
        value(r, "tandem_key_requests_total", key="nightly", priority="batch", status="RESOURCE_EXHAUSTED")
        == 1
    )
    assert value(r, "tandem_priority_requests_total", priority="interactive", status="ok") == 2
    assert value(r, "tandem_priority_requests_total", priority="batch", status="RESOURCE_EXHAUSTED") == 1
    assert (
        value(r, "tandem_priority_requests_total", priority="batch", status="ok") == 0
    )  # present from the start
    assert value(r, "tandem_key_rejections_total", key="nightly", reason="shed") == 1
    assert value(r, "tandem_key_rejections_total", key="web", reason="requests") == 1
    assert value(r, "tandem_auth_failures_total", protocol="http", reason="revoked") == 1
    keys = {labels for (name, labels), _ in samples(r).items() if name == "tandem_key_requests_total"}
    assert {dict(ls)["key"] for ls in keys} == {"web", "nightly"}


def test_requests_count_under_the_protocol_they_came_in_by() -> None:
    m = PrometheusRouterMetrics(MODEL)
    m.request_done(RequestRecord("stop", 3, 2, e2e_seconds=1.0, ttft_seconds=0.5, protocol="http"))
    m.request_rejected("resource_exhausted", "http")
    m.request_done(RequestRecord("stop", 3, 2, e2e_seconds=1.0, ttft_seconds=0.5))
    r = m.registry
    assert value(r, "tandem_requests_total", protocol="http", status="ok") == 1
    assert value(r, "tandem_requests_total", protocol="http", status="RESOURCE_EXHAUSTED") == 1
    assert value(r, "tandem_requests_total", protocol="grpc", status="ok") == 1
    assert value(r, "tandem_request_success_total", protocol="http", finish_reason="stop") == 1
    assert value(r, "tandem_time_to_first_token_seconds_count", protocol="http") == 1
    assert value(r, "tandem_e2e_request_latency_seconds_count", protocol="grpc") == 1


def test_failed_and_rejected_requests_count_under_their_status() -> None:
    m = PrometheusRouterMetrics(MODEL)
    m.request_done(RequestRecord("deadline_exceeded", 7, 0, e2e_seconds=9.0, queue_seconds=None))
    m.request_rejected("invalid_argument")
    m.request_rejected("invalid_argument")
    m.worker_failed("decode-1", "unavailable")
    m.request_retried("no_room")
    r = m.registry
    assert value(r, "tandem_requests_total", protocol="grpc", status="DEADLINE_EXCEEDED") == 1
    assert value(r, "tandem_requests_total", protocol="grpc", status="INVALID_ARGUMENT") == 2
    assert value(r, "tandem_requests_total", protocol="grpc", status="ok") == 0  # present from the start
    assert value(r, "tandem_time_to_first_token_seconds_count", protocol="grpc") == 0  # no token, no TTFT
    assert value(r, "tandem_e2e_request_latency_seconds_count", protocol="grpc") == 1
    assert value(r, "tandem_worker_failures_total", worker="decode-1", code="UNAVAILABLE") == 1
    assert value(r, "tandem_request_retries_total", reason="no_room") == 1


def test_running_and_waiting_gauges_read_the_admission_bound() -> None:
    m = PrometheusRouterMetrics(MODEL)
    assert (value(m.registry, "tandem_requests_running"), value(m.registry, "tandem_requests_waiting")) == (
        0,
        0,
    )
    admission = Admission(max_inflight=1, max_queue=4)
    m.track_admission(admission)
    first, second = admission.enter(), admission.enter()
    asyncio.run(first.start())
    assert value(m.registry, "tandem_requests_running") == 1
    assert value(m.registry, "tandem_requests_waiting") == 1
    first.close()
    second.close()
    assert m.admission_counts() == (0, 0)


def test_router_server_hands_its_admission_to_prometheus_metrics() -> None:
    m = PrometheusRouterMetrics(MODEL)
    server = RouterServer(RouterConfig(port=0), metrics=m)
    ticket = server._admission.enter()  # the server's own bound (no public door to it besides Generate)
    assert m.admission_counts() == (0, 1)
    ticket.close()


# --- workers -------------------------------------------------------------------------------------------
def test_worker_steps_prefill_tokens_and_batches_are_recorded(tmp_path: Path) -> None:
    with running_worker(tmp_path, "colocated") as w:
        w.generate([5, 6, 7, 8, 9], max_tokens=3)  # one prefill step, then two decode steps
        r = w.metrics.registry
        assert value(r, "tandem_prefill_tokens_total") == 5
        assert value(r, "tandem_step_duration_seconds_count") == 3
        assert value(r, "tandem_batch_size_sum") == 3
        assert value(r, "tandem_engine_requests_total") == 1
        assert value(r, "tandem_kv_cache_used_blocks") == 0  # finished: every block is back
        names = {name for name, _ in samples(r)}
        assert not any(n.startswith("tandem_kv_transfer") for n in names)  # colocated: no transfer side


@pytest.mark.parametrize("ahead", [False, True], ids=["synchronous", "ahead"])
def test_a_worker_counts_the_steps_it_scheduled_ahead(tmp_path: Path, ahead: bool) -> None:
    with running_worker(tmp_path, "colocated", ahead=ahead) as w:
        outputs = w.generate([5, 6, 7, 8, 9], max_tokens=4)
        assert [len(o.token_ids) for o in outputs] == [1, 1, 1, 1]
        counted = value(w.metrics.registry, "tandem_engine_steps_ahead_total")
        assert counted == w.loop.call(lambda e: e.steps_ahead)
        # On a CPU a step runs at its launch: nothing to hold back (scheduler.late_launch), and it says so.
        assert value(w.metrics.registry, "tandem_engine_launch_waits_total") == w.loop.launch_waits == 0
        assert value(w.metrics.registry, "tandem_engine_launch_wait_seconds_total") == 0
        assert value(w.metrics.registry, "tandem_engine_launch_misses_total") == 0
        # Ahead, each of the 3 decode steps is launched while the step before it runs (nothing is launched
        # behind the last, whose pending token is the request's last). Synchronous: none.
        assert counted == (3 if ahead else 0)


def test_a_worker_exports_the_triton_kernels_built_in_its_process(tmp_path: Path) -> None:
    from triton import knobs

    from model_runtime import kernel_builds

    assert kernel_builds.watch()
    with running_worker(tmp_path, "colocated") as w:

        def exported() -> dict[str, float]:
            return {when: value(w.metrics.registry, "tandem_kernel_builds_total", when=when) for when in WHEN}

        before = exported()
        fn = SimpleNamespace(
            name="_some_kernel", module="m"
        )  # what Triton passes its hooks (JitFunctionInfo)
        call = {
            "key": (),
            "repr": "",
            "fn": fn,
            "compile": {},
            "is_manual_warmup": False,
            "already_compiled": False,
        }
        knobs.runtime.jit_cache_hook(**call)
        knobs.runtime.jit_post_compile_hook(**call)
        after, counted = exported(), kernel_builds.counts()
        assert after == {"startup": counted.startup, "after_start": counted.after_start}
        assert sum(after.values()) == sum(before.values()) + 1


WHEN = ("startup", "after_start")


def test_worker_kv_gauges_follow_the_block_pool(tmp_path: Path) -> None:
    with running_worker(tmp_path, "decode") as w:
        r = w.metrics.registry
        total = value(r, "tandem_kv_cache_total_blocks")
        assert total == 63  # 64 blocks, one reserved as the null block
        held = w.loop.call(lambda e: e.pool.allocate(9))
        assert value(r, "tandem_kv_cache_used_blocks") == 9
        assert value(r, "tandem_kv_cache_usage_ratio") == pytest.approx(9 / 63)
        w.loop.call(lambda e: e.pool.free(held))
        assert value(r, "tandem_kv_cache_used_blocks") == 0
        assert value(r, "tandem_worker_up") == 1
        w.loop.stop()
        assert value(r, "tandem_worker_up") == 0


def test_transfer_stats_become_a_histogram_counters_and_the_side_gauge(tmp_path: Path) -> None:
    with running_worker(tmp_path, "decode") as w:  # one 4096-byte transfer in 3 ms, one lease_expired
        r = w.metrics.registry
        assert value(r, "tandem_kv_transfer_seconds_bucket", le="0.0025") == 0
        assert value(r, "tandem_kv_transfer_seconds_bucket", le="0.005") == 1
        assert value(r, "tandem_kv_transfer_seconds_bucket", le="+Inf") == 1
        assert value(r, "tandem_kv_transfer_seconds_count") == 1
        assert value(r, "tandem_kv_transfer_seconds_sum") == pytest.approx(0.003)
        assert value(r, "tandem_kv_transfer_bytes_total") == 4096
        assert value(r, "tandem_kv_transfer_failures_total", reason="lease_expired") == 1
        reasons = {dict(ls)["reason"] for n, ls in samples(r) if n == "tandem_kv_transfer_failures_total"}
        assert reasons == {reason.name.lower() for reason in FailureReason}
        assert value(r, "tandem_kv_leases_active") == 2
        assert value(r, "tandem_kv_transfers_armed_total") == 1  # that one landed through a doorbell
        assert "tandem_kv_transfers_active" not in {n for n, _ in samples(r)}
    with running_worker(tmp_path, "prefill") as w:
        assert value(w.metrics.registry, "tandem_kv_transfers_active") == 1
        assert "tandem_kv_leases_active" not in {n for n, _ in samples(w.metrics.registry)}
        assert "tandem_kv_transfers_armed_total" not in {n for n, _ in samples(w.metrics.registry)}


def test_worker_serves_metrics_over_http_until_stopped(tmp_path: Path) -> None:
    with running_worker(tmp_path, "decode") as w:
        address = w.metrics.start()
        assert address.startswith("127.0.0.1:") and w.metrics.start() == address
        assert 'tandem_worker_up{model="' in scrape(address)
        w.metrics.stop()
        with pytest.raises(urllib.error.URLError):
            scrape(address)


def test_metrics_bind_every_interface_only_when_the_worker_does() -> None:
    spec = WorkerSpec(worker_id="w", role="decode", engine=EngineConfig())
    assert metrics_bind_host(replace(spec, host="0.0.0.0")) == "0.0.0.0"
    assert metrics_bind_host(replace(spec, host="::")) == "0.0.0.0"
    assert metrics_bind_host(spec) == "127.0.0.1"


# --- tandem serve: router /metrics and the file_sd list --------------------------------------------------
MEMBERS = [
    Member("prefill-0", "prefill", "127.0.0.1:1000", "127.0.0.1:2000"),
    Member("decode-0", "decode", "127.0.0.1:1001", "127.0.0.1:2001"),
    Member("decode-1", "decode", "127.0.0.1:1002", ""),  # has not reported its metrics address
    Member("decode-2", "decode", "127.0.0.1:1003", "127.0.0.1:2003"),
]


def test_target_groups_put_the_router_first_then_one_group_per_role() -> None:
    assert target_groups(["127.0.0.1:9464"], MEMBERS) == [
        TargetGroup("router", ("127.0.0.1:9464",)),
        TargetGroup("prefill", ("127.0.0.1:2000",)),
        TargetGroup("decode", ("127.0.0.1:2001", "127.0.0.1:2003")),
    ]
    assert target_groups([], []) == []


def test_file_sd_is_written_whole_readable_and_without_leftovers(tmp_path: Path) -> None:
    path = tmp_path / "tandem.json"
    write_file_sd(path, [TargetGroup("router", ("127.0.0.1:9464",))])
    write_file_sd(path, target_groups([], MEMBERS))
    assert json.loads(path.read_text()) == [
        {"targets": ["127.0.0.1:2000"], "labels": {"component": "prefill"}},
        {"targets": ["127.0.0.1:2001", "127.0.0.1:2003"], "labels": {"component": "decode"}},
    ]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
    assert os.listdir(tmp_path) == ["tandem.json"]


def test_serve_metrics_serves_the_router_and_rewrites_the_list_on_each_membership(tmp_path: Path) -> None:
    path = tmp_path / "sd" / "tandem.json"
    port = free_port()
    config = DeployConfig(router=RouterSettings(metrics_port=port, metrics_file_sd=str(path)))
    metrics = ServeMetrics(config, in_process_router=True)
    assert metrics.router_metrics is not None
    published: list[tuple[list[Member], int]] = []
    publish = metrics.wrap(lambda members, gen: published.append((members, gen)))
    metrics.start()
    try:
        assert metrics.router_address == f"127.0.0.1:{port}"
        assert "tandem_requests_total" in scrape(metrics.router_address)
        router_group = {"targets": [f"127.0.0.1:{port}"], "labels": {"component": "router"}}
        assert json.loads(path.read_text()) == [router_group]
        publish(MEMBERS[:2], 1)
        assert published == [(MEMBERS[:2], 1)]
        assert [g["labels"]["component"] for g in json.loads(path.read_text())] == [
            "router",
            "prefill",
            "decode",
        ]
        publish(MEMBERS[1:2], 2)  # the prefill worker died
        assert [g["labels"]["component"] for g in json.loads(path.read_text())] == ["router", "decode"]
    finally:
        metrics.close()
    assert json.loads(path.read_text()) == []
    with pytest.raises(urllib.error.URLError):
        scrape(f"127.0.0.1:{port}")
    metrics.close()  # twice is fine


def test_serve_metrics_with_port_0_serves_no_router_metrics(tmp_path: Path) -> None:
    config = DeployConfig(router=RouterSettings(metrics_port=0))
    metrics = ServeMetrics(config, in_process_router=True)
    metrics.start()
    assert metrics.router_metrics is None and metrics.router_address == "" and metrics.file_sd is None
    metrics.close()


def test_a_taken_metrics_port_is_an_error_naming_the_address() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"127.0.0.1:{port}"):
            MetricsHTTPServer("127.0.0.1", port, PrometheusRouterMetrics(MODEL).registry)


def test_metrics_file_sd_must_be_a_json_path() -> None:
    with pytest.raises(ConfigError, match=r"router\.metrics_file_sd"):
        parse_config({"router": {"metrics_file_sd": "targets.txt"}})
    config = parse_config({"router": {"metrics_file_sd": "deploy/prometheus/targets/tandem.json"}})
    assert config.router.metrics_file_sd == "deploy/prometheus/targets/tandem.json"
    assert DeployConfig().router.metrics_file_sd == ""
