"""`tandem serve` with a TLS config, end to end: the router's public port requires a client certificate, the
router reaches its worker over mutual TLS (tls.cluster), and `tandem generate` / `status` / `scale` connect with
--tls-ca/--tls-cert/--tls-key. Without them, or at the worker's own port without a cluster certificate, the
call is refused with an error that says what to check, and the cluster keeps serving.

One colocated worker: the cheapest cluster that still has a router -> worker hop (one Ray start, ~50 s on CI).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem_cli.cli import EXIT_RUNTIME, main
from tandem_client.errors import TLS_HINT_CLOSED
from tandem_client.tls import TLSFiles
from tests.e2e.cluster import ServeProcess
from tests.tls_certs import TestPKI

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]


@pytest.fixture(scope="module")
def tls_cluster(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[ServeProcess, TestPKI, list[str]]]:
    tmp = tmp_path_factory.mktemp("tls-serve")
    pki = TestPKI(tmp / "pki")
    router_cert, router_key = pki.issue("router")
    member_cert, member_key = pki.issue("member")
    tls = {
        "router": {
            "cert": router_cert,
            "key": router_key,
            "client_ca": pki.ca_file,
            "require_client_cert": True,
        },
        "cluster": {"ca": pki.ca_file, "cert": member_cert, "key": member_key},
    }
    client_cert, client_key = pki.issue("client")
    flags = ["--tls-ca", pki.ca_file, "--tls-cert", client_cert, "--tls-key", client_key]
    with ServeProcess(tmp, prefill=0, decode=0, colocated=1, num_blocks=128, extra={"tls": tls}) as cluster:
        yield cluster, pki, flags
    assert cluster.exit_code == 0, "".join(cluster.lines[-30:])


def test_tandem_generate_and_status_over_tls(
    tls_cluster: tuple[ServeProcess, TestPKI, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    cluster, _, flags = tls_cluster
    argv = ["generate", "--server", cluster.address, *flags, "--max-tokens", "8", "--json", "The capital of"]
    assert main(argv) == 0, capsys.readouterr().err
    record = json.loads(capsys.readouterr().out)
    assert len(record["token_ids"]) == 8 and record["text"]
    assert main(["status", "--server", cluster.address, *flags, "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert [(w["role"], w["state"]) for w in status["workers"]] == [("colocated", "ready")]
    assert main(["scale", "--server", cluster.address, *flags, "--colocated", "1", "--json"]) == 0  # a no-op
    assert [p["target"] for p in json.loads(capsys.readouterr().out)] == [1]


def test_clients_without_the_certificates_are_refused_and_the_cluster_keeps_serving(
    tls_cluster: tuple[ServeProcess, TestPKI, list[str]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    cluster, pki, flags = tls_cluster
    for name in ("CA", "CERT", "KEY", "SERVER_NAME"):
        monkeypatch.delenv(f"TANDEM_TLS_{name}", raising=False)
    for refused in ([], flags[:2]):  # plaintext; TLS without a client certificate
        assert main(["generate", "--server", cluster.address, *refused, "Hello"]) == EXIT_RUNTIME
        assert TLS_HINT_CLOSED.strip(" []") in capsys.readouterr().err
    missing = str(tmp_path / "none.crt")
    assert main(["status", "--server", cluster.address, "--tls-ca", missing]) == 2
    assert "--tls.ca: cannot read" in capsys.readouterr().err

    assert main(["status", "--server", cluster.address, *flags, "--json"]) == 0
    worker = json.loads(capsys.readouterr().out)["workers"][0]["address"]
    member = TLSFiles(pki.ca_file, *pki.issue("probe"), server_name="tandem-worker")
    for client, serves in (
        (None, False),
        (TLSFiles(pki.ca_file, server_name="tandem-worker"), False),
        (member, True),
    ):
        assert worker_health(worker, client) == serves, client

    argv = ["generate", "--server", cluster.address, *flags, "--max-tokens", "4", "--json", "Still there?"]
    assert main(argv) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 4


def worker_health(address: str, tls: TLSFiles | None) -> bool:
    """True when the worker at `address` answered SERVING over a channel with `tls` (None: plaintext)."""
    channel = (
        grpc.insecure_channel(address)
        if tls is None
        else grpc.secure_channel(address, tls.channel_credentials(), options=tls.channel_options())
    )
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING
