"""The autoscaler's config section (errors name the field) and its loop: one step reads the window, asks the
policy, logs one line, counts tandem_autoscaler_decisions_total and asks the scaler for the new targets."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping

import pytest
from prometheus_client import CollectorRegistry

from deploy.autoscaler.loop import Autoscaler, AutoscalerMetrics
from deploy.autoscaler.settings import AutoscalerSettings, PoolBounds
from deploy.config import parse_config
from deploy.metrics import ServeMetrics
from model_runtime.config import ConfigError
from model_runtime.roles import WorkerRole
from router.recent_latency import RecentLatency
from router.scaling import PoolSize
from tandem_api.tandem.v1 import admin_pb2
from tandem_cli.output import status_json, status_table
from tandem_client import wire
from tests.loopback import free_port
from tests.unit.metrics_support import scrape

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("section", "top", "message"),
    [
        ({"ttft_s": 0}, {}, "autoscaler.ttft_s: must be a number > 0"),
        ({"tpot_s": "fast"}, {}, "autoscaler.tpot_s: must be a number > 0"),
        ({"window_s": 900}, {}, r"autoscaler.window_s: must be in \(0, 600\]"),
        ({"scale_up_patience": 0}, {}, "autoscaler.scale_up_patience: must be an integer >= 1"),
        ({"scale_down_margin": 1.0}, {}, r"autoscaler.scale_down_margin: must be in \(0, 1\)"),
        ({"enabled": "yes"}, {}, "autoscaler.enabled: must be true or false"),
        ({"max_total_workers": -1}, {}, "autoscaler.max_total_workers: must be an integer >= 0"),
        ({"decode": {"min": 3, "max": 2}}, {}, r"autoscaler.decode.max: must be an integer in \[min \(3\)"),
        ({"prefill": {"min": 0}}, {}, r"autoscaler.prefill.min: must be an integer in \[1, 1024\]"),
        ({"prefill": {"most": 2}}, {}, "autoscaler.prefill.most: unknown key; allowed: max, min"),
        ({"bogus": 1}, {}, "autoscaler.bogus: unknown key"),
        (
            {"enabled": True, "prefill": {"max": 2}},
            {"prefill": {"replicas": 3}},
            r"prefill.replicas: 3 lies outside autoscaler.prefill \[1, 2\]",
        ),
        (
            {"enabled": True, "max_total_workers": 1},
            {},
            "autoscaler.max_total_workers: 1 is below autoscaler.prefill.min \\+ autoscaler.decode.min",
        ),
        (
            {"enabled": True, "max_total_workers": 3},
            {"prefill": {"replicas": 2}, "decode": {"replicas": 2}},
            r"autoscaler.max_total_workers: 3 is below the pools' starting replicas \(4\)",
        ),
        (
            {"enabled": True, "max_total_workers": 3},
            {"prefill": {"engine": {"parallel": {"tensor_parallel_size": 4}}}},
            r"autoscaler.max_total_workers: the budget counts workers, and the pools' workers span different "
            r"numbers of devices \(prefill 4, decode 1\)",
        ),
    ],
)
def test_a_bad_autoscaler_section_is_refused_naming_the_field(section: dict, top: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"autoscaler": section, **top})


def test_the_autoscaler_is_off_by_default_and_bounds_are_checked_only_when_on() -> None:
    config = parse_config({"prefill": {"replicas": 9}})
    assert config.autoscaler.enabled is False
    on = parse_config({"mode": "colocated", "colocated": {"replicas": 2}, "autoscaler": {"enabled": True}})
    assert on.autoscaler.budget((WorkerRole.COLOCATED,)) == 4  # no total: the pool's max


class Pools:
    """A Scaler whose pools reach their targets at once (the controller's contract, without Ray)."""

    def __init__(self, **sizes: int) -> None:
        self.sizes = {WorkerRole(role): n for role, n in sizes.items()}
        self.calls: list[dict[WorkerRole, int]] = []

    def scale(self, targets: Mapping[WorkerRole, int]) -> list[PoolSize]:
        self.calls.append(dict(targets))
        self.sizes.update(targets)
        return self.pool_sizes()

    def pool_sizes(self) -> list[PoolSize]:
        return [PoolSize(role, n, ready=n) for role, n in self.sizes.items()]

    def autoscaler_status(self) -> str:
        return ""


def test_a_step_logs_counts_and_applies_a_persistent_miss(caplog: pytest.LogCaptureFixture) -> None:
    settings = AutoscalerSettings(
        enabled=True,
        window_s=10,
        min_requests=3,
        ttft_s=0.5,
        tpot_s=0.05,
        scale_up_patience=2,
        cooldown_s=0,
        prefill=PoolBounds(1, 2),
        decode=PoolBounds(1, 2),
    )
    now = [0.0]
    recent = RecentLatency(clock=lambda: now[0])
    for _ in range(5):
        recent.record(2.0, 0.01)  # slow first tokens, fast decode
    pools, registry = Pools(prefill=1, decode=1), CollectorRegistry()
    autoscaler = Autoscaler(settings, pools, recent.stats, list, registry, clock=lambda: now[0])

    def decisions(**labels: str) -> float | None:
        return registry.get_sample_value("tandem_autoscaler_decisions_total", labels)

    with caplog.at_level(logging.WARNING, logger="tandem.autoscaler"):
        assert autoscaler.step().changes == () and pools.calls == []
        now[0] += 1
        autoscaler.step()
    assert pools.calls == [{WorkerRole.PREFILL: 2}]
    assert decisions(pool="prefill", direction="up", reason="ttft_miss") == 1
    (line,) = [r.getMessage() for r in caplog.records]
    assert "ttft p90 1.9" in line and "target 0.5s" in line and "prefill 1 -> 2 (ttft_miss)" in line
    assert autoscaler.last_decision.endswith(line)
    for _ in range(4):  # still missing, now at the pool's max: blocked every 2nd step, counted, nothing asked
        now[0] += 11  # past the quiet time after the change (one window), and past the old samples
        for _ in range(5):
            recent.record(2.0, 0.01)
        autoscaler.step()
    assert pools.calls == [{WorkerRole.PREFILL: 2}]
    assert decisions(pool="prefill", direction="blocked", reason="at_max") == 2
    assert decisions(pool="decode", direction="up", reason="tpot_miss") is None


def test_tandem_status_prints_the_last_decision_after_the_pools() -> None:
    line = (
        "12:00:05 ttft p90 1.500s (target 1s, 20 requests), tpot p90 ... over 5s: prefill 1 -> 2 (ttft_miss)"
    )
    message = admin_pb2.ClusterStatus(
        router=admin_pb2.RouterInfo(),
        pools=[admin_pb2.PoolSize(role=admin_pb2.WORKER_ROLE_PREFILL, target=2, ready=1, starting=1)],
        autoscaler=line,
    )
    status = wire.status_from_proto(message)
    assert status.autoscaler == line
    assert status_table(status).splitlines()[-3:] == [
        "POOL     TARGET  READY  STARTING  DRAINING",
        "prefill  2       1      1         0",
        f"autoscaler: {line}",
    ]
    assert json.loads(status_json(status))["autoscaler"] == line
    quiet = wire.status_from_proto(admin_pb2.ClusterStatus(router=admin_pb2.RouterInfo()))
    assert "autoscaler" not in status_table(quiet)


def test_beside_standalone_routers_the_controller_serves_the_autoscaler_counter(tmp_path) -> None:
    port = free_port()
    config = parse_config(
        {
            "router": {"metrics_port": port, "metrics_file_sd": str(tmp_path / "targets.json")},
            "controller": {"routers": ["router.example:50051"]},
            "autoscaler": {"enabled": True},
        }
    )
    metrics = ServeMetrics(config, in_process_router=False)
    assert metrics.router_metrics is None and metrics.registry is not None
    AutoscalerMetrics(metrics.registry)
    metrics.start()
    try:
        assert "tandem_autoscaler_decisions_total" in scrape(metrics.address)
        assert json.loads((tmp_path / "targets.json").read_text()) == []  # no router target: it is not one
    finally:
        metrics.close()
    off = parse_config({"controller": {"routers": ["router.example:50051"]}})
    assert ServeMetrics(off, in_process_router=False).registry is None
