"""Every Tandem metric follows the Prometheus naming conventions, and the dashboard and alerts use only real ones.

The registries are the real ones (router hooks called, a tiny engine run through its loop), scraped to text and
parsed back with prometheus_client's parser, so the names checked are the names Prometheus stores.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from tests.unit.metrics_support import populated_router_metrics, running_worker, scrape, served_router_text

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "tandem.json"
HELM_DASHBOARD = ROOT / "helm" / "tandem" / "dashboards" / "tandem.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"

ALLOWED_LABELS = {"model", "protocol", "role", "worker", "status", "finish_reason", "reason", "code", "le"}
# An API key's name (bounded by the operator's key file, never the secret) and its class (router.auth).
ALLOWED_LABELS |= {"key", "priority"}
# A fixed set of steps a duration is split into (the KV handoff's, the first token's).
ALLOWED_LABELS |= {"phase"}
# When a kernel was built: during start-up or after it (model_runtime.kernel_builds).
ALLOWED_LABELS |= {"when"}
# Unbounded or per-request values must never be labels: one series per request would swamp Prometheus.
FORBIDDEN_LABELS = {"request_id", "request", "id", "prompt", "text", "user", "client", "trace_id", "address"}
NON_BASE_UNITS = re.compile(
    r"_(ms|msec|milliseconds|us|microseconds|ns|nanoseconds|minutes|hours|days|kb|mb|gb|kib|mib|gib|"
    r"kilobytes|megabytes|gigabytes|percent|perc|pct|bits)(_|$)"
)
TIME_WORDS = {"latency", "duration", "time", "seconds", "delay", "age"}
COUNTABLE_HISTOGRAMS = {"tandem_batch_size"}  # a count of sequences: no unit to name


@pytest.fixture(scope="module")
def registries(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """component -> the text Prometheus reads from its /metrics (workers scraped while they run)."""
    texts = {"router": served_router_text(populated_router_metrics())}
    for role in ("prefill", "decode"):
        with running_worker(tmp_path_factory.mktemp(role), role) as worker:
            worker.generate([5, 6, 7, 8, 9], max_tokens=3)
            texts[role] = scrape(worker.metrics.start())
    return texts


def families(registries: dict[str, str], component: str) -> list[Metric]:
    return list(text_string_to_metric_families(registries[component]))


COMPONENTS = ("router", "prefill", "decode")


@pytest.mark.parametrize("component", COMPONENTS)
def test_names_have_the_prefix_and_base_units(registries, component: str) -> None:
    for family in families(registries, component):
        assert family.name.startswith("tandem_"), family.name
        assert not NON_BASE_UNITS.search(family.name), (
            f"{family.name}: use base units (seconds, bytes, ratio)"
        )
        assert family.name == family.name.lower() and ":" not in family.name, family.name
        if family.type == "histogram" and family.name not in COUNTABLE_HISTOGRAMS:
            assert family.name.endswith(("_seconds", "_bytes")), f"{family.name}: histogram without a unit"
        if TIME_WORDS & set(family.name.split("_")) and family.type in ("histogram", "gauge", "summary"):
            assert family.name.endswith("_seconds"), f"{family.name}: a time must be in _seconds"
        if "usage" in family.name or "utilization" in family.name:
            assert family.name.endswith("_ratio"), f"{family.name}: a usage is a ratio (0-1)"


@pytest.mark.parametrize("component", COMPONENTS)
def test_counters_end_in_total_and_only_counters_do(registries, component: str) -> None:
    for family in families(registries, component):
        for sample in family.samples:
            if family.type == "counter":
                assert sample.name.endswith(("_total", "_created")), sample.name
            else:
                assert not sample.name.endswith("_total"), f"{sample.name}: _total on a {family.type}"


@pytest.mark.parametrize("component", COMPONENTS)
def test_labels_are_bounded_and_every_series_names_its_model(registries, component: str) -> None:
    for family in families(registries, component):
        for sample in family.samples:
            labels = set(sample.labels)
            assert not labels & FORBIDDEN_LABELS, (
                f"{sample.name}: per-request label {labels & FORBIDDEN_LABELS}"
            )
            assert labels <= ALLOWED_LABELS, f"{sample.name}: unexpected labels {labels - ALLOWED_LABELS}"
            assert "model" in labels, sample.name
            if component != "router":
                assert sample.labels["role"] == component and sample.labels["worker"] == f"{component}-0"


@pytest.mark.parametrize("component", COMPONENTS)
def test_ratios_stay_between_0_and_1(registries, component: str) -> None:
    ratios = [s for f in families(registries, component) for s in f.samples if s.name.endswith("_ratio")]
    assert all(0.0 <= s.value <= 1.0 for s in ratios), ratios
    if component != "router":
        assert ratios, "workers export tandem_kv_cache_usage_ratio"


def test_router_and_workers_never_define_the_same_name(registries) -> None:
    """sum(x) over every target must not mix the router's meaning of x with a worker's."""
    router = {f.name for f in families(registries, "router")}
    workers = {f.name for c in ("prefill", "decode") for f in families(registries, c)}
    assert router & workers == set()


def test_the_required_metrics_exist(registries) -> None:
    names = {s.name for c in COMPONENTS for f in families(registries, c) for s in f.samples}
    required = {
        "tandem_requests_total",
        "tandem_time_to_first_token_seconds_bucket",
        "tandem_inter_token_latency_seconds_bucket",
        "tandem_e2e_request_latency_seconds_bucket",
        "tandem_request_queue_seconds_bucket",
        "tandem_prompt_tokens_total",
        "tandem_generation_tokens_total",
        "tandem_requests_running",
        "tandem_requests_waiting",
        "tandem_kv_cache_used_blocks",
        "tandem_kv_cache_total_blocks",
        "tandem_kv_cache_usage_ratio",
        "tandem_batch_size_bucket",
        "tandem_step_duration_seconds_bucket",
        "tandem_prefill_tokens_total",
        "tandem_worker_up",
        "tandem_worker_gil_wait_seconds_bucket",
        "tandem_kv_transfer_seconds_bucket",
        "tandem_kv_transfer_bytes_total",
        "tandem_kv_transfer_failures_total",
        "tandem_kv_leases_active",
    }
    assert required - names == set()


def referenced_metrics(text: str) -> set[str]:
    return set(re.findall(r"\btandem_[a-z0-9_]+", text))


def test_dashboard_and_alerts_use_only_exported_metrics(registries) -> None:
    exported = {s.name for c in COMPONENTS for f in families(registries, c) for s in f.samples}
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [dashboard["templating"]["list"][1]["definition"]]
    alerts = yaml.safe_load(ALERTS.read_text())
    exprs += [rule["expr"] for group in alerts["groups"] for rule in group["rules"]]
    used = set().union(*(referenced_metrics(e) for e in exprs))
    assert used - exported == set(), "queries name metrics nobody exports"
    assert len(used) >= 20


def test_dashboard_uses_the_datasource_variable_everywhere() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["templating"]["list"][0] == {
        **dashboard["templating"]["list"][0],
        "name": "datasource",
        "type": "datasource",
        "query": "prometheus",
    }
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"]), panel["title"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_helm_chart_ships_the_same_dashboard() -> None:
    assert HELM_DASHBOARD.read_text() == DASHBOARD.read_text()
