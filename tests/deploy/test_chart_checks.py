"""The checks themselves catch what they claim to (each mutation of a good rendering must produce a finding), the
vendored CRD schemas and the dashboard copy stay in sync with their sources, and the `helm test` Pod's script
really tells a serving router from a failing one."""

from __future__ import annotations

import copy
import gzip
import json
import os
import subprocess
import sys
from collections.abc import Callable
from concurrent import futures
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from deploy.chartcheck import CHART_DIR, check_all, load_values_file, render, validate_rendering
from deploy.chartcheck.crds import RAY_KINDS, SCHEMA_DIR, extract_v1_schema, load_yaml
from deploy.chartcheck.render import Rendering

pytestmark = pytest.mark.unit

REPO = CHART_DIR.parents[1]
SHARED_CRDS = REPO.parent / "shared" / "schemas" / "kuberay"


@pytest.fixture(scope="module")
def good() -> Rendering:
    return render({"metrics": {m: {"enabled": True} for m in ("serviceMonitor", "podMonitor", "dashboards")}})


def mutated(
    r: Rendering, kind: str, change: Callable[[dict[str, Any]], None], name_part: str = ""
) -> Rendering:
    """A copy of the rendering with one object of `kind` (whose name contains name_part) changed."""
    docs = [copy.deepcopy(d) for d in r.manifests]
    target = next(d for d in docs if d["kind"] == kind and name_part in d["metadata"]["name"])
    change(target)
    return replace(r, manifests=tuple(docs))


def group(doc: dict[str, Any], name: str) -> dict[str, Any]:
    return next(g for g in doc["spec"]["workerGroupSpecs"] if g["groupName"] == name)


def set_config(doc: dict[str, Any], edit: Callable[[dict[str, Any]], None]) -> None:
    config = yaml.safe_load(doc["data"]["tandem.yaml"])
    edit(config)
    doc["data"]["tandem.yaml"] = yaml.safe_dump(config)


MUTATIONS: list[tuple[str, str, Callable[[dict[str, Any]], None], str]] = [
    (
        "Service",
        "-router",
        lambda d: d["spec"]["selector"].update({"app.kubernetes.io/component": "routr"}),
        "matches no pod",
    ),
    ("Service", "-router", lambda d: d["spec"]["ports"][1].update(targetPort="prom"), "targetPort 'prom'"),
    (
        "Deployment",
        "-router",
        lambda d: d["spec"]["selector"]["matchLabels"].update(extra="x"),
        "does not match its pod",
    ),
    (
        "Deployment",
        "-router",
        lambda d: d["spec"]["template"]["spec"]["containers"][0].pop("readinessProbe"),
        "readinessProbe",
    ),
    (
        "Deployment",
        "-router",
        lambda d: d["metadata"]["labels"].pop("app.kubernetes.io/part-of"),
        "missing labels",
    ),
    (
        "RayCluster",
        "",
        lambda d: group(d, "decode")["rayStartParams"].update({"num-gpus": 1}),
        "must be a string",
    ),
    (
        "RayCluster",
        "",
        lambda d: group(d, "prefill")["template"]["spec"]["containers"][0]["resources"]["limits"].update(
            {"nvidia.com/gpu": 2}
        ),
        "limit is 2",
    ),
    ("RayCluster", "", lambda d: group(d, "prefill").update(replicas=3), "replicas is 3"),
    (
        "RayCluster",
        "",
        lambda d: group(d, "decode")["rayStartParams"].update(resources='"{\\"tandem_prefill\\":1}"'),
        "advertises custom resources",
    ),
    ("RayCluster", "", lambda d: d["spec"]["headGroupSpec"]["rayStartParams"].pop("num-cpus"), "num-cpus"),
    (
        "RayCluster",
        "",
        lambda d: d["spec"]["headGroupSpec"]["template"]["spec"].pop("volumes"),
        "does not mount ConfigMap",
    ),
    (
        "RayCluster",
        "",
        lambda d: group(d, "decode")["template"]["metadata"]["labels"].update(rayclusterx="1"),
        "KubeRay reserves",
    ),
    (
        "RayJob",
        "",
        lambda d: d["spec"].update(clusterSelector={"ray.io/cluster": "other"}),
        "does not name RayCluster",
    ),
    ("RayJob", "", lambda d: d["spec"].update(backoffLimit=2), "backoffLimit"),
    (
        "ConfigMap",
        "-config",
        lambda d: set_config(d, lambda c: c["decode"].update(ray_resources={"gpu_pool": 1})),
        "ray_resources",
    ),
    (
        "ConfigMap",
        "-config",
        lambda d: set_config(d, lambda c: c["prefill"].update(replicas=3)),
        "3 workers need 3",
    ),
    (
        "ConfigMap",
        "-config",
        lambda d: set_config(d, lambda c: c["router"].update(port=50052)),
        "router ports",
    ),
    (
        "ConfigMap",
        "-config",
        lambda d: set_config(d, lambda c: c["router"].update(http_port=8080)),
        "router ports",
    ),
    (
        "ConfigMap",
        "-config",
        lambda d: set_config(d, lambda c: c["controller"].update(routers=["demo-tandem-router:50051"])),
        "headless Service",
    ),
    (
        "ServiceMonitor",
        "",
        lambda d: d["spec"]["endpoints"][0].update(port="grpc-metrics"),
        "on 0 selected Services",
    ),
    (
        "PodMonitor",
        "",
        lambda d: d["spec"]["selector"]["matchLabels"].update({"app.kubernetes.io/instance": "x"}),
        "matches no pod",
    ),
    (
        "ConfigMap",
        "-config",
        lambda d: set_config(d, lambda c: c["decode"].update(metrics_port=9999)),
        "worker metrics container ports",
    ),
    (
        "ConfigMap",
        "-config",
        lambda d: set_config(d, lambda c: c["prefill"].update(metrics_port=0)),
        "want a fixed port",
    ),
    (
        "RayCluster",
        "",
        lambda d: group(d, "decode")["template"]["spec"]["containers"][0]["ports"][1].update(
            containerPort=9466
        ),
        "decode: worker metrics container ports",
    ),
    (
        "PodMonitor",
        "-decode",
        lambda d: d["spec"]["podMetricsEndpoints"][0].update(port="w9-metrics"),
        "0 PodMonitors scrape",
    ),
    (
        "PodMonitor",
        "-prefill",
        lambda d: d["spec"]["selector"]["matchLabels"].pop("app.kubernetes.io/component"),
        "selects the Ray head",
    ),
    (
        "PodMonitor",
        "-decode",
        lambda d: d["spec"]["podMetricsEndpoints"][0]["relabelings"][1].update(targetLabel="role"),
        "sets target label role",
    ),
    (
        "ConfigMap",
        "-dashboard",
        lambda d: d["metadata"]["labels"].update(grafana_dashboard="true"),
        'must be "1"',
    ),
]


