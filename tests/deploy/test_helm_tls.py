"""The chart with TLS on (helm/tandem/ci/tls-values.yaml: Secrets made outside the chart; tls-cert-manager-values.yaml:
cert-manager Certificates): the config it carries, the Secrets every pod mounts, the routers' TLS probe run for
real against a TLS health server with certificates made here, the checks catching a broken rendering, and values
that cannot work refused. Lint, Kubernetes and KubeRay schemas and the other invariants run on these value sets
in test_helm_chart.py, like on every file under ci/."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from collections.abc import Callable
from concurrent import futures
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

import grpc
import helm_python
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from deploy.chartcheck import CHART_DIR, check_all, load_values_file, render, validate_rendering
from deploy.chartcheck.connections import rendered_config
from deploy.chartcheck.render import Rendering
from tandem_client.tls import ServerTLS
from tests.tls_certs import TestPKI

pytestmark = pytest.mark.unit
TLS_DIR = "/etc/tandem-tls"


@cache
def rendered(name: str) -> Rendering:
    return render(load_values_file(CHART_DIR / "ci" / name), label=name)


def router_container(r: Rendering) -> dict[str, Any]:
    router = next(d for d in r.objects("Deployment") if d["metadata"]["name"].endswith("-router"))
    container: dict[str, Any] = router["spec"]["template"]["spec"]["containers"][0]
    return container


def test_the_config_names_the_mounted_certificates() -> None:
    tls = rendered_config(rendered("tls-values.yaml")).tls
    assert tls.router is not None and tls.cluster is not None
    assert (tls.router.cert, tls.router.key) == (f"{TLS_DIR}/router/tls.crt", f"{TLS_DIR}/router/tls.key")
    assert (tls.router.client_ca, tls.router.require_client_cert) == (f"{TLS_DIR}/client-ca/ca.crt", True)
    assert (tls.cluster.ca, tls.cluster.server_name) == (f"{TLS_DIR}/cluster/ca.crt", "tandem-worker")
    assert rendered_config(rendered("tls-cert-manager-values.yaml")).tls.router.client_ca == ""  # type: ignore[union-attr]
    off = rendered_config(render({}, label="defaults")).tls
    assert off.router is None and off.cluster is None, "plaintext stays the default"
    assert "grpc" in router_container(render({}, label="defaults"))["readinessProbe"]


def test_cert_manager_certificates_fill_the_secrets_the_pods_mount() -> None:
    r = rendered("tls-cert-manager-values.yaml")
    certs = {c["metadata"]["name"]: c["spec"] for c in r.objects("Certificate")}
    assert set(certs) == {"demo-tandem-router", "demo-tandem-cluster"}
    assert certs["demo-tandem-router"]["secretName"] == "demo-tandem-router-tls"
    assert "demo-tandem-router-headless.llm.svc" in certs["demo-tandem-router"]["dnsNames"]
    assert "tandem.example.com" in certs["demo-tandem-router"]["dnsNames"]
    assert certs["demo-tandem-cluster"]["dnsNames"] == ["tandem-worker"]
    assert certs["demo-tandem-cluster"]["usages"] == ["server auth", "client auth"]
    assert all(c["issuerRef"] == {"name": "tandem-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}
               for c in certs.values())  # fmt: skip
    assert "TLS is on" in r.notes and "--tls-ca" in r.notes


class _TLSHealth:
    """A TLS gRPC health server on 127.0.0.1 standing in for a router that requires client certificates."""

    def __init__(self, tls: ServerTLS) -> None:
        self.servicer = health.HealthServicer()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, self.server)
        self.port = self.server.add_secure_port("127.0.0.1:0", tls.server_credentials())
        self.server.start()


def run_probe(command: list[str], files: dict[str, str], port: int) -> subprocess.CompletedProcess[str]:
    """The probe's `env VAR=... python -c SCRIPT` as rendered, its pod paths mapped onto `files` and its target
    onto `port`."""
    split = command.index("python")
    env = dict(os.environ)
    for word in command[1:split]:
        name, _, value = word.partition("=")
        env[name] = f"127.0.0.1:{port}" if name == "TANDEM_ROUTER" else files.get(value, value)
    argv = [sys.executable, *command[split + 1 :]]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)


def test_the_routers_tls_probe_passes_only_with_the_cluster_certificate_on_serving(tmp_path: Path) -> None:
    r = rendered("tls-values.yaml")
    command = router_container(r)["readinessProbe"]["exec"]["command"]
    assert router_container(r)["startupProbe"]["exec"]["command"] == command
    pki = TestPKI(tmp_path)
    clients = TestPKI(tmp_path / "clients", name="Tandem test clients CA")
    router_cert = pki.issue("router", names=("demo-tandem-router",))  # the name the probe checks
    member = pki.issue("member")
    files = {
        f"{TLS_DIR}/cluster/ca.crt": pki.ca_file,
        f"{TLS_DIR}/cluster/tls.crt": member[0],
        f"{TLS_DIR}/cluster/tls.key": member[1],
    }
    # the router as tls-values.yaml configures it: client certificates from the clients' CA or the cluster's
    router = _TLSHealth(
        ServerTLS(*router_cert, client_ca=clients.ca_file, require_client_cert=True, cluster_ca=pki.ca_file)
    )
    try:
        router.servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        ok = run_probe(command, files, router.port)
        assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stderr
        router.servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert run_probe(command, files, router.port).returncode == 1
        router.servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        stranger = pki.issue("stranger", ca=pki.other)
        refused = run_probe(command, {**files, f"{TLS_DIR}/cluster/tls.crt": stranger[0],
                                      f"{TLS_DIR}/cluster/tls.key": stranger[1]}, router.port)  # fmt: skip
        assert refused.returncode != 0 and "UNAVAILABLE" in refused.stderr
    finally:
        router.server.stop(None)


def mutated(r: Rendering, change: Callable[[list[dict[str, Any]]], None]) -> Rendering:
    docs = [copy.deepcopy(d) for d in r.manifests]
    change(docs)
    return replace(r, manifests=tuple(docs))


def _drop_worker_cluster_mount(docs: list[dict[str, Any]]) -> None:
    cluster = next(d for d in docs if d["kind"] == "RayCluster")
    container = cluster["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    container["volumeMounts"] = [m for m in container["volumeMounts"] if m["name"] != "tls-cluster"]


def _grpc_probe_on_tls_router(docs: list[dict[str, Any]]) -> None:
    router = next(d for d in docs if d["kind"] == "Deployment")
    router["spec"]["template"]["spec"]["containers"][0]["readinessProbe"] = {"grpc": {"port": 50051}}


def _router_certificate_without_the_headless_name(docs: list[dict[str, Any]]) -> None:
    cert = next(d for d in docs if d["kind"] == "Certificate" and d["metadata"]["name"].endswith("-router"))
    cert["spec"]["dnsNames"] = [n for n in cert["spec"]["dnsNames"] if "headless" not in n]


@pytest.mark.parametrize(
    ("values", "change", "finding"),
    [
        ("tls-values.yaml", _drop_worker_cluster_mount, "worker group prefill does not see tls.cluster.ca"),
        ("tls-values.yaml", _grpc_probe_on_tls_router, "router readinessProbe must run the health check"),
        ("tls-cert-manager-values.yaml", _router_certificate_without_the_headless_name,
         "Certificate demo-tandem-router must be a server certificate for ['demo-tandem-router-headless.llm.svc']"),
    ],
)  # fmt: skip
def test_the_checks_catch_a_broken_tls_rendering(
    values: str, change: Callable[[list[dict[str, Any]]], None], finding: str
) -> None:
    good = rendered(values)
    assert check_all(good) == [] and validate_rendering(good) == []
    assert any(finding in f for f in check_all(mutated(good, change))), check_all(mutated(good, change))


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"tls": {"clientCaSecretName": "ca"}}, "tls.clientCaSecretName: client certificates need TLS"),
        ({"tls": {"routerSecretName": "r"}}, "tls.routerSecretName: needs tls.internalSecretName"),
        (
            {"tls": {"certManager": {"enabled": True}}},
            "tls.certManager.issuerName: the Issuer or ClusterIssuer",
        ),
    ],
)
def test_templates_refuse_tls_values_that_cannot_work(values: dict, message: str) -> None:
    with pytest.raises(helm_python.HelmRenderError, match=re.escape(message)):
        render(values)


def test_the_schema_refuses_a_bad_issuer_kind() -> None:
    with pytest.raises(helm_python.HelmError, match="issuerKind"):
        render({"tls": {"certManager": {"enabled": True, "issuerName": "x", "issuerKind": "Vault"}}})
