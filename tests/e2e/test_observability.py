"""Observability end to end: `tandem serve` (the shared standard cluster: real Ray and gRPC) scraped by a REAL
Prometheus.

Prometheus runs from deploy/prometheus/prometheus.yml (intervals shortened to 1 s, paths made absolute) and finds
the router and every worker only through the file_sd list `tandem serve` writes. After 7 good and 2 invalid
requests, its query API must show exactly those requests, tokens and transfers added to the counters (the cluster
is the shared standard one: earlier tests' requests are already counted), every worker up and idle, our alert
rules evaluating without error, and every Grafana dashboard query answering. promtool checks the example config
and unit-tests the alert rules. Needs Debian's `prometheus` package (`make install` adds it).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tandem_client import AsyncClient, Client
from tandem_client.errors import InvalidArgument
from tests.e2e.cluster import STANDARD_DECODE, STANDARD_PREFILL, ServeProcess
from tests.loopback import free_port
from tests.polling import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
PROM_DIR = ROOT / "deploy" / "prometheus"
DASHBOARD = ROOT / "deploy" / "grafana" / "tandem.json"
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
needs_prometheus = pytest.mark.skipif(
    not Path(PROMETHEUS).is_file(), reason="the prometheus binary is missing (apt-get install prometheus)"
)
needs_promtool = pytest.mark.skipif(
    not Path(PROMTOOL).is_file(), reason="promtool is missing (apt-get install prometheus)"
)
PROMPTS = [
    "The river runs past the old mill and",
    "Seven quiet engines",
    "Write one line about copper lanterns.",
    "A falcon over the canyon",
    "paper orbit maple signal harbor",
    "Once upon a time",
    "Silver meadow, violet thunder:",
]
WAIT_S = 60.0
POLL_S = 0.25  # Prometheus scrapes and evaluates every second; a check runs up to ~30 queries
WORKERS = STANDARD_PREFILL + STANDARD_DECODE


class Prometheus:
    """A Prometheus server on 127.0.0.1 with its own config and TSDB in tmp_path; query() uses the HTTP API."""

    def __init__(self, tmp_path: Path, file_sd: Path) -> None:
        config = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
        config["global"].update(scrape_interval="1s", evaluation_interval="1s")
        config["rule_files"] = [str(PROM_DIR / f) for f in config["rule_files"]]
        job = config["scrape_configs"][0]
        job["scrape_timeout"] = "1s"
        job["file_sd_configs"] = [{"files": [str(file_sd)], "refresh_interval": "1s"}]
        self.config_path = tmp_path / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / "prometheus.log"
        self.storage = tmp_path / "tsdb"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Prometheus:
        cmd = [
            PROMETHEUS,
            f"--config.file={self.config_path}",
            f"--storage.tsdb.path={self.storage}",
            f"--web.listen-address=127.0.0.1:{self.port}",
        ]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        wait_until(lambda: self._get("/-/ready") is not None, 30, "prometheus ready", self.log_tail)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def log_tail(self) -> str:
        return "".join(self.log_path.read_text().splitlines(keepends=True)[-20:])

    def _get(self, path: str) -> bytes | None:
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as reply:
                return bytes(reply.read())
        except OSError:
            return None

    def api(self, path: str, **params: str) -> dict:
        body = self._get(f"/api/v1/{path}?{urllib.parse.urlencode(params)}")
        if body is None:
            raise AssertionError(f"prometheus {path} did not answer:\n{self.log_tail()}")
        reply = json.loads(body)
        if reply["status"] != "success":
            raise AssertionError(f"prometheus {path} {params}: {reply}")
        return reply["data"]

    def query(self, expr: str, at: float | None = None) -> list[tuple[dict[str, str], float]]:
        """`expr` evaluated now, or at the unix time `at`."""
        data = self.api("query", query=expr, **({} if at is None else {"time": f"{at:.3f}"}))
        return [(r["metric"], float(r["value"][1])) for r in data["result"]]

    def scalar(self, expr: str, at: float | None = None) -> float | None:
        """The value of a query that yields at most one series (None when it yields none)."""
        result = self.query(expr, at)
        if len(result) > 1:
            raise AssertionError(f"{expr}: expected one series, got {result}")
        return result[0][1] if result else None


@pytest.fixture(scope="module")
def service(
    standard_cluster: ServeProcess, tmp_path_factory
) -> Iterator[tuple[ServeProcess, Prometheus, Path]]:
    """Prometheus on the shared standard cluster (tests/e2e/conftest.py checks the empty target list its clean
    stop leaves)."""
    if not Path(PROMETHEUS).is_file():
        pytest.skip("the prometheus binary is missing (apt-get install prometheus)")
    file_sd = standard_cluster.metrics_file_sd
    assert file_sd is not None
    with Prometheus(tmp_path_factory.mktemp("observability"), file_sd) as prometheus:
        yield standard_cluster, prometheus, file_sd


def settled(prometheus: Prometheus) -> float:
    """A moment after which only the caller's requests change the counters: the service was idle and every
    target had been scraped since. Counters read at that moment hold what earlier tests sent."""
    idle = "sum(tandem_requests_running) + sum(tandem_requests_waiting) + sum(tandem_kv_leases_active)"
    wait_until(lambda: prometheus.scalar(idle) == 0, WAIT_S, "an idle service", every_s=POLL_S)
    since = time.time()
    fresh = 'min(timestamp(up{job="tandem"}))'
    wait_until(lambda: (prometheus.scalar(fresh) or 0) > since, WAIT_S, "a fresh scrape", every_s=POLL_S)
    return time.time()


def growth(prometheus: Prometheus, expr: str, since: float) -> float:
    now, before = prometheus.scalar(expr), prometheus.scalar(expr, at=since)
    assert now is not None, f"{expr}: no series"
    return now - (before or 0)


async def _generate(address: str) -> list:
    """ignore_eos: no request may end at prefill's first token (its lease would be aborted, not transferred)."""
    async with AsyncClient(address) as client:
        return await asyncio.gather(
            *(client.generate(p, temperature=0, max_tokens=6, ignore_eos=True) for p in PROMPTS)
        )