@pytest.mark.parametrize(
    ("kind", "name_part", "change", "expected"), MUTATIONS, ids=[m[3] for m in MUTATIONS]
)
def test_invariant_checks_catch_broken_manifests(
    good: Rendering, kind: str, name_part: str, change, expected: str
) -> None:
    assert check_all(good) == []
    findings = check_all(mutated(good, kind, change, name_part))
    assert any(expected in f for f in findings), findings


@pytest.fixture(scope="module")
def tensor_parallel() -> Rendering:
    """Colocated workers of 2 GPUs, 4 a pod (8 GPUs and 8 tandem_colocated units), 2..3 pods, autoscaled."""
    return render(load_values_file(CHART_DIR / "ci" / "tensor-parallel-values.yaml"), label="tp")


def one_worker_of_16_ranks(config: dict[str, Any]) -> None:
    """16 ranks need 16 units and GPUs, and the group's 2 pods have that many, but no one pod has."""
    config["colocated"]["engine"]["parallel"]["tensor_parallel_size"] = 16
    config["colocated"]["replicas"] = 1
    config["autoscaler"]["colocated"] = {"min": 1, "max": 1}


TP_MUTATIONS: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    (
        "ConfigMap",
        lambda d: set_config(
            d, lambda c: c["colocated"]["engine"]["parallel"].update(tensor_parallel_size=4)
        ),
        "colocated: 8 workers need 32 tandem_colocated (4 ranks each), the group offers 16",
    ),
    (
        "ConfigMap",
        lambda d: set_config(d, one_worker_of_16_ranks),
        "holds 0 whole workers of 16 ranks (a worker's ranks share one pod), 0 in 2 pods, short of 1",
    ),
    (
        "RayCluster",
        lambda d: group(d, "colocated")["rayStartParams"].update({"num-gpus": "3"}),
        "colocated: a pod (8 tandem_colocated, 3 GPUs) holds 1 whole workers of 2 ranks",
    ),
    (  # one port per device, as if every rank served: the pods expose one per worker
        "ConfigMap",
        lambda d: set_config(d, lambda c: c["colocated"].update(metrics_port_count=8)),
        "one port per worker of a pod (4)",
    ),
    (  # 2 pods of 4 workers hold 8, not the 12 the autoscaler may ask for
        "RayCluster",
        lambda d: group(d, "colocated").update(maxReplicas=2),
        "autoscaler.colocated.max is 12 workers, the group holds at most 8",
    ),
]


@pytest.mark.parametrize(("kind", "change", "expected"), TP_MUTATIONS, ids=[m[2] for m in TP_MUTATIONS])
def test_invariant_checks_count_ranks_of_tensor_parallel_workers(
    tensor_parallel: Rendering, kind: str, change, expected: str
) -> None:
    assert check_all(tensor_parallel) == []
    findings = check_all(mutated(tensor_parallel, kind, change))
    assert any(expected in f for f in findings), findings


def swap_phase_widths(config: dict[str, Any]) -> None:
    """Prefill workers of 2 ranks and decode workers of 4, in groups sized for the other way round."""
    config["prefill"]["engine"]["parallel"]["tensor_parallel_size"] = 2
    config["decode"]["engine"]["parallel"]["tensor_parallel_size"] = 4


def test_invariant_checks_count_ranks_of_prefill_and_decode_workers() -> None:
    """The checks count each handoff pool's ranks by its own size, not colocated's alone nor one for both."""
    r = render(load_values_file(CHART_DIR / "ci" / "disagg-tensor-parallel-values.yaml"), label="disagg tp")
    assert check_all(r) == []
    findings = check_all(mutated(r, "ConfigMap", lambda d: set_config(d, swap_phase_widths)))
    assert (
        "disagg tp: prefill: 2 workers need 4 tandem_prefill (2 ranks each), the group offers 8" in findings
    )
    assert "disagg tp: decode: 4 workers need 16 tandem_decode (4 ranks each), the group offers 8" in findings


@pytest.mark.parametrize(
    ("kind", "change", "expected"),
    [
        ("RayCluster", lambda d: d["spec"].update(workerGroupSpec=[]), "'workerGroupSpec' was unexpected"),
        ("RayCluster", lambda d: group(d, "prefill").update(maxReplicas="1"), "is not of type 'integer'"),
        ("RayJob", lambda d: d["spec"].update(entrypoint=["python"]), "is not of type 'string'"),
        (
            "Deployment",
            lambda d: d["spec"]["template"]["spec"]["containers"][0].update(imagePullPolice="x"),
            "imagePullPolice",
        ),
        ("Service", lambda d: d["spec"]["ports"][0].update(port="grpc"), "is not of type 'integer'"),
    ],
)
def test_schema_validation_catches_broken_objects(good: Rendering, kind: str, change, expected: str) -> None:
    assert validate_rendering(good) == []
    errors = validate_rendering(mutated(good, kind, change))
    assert any(expected in e for e in errors), errors


@pytest.mark.skipif(not SHARED_CRDS.is_dir(), reason="no ../shared/schemas/kuberay beside this checkout")
@pytest.mark.parametrize("kind", sorted(RAY_KINDS))
def test_vendored_crd_schemas_match_shared(kind: str) -> None:
    crd = load_yaml(SHARED_CRDS / f"ray.io_{kind.lower()}s.yaml")
    vendored = json.loads(gzip.decompress((SCHEMA_DIR / RAY_KINDS[kind]).read_bytes()))
    assert vendored == extract_v1_schema(crd)


def test_dashboard_copy_matches_deploy_grafana() -> None:
    source = REPO / "deploy" / "grafana" / "tandem.json"
    if not source.exists():
        pytest.skip("deploy/grafana/tandem.json does not exist yet; the chart ships a placeholder")
    copy_in_chart = CHART_DIR / "dashboards" / "tandem.json"
    assert copy_in_chart.read_bytes() == source.read_bytes(), f"run: cp {source} {copy_in_chart}"


class _Health:
    """A real gRPC server on 127.0.0.1 with the standard health service, standing in for the router."""

    def __init__(self) -> None:
        self.servicer = health.HealthServicer()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def set(self, status: int) -> None:
        self.servicer.set("", status)


def run_hook(good: Rendering, target: str) -> subprocess.CompletedProcess[str]:
    """Run the test Pod's container command as rendered, with TANDEM_ROUTER pointed at `target`."""
    container = good.hooks[0]["spec"]["containers"][0]
    command = [sys.executable if c == "python" else c for c in container["command"] + container["args"]]
    env = {**os.environ, **{e["name"]: e["value"] for e in container["env"]}, "TANDEM_ROUTER": target}
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=60, check=False)


def test_helm_test_pod_passes_only_on_serving(good: Rendering) -> None:
    router = _Health()
    try:
        router.set(health_pb2.HealthCheckResponse.SERVING)
        ok = run_hook(good, f"127.0.0.1:{router.port}")
        assert ok.returncode == 0, ok.stderr
        assert "SERVING" in ok.stdout
        router.set(health_pb2.HealthCheckResponse.NOT_SERVING)
        assert run_hook(good, f"127.0.0.1:{router.port}").returncode == 1
    finally:
        router.server.stop(None)
    gone = run_hook(good, f"127.0.0.1:{router.port}")
    assert gone.returncode != 0 and "UNAVAILABLE" in gone.stderr


def test_chart_check_cli_reports_and_fails_on_a_bad_values_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("prefill:\n  replicas: -2\n")
    good_file = CHART_DIR / "ci" / "cpu-values.yaml"
    run = [sys.executable, "-m", "deploy.chartcheck", "-f"]
    failed = subprocess.run(
        [*run, str(bad)], capture_output=True, text=True, cwd=REPO, timeout=120, check=False
    )
    assert failed.returncode == 1 and "/prefill/replicas" in failed.stdout
    passed = subprocess.run(
        [*run, str(good_file)], capture_output=True, text=True, cwd=REPO, timeout=120, check=False
    )
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert "0 problem(s)" in passed.stdout