@needs_prometheus
def test_file_sd_lists_the_router_and_every_worker(service) -> None:
    _, prometheus, file_sd = service
    groups = {g["labels"]["component"]: g["targets"] for g in json.loads(file_sd.read_text())}
    counts = {"decode": STANDARD_DECODE, "prefill": STANDARD_PREFILL, "router": 1}
    assert {component: len(targets) for component, targets in groups.items()} == counts, groups

    def all_up() -> bool:
        active = prometheus.api("targets", state="active")["activeTargets"]
        return len(active) == 1 + WORKERS and all(t["health"] == "up" for t in active)

    wait_until(
        all_up,
        WAIT_S,
        f"{1 + WORKERS} healthy targets",
        lambda: json.dumps(prometheus.api("targets"), indent=1),
        every_s=POLL_S,
    )
    active = prometheus.api("targets", state="active")["activeTargets"]
    assert Counter(t["labels"]["component"] for t in active) == counts


@needs_prometheus
def test_prometheus_sees_exactly_the_requests_tokens_and_transfers(service) -> None:
    serve, prometheus, _ = service
    start = settled(prometheus)
    results = asyncio.run(_generate(serve.address))
    with Client(serve.address) as client:
        for _ in range(2):
            with pytest.raises(InvalidArgument):
                client.generate("hello", temperature=-1.0)
    prompt_tokens = sum(r.usage.prompt_tokens for r in results)
    generated = sum(r.usage.completion_tokens for r in results)
    gaps = sum(r.usage.completion_tokens - 1 for r in results)
    added = {  # what these 9 requests add to each counter
        'sum(tandem_requests_total{status="ok"})': 7,
        'sum(tandem_requests_total{status="INVALID_ARGUMENT"})': 2,
        "sum(tandem_requests_total)": 9,
        "sum(tandem_time_to_first_token_seconds_count)": 7,
        "sum(tandem_e2e_request_latency_seconds_count)": 7,
        "sum(tandem_request_queue_seconds_count)": 7,
        "sum(tandem_inter_token_latency_seconds_count)": gaps,
        "sum(tandem_prompt_tokens_total)": prompt_tokens,
        "sum(tandem_generation_tokens_total)": generated,
        'sum(tandem_engine_requests_total{role="prefill"})': 7,
        'sum(tandem_engine_requests_total{role="decode"})': 7,
        'sum(tandem_kv_transfer_seconds_count{role="decode"})': 7,
        'sum(tandem_kv_transfer_seconds_count{role="prefill"})': 7,
        'sum(tandem_prefill_tokens_total{role="decode"})': 0,  # decode workers receive the prompt as KV
        "sum(tandem_kv_transfer_failures_total)": 0,
    }
    expected = {expr: (prometheus.scalar(expr, at=start) or 0) + n for expr, n in added.items()} | {
        "count(tandem_worker_up == 1)": WORKERS,
        "max(tandem_kv_cache_used_blocks)": 0,
        "max(tandem_kv_leases_active)": 0,
        "max(tandem_kv_transfers_active)": 0,
        "sum(tandem_requests_running) + sum(tandem_requests_waiting)": 0,
    }
    got: dict[str, float | None] = {}

    def caught_up() -> bool:
        got.update({expr: prometheus.scalar(expr) for expr in expected})
        return all(got[expr] == value for expr, value in expected.items())

    def mismatches() -> str:
        return "\n".join(f"{e}: got {got.get(e)}, want {v}" for e, v in expected.items() if got.get(e) != v)

    wait_until(caught_up, WAIT_S, "the scrape to show every request", mismatches, every_s=POLL_S)
    sent = {
        side: growth(prometheus, f'sum(tandem_kv_transfer_bytes_total{{role="{side}"}})', start)
        for side in ("prefill", "decode")
    }
    assert sent["decode"] > 0 and sent["decode"] == sent["prefill"], sent
    computed = growth(prometheus, 'sum(tandem_prefill_tokens_total{role="prefill"})', start)
    assert 0 < computed <= prompt_tokens  # the prefix cache may skip whole blocks
    assert prometheus.scalar("count(tandem_kv_cache_usage_ratio)") == WORKERS
    assert prometheus.scalar('sum(tandem_step_duration_seconds_count{role="decode"})')


@needs_prometheus
def test_alert_rules_load_and_evaluate_cleanly(service) -> None:
    _, prometheus, _ = service
    names = {r["alert"] for r in yaml.safe_load((PROM_DIR / "alerts.yml").read_text())["groups"][0]["rules"]}

    def evaluated() -> bool:
        rules = [r for g in prometheus.api("rules")["groups"] for r in g["rules"]]
        never = "0001-01-01T00:00:00Z"  # Prometheus' zero time: not evaluated yet
        return {r["name"] for r in rules} == names and all(r["lastEvaluation"] != never for r in rules)

    wait_until(
        evaluated,
        WAIT_S,
        "every alert rule to be evaluated",
        lambda: json.dumps(prometheus.api("rules")),
        every_s=POLL_S,
    )
    rules = [r for g in prometheus.api("rules")["groups"] for r in g["rules"]]
    assert [(r["name"], r["health"], r.get("lastError", "")) for r in rules if r["health"] != "ok"] == []
    assert [r["name"] for r in rules if r["state"] == "firing"] == []


@needs_prometheus
def test_every_dashboard_query_answers(service) -> None:
    serve, prometheus, _ = service
    asyncio.run(
        _generate(serve.address)
    )  # its own traffic: KV handoff phases and rates exist without other tests
    dashboard = json.loads(DASHBOARD.read_text())
    targets = [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(targets) > 20
    # no series until a retry or a worker failure happens, or until a KV claim is refused
    may_be_empty = {"Retries and worker failures", "KV handoffs refused"}
    pending = [
        (title, expr.replace("$__rate_interval", "1m").replace("$model", ".*"))
        for title, expr in targets
        if title not in may_be_empty
    ]

    def all_answer() -> bool:  # rate() needs two scrapes of a series: new series answer a moment later
        pending[:] = [(title, expr) for title, expr in pending if not prometheus.query(expr)]
        return not pending

    wait_until(
        all_answer,
        WAIT_S,
        "every dashboard query to answer",
        lambda: "\n".join(map(str, pending)),
        every_s=POLL_S,
    )


@needs_promtool
def test_promtool_accepts_the_example_config_and_the_alert_unit_tests_pass() -> None:
    for args in (["check", "config", "prometheus.yml"], ["test", "rules", "alerts_test.yml"]):
        done = subprocess.run([PROMTOOL, *args], cwd=PROM_DIR, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"promtool {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
