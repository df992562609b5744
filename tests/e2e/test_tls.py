"""TLS on the real listeners, with real certificates (tests/tls_certs.py) on 127.0.0.1 and no Ray:

- a worker's gRPC server (worker_host.start_grpc with a cluster ServerTLS) takes calls only from a peer holding
  a certificate from the cluster CA: plaintext, no certificate, another CA's or an expired one are refused at
  the handshake, and the server goes on serving;
- the real RouterServer with server TLS and required client certificates on gRPC and HTTP, dialling fake
  workers (tests/e2e/fake_workers.py) that require the cluster certificate: a client with the right CA and
  certificate is served end to end; the same refusals at the router's doors, with an error that says what to
  check, and the router keeps serving the good client;
- a plaintext listener beyond loopback is warned about, a TLS one is not.
"""

from __future__ import annotations

import json
import logging
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from model_runtime.config import EngineConfig
from router.model import ServedModel
from tandem_client import Client, TLSFiles, Unavailable
from tandem_client.errors import TLS_HINT_CLOSED, TLS_HINT_SERVER, error_from_rpc
from tandem_client.tls import ServerTLS, TLSError
from tests.e2e.fake_workers import FakeDecode, FakePrefill, LoopThread, RouterHarness, Script
from tests.tls_certs import TestPKI
from worker_host.host import start_grpc
from worker_host.spec import WorkerSpec

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]
MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> TestPKI:
    return TestPKI(tmp_path_factory.mktemp("pki"))


def health_check(address: str, tls: TLSFiles | None) -> int:
    """The health status at `address` over a channel with `tls` (None: plaintext); raises Unavailable."""
    if tls is None:
        channel = grpc.insecure_channel(address)
    else:
        channel = grpc.secure_channel(address, tls.channel_credentials(), options=tls.channel_options())
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError as exc:
            raise error_from_rpc(
                exc
            ) from exc  # the SDK's translation: a refused handshake says what to check
    return int(reply.status)


def refused_clients(pki: TestPKI) -> dict[str, tuple[TLSFiles | None, str]]:
    """Clients a cluster-certificate server must refuse, and the hint each one's error carries."""
    stranger = pki.issue("stranger", ca=pki.other)
    expired = pki.issue("expired", expired=True)
    member = pki.issue("member")
    return {
        "plaintext": (None, TLS_HINT_CLOSED),
        "no client certificate": (TLSFiles(pki.ca_file), TLS_HINT_CLOSED),
        "a certificate from another CA": (TLSFiles(pki.ca_file, *stranger), TLS_HINT_CLOSED),
        "an expired certificate": (TLSFiles(pki.ca_file, *expired), TLS_HINT_CLOSED),
        "trusting another CA": (TLSFiles(pki.other_ca_file, *member), TLS_HINT_SERVER),
        "the wrong server name": (TLSFiles(pki.ca_file, *member, server_name="elsewhere"), TLS_HINT_SERVER),
    }


# --- a worker's server --------------------------------------------------------------------------------------
def test_a_worker_serves_only_peers_with_a_cluster_certificate(pki: TestPKI) -> None:
    cert, key = pki.issue("worker")
    tls = ServerTLS(cert, key, client_ca=pki.ca_file, require_client_cert=True, where="tls.cluster")
    spec = WorkerSpec("decode-0", "decode", EngineConfig(), tls=tls)
    server, port, _ = start_grpc(spec, lambda s: None, ())
    address = f"127.0.0.1:{port}"
    member = TLSFiles(pki.ca_file, *pki.issue("router"), server_name="tandem-worker")
    try:
        assert health_check(address, member) == health_pb2.HealthCheckResponse.SERVING
        for what, (client, hint) in refused_clients(pki).items():
            with pytest.raises(Unavailable) as refused:
                health_check(address, client)
            assert hint in refused.value.details, what
            # the refusal cost the worker nothing: a cluster member is still served
            assert health_check(address, member) == health_pb2.HealthCheckResponse.SERVING, what
    finally:
        server.stop(None)


def test_a_router_port_that_checks_client_certificates_also_takes_cluster_ones(pki: TestPKI) -> None:
    """tls.router.client_ca from the clients' CA, tls.cluster.ca beside it: both kinds get in, a third not."""
    clients = TestPKI(Path(pki.ca_file).parent / "clients", name="Tandem test clients CA")
    server_tls = ServerTLS(
        *pki.issue("router-door"), client_ca=clients.ca_file, require_client_cert=True, cluster_ca=pki.ca_file
    )
    spec = WorkerSpec("door", "decode", EngineConfig(), tls=server_tls)  # any server built from a ServerTLS
    server, port, _ = start_grpc(spec, lambda s: None, ())
    address = f"127.0.0.1:{port}"
    try:
        for ca, files, served in (
            (clients.ca, clients.issue("user"), True),
            (pki.ca, pki.issue("controller"), True),
            (pki.other, pki.issue("stranger-door", ca=pki.other), False),
        ):
            client = TLSFiles(pki.ca_file, *files)
            if served:
                assert health_check(address, client) == health_pb2.HealthCheckResponse.SERVING, ca.name
            else:
                with pytest.raises(Unavailable):
                    health_check(address, client)
    finally:
        server.stop(None)


def test_a_plaintext_listener_beyond_loopback_is_warned_about(
    pki: TestPKI, caplog: pytest.LogCaptureFixture
) -> None:
    cert, key = pki.issue("worker")
    for tls, warned in ((None, True), (ServerTLS(cert, key), False)):
        caplog.clear()
        spec = WorkerSpec("prefill-0", "prefill", EngineConfig(), host="0.0.0.0", tls=tls)
        with caplog.at_level(logging.WARNING, logger="worker_host.host"):
            server, _, _ = start_grpc(spec, lambda s: None, ())
        server.stop(None)
        assert any("without TLS" in r.getMessage() for r in caplog.records) == warned
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="worker_host.host"):
        server, _, _ = start_grpc(WorkerSpec("prefill-1", "prefill", EngineConfig()), lambda s: None, ())
    server.stop(None)
    assert not caplog.records, "loopback (the local default) is not warned about"


def test_the_router_warns_about_plaintext_beyond_loopback(
    router_loop: LoopThread, served_model: ServedModel, pki: TestPKI, caplog: pytest.LogCaptureFixture
) -> None:
    for tls, warned in ((None, True), (ServerTLS(*pki.issue("router-any")), False)):
        caplog.clear()
        harness = RouterHarness(router_loop, served_model, Script([1]), host="0.0.0.0", http_port=0, tls=tls)
        with caplog.at_level(logging.WARNING, logger="router.server"):
            router_loop.run(harness.router.start())
        router_loop.run(harness.router.stop(grace=0))
        messages = [r.getMessage() for r in caplog.records]
        assert (
            any("router's gRPC and HTTP APIs listens on 0.0.0.0 without TLS" in m for m in messages) == warned
        )


# --- the router ---------------------------------------------------------------------------------------------
class TLSWorkerMixin:
    """A fake worker that requires the cluster certificate, as a real worker with tls.cluster does."""

    tls: ServerTLS

    async def serve(self) -> str:
        self.server = grpc.aio.server()
        self.register(self.server)  # type: ignore[attr-defined]
        port = self.server.add_secure_port("127.0.0.1:0", self.tls.server_credentials())
        await self.server.start()
        self.address = f"127.0.0.1:{port}"
        return self.address


@pytest.fixture
def tls_router(
    router_loop: LoopThread, served_model: ServedModel, pki: TestPKI, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[RouterHarness, TLSFiles]]:
    worker_cert = pki.issue("worker", names=("tandem-worker",))  # no IP: the router must check the name
    worker_tls = ServerTLS(*worker_cert, client_ca=pki.ca_file, require_client_cert=True)
    decode = type("TLSDecode", (TLSWorkerMixin, FakeDecode), {"tls": worker_tls})
    prefill = type("TLSPrefill", (TLSWorkerMixin, FakePrefill), {"tls": worker_tls})
    client = TLSFiles(pki.ca_file, *pki.issue("client"))
    for name, value in (("CA", client.ca), ("CERT", client.cert), ("KEY", client.key)):
        monkeypatch.setenv(f"TANDEM_TLS_{name}", value)  # the harness's own SDK client dials with TLS too
    tokens = served_model.tokenizer.encode(" one two three four", False)
    harness = RouterHarness(
        router_loop,
        served_model,
        Script(tokens * 4, batch=2),
        http_port=0,
        tls=ServerTLS(*pki.issue("router-public"), client_ca=pki.ca_file, require_client_cert=True),
        worker_tls=TLSFiles(pki.ca_file, *pki.issue("router"), server_name="tandem-worker"),
    )
    harness.add(prefill, "p0")
    harness.add(decode, "d0")
    harness.start()  # waits until the router's TLS polls found both workers READY
    yield harness, client
    harness.close()


def https(url: str, body: dict | None, client: TLSFiles | None, ca: str) -> tuple[int, Any]:
    context = ssl.create_default_context(cafile=ca)
    if client is not None and client.cert:
        context.load_cert_chain(client.cert, client.key)
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10, context=context) as response:
        return response.status, json.loads(response.read())


def test_the_router_serves_tls_clients_over_mutual_tls_to_its_workers(
    tls_router: tuple[RouterHarness, TLSFiles],
) -> None:
    harness, client = tls_router
    assert harness.router.http_address.startswith("https://")
    with Client(harness.address, tls=client, timeout=10, retries=0) as sdk:
        result = sdk.generate("Count:", max_tokens=6)
    assert result.usage.completion_tokens == 6
    assert [len(w.requests) for w in harness.workers] == [1, 1], "both workers served it over mutual TLS"
    status, reply = https(
        harness.router.http_address + "/v1/completions",
        {"model": MODEL, "prompt": "Count:", "max_tokens": 4},
        client,
        client.ca,
    )
    assert status == 200 and reply["usage"]["completion_tokens"] == 4


def test_the_router_refuses_bad_clients_and_keeps_serving(
    tls_router: tuple[RouterHarness, TLSFiles], pki: TestPKI, monkeypatch: pytest.MonkeyPatch
) -> None:
    harness, good = tls_router
    for name in ("CA", "CERT", "KEY"):
        monkeypatch.delenv(f"TANDEM_TLS_{name}")  # each client below is exactly what it says
    for what, (files, hint) in refused_clients(pki).items():
        with (
            Client(harness.address, tls=files, timeout=10, retries=0) as sdk,
            pytest.raises(Unavailable) as refused,
        ):
            sdk.generate("Count:", max_tokens=2)
        assert hint in refused.value.details, what
        with Client(harness.address, tls=good, timeout=10, retries=0) as sdk:
            assert sdk.generate("Count:", max_tokens=2).usage.completion_tokens == 2, what
    url = harness.router.http_address + "/v1/models"
    with pytest.raises((urllib.error.URLError, ConnectionError)):  # plaintext HTTP to the HTTPS port
        urllib.request.urlopen(url.replace("https://", "http://"), timeout=10)
    for files in (TLSFiles(pki.ca_file), TLSFiles(pki.ca_file, *pki.issue("old", expired=True))):
        with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
            https(url, None, files, pki.ca_file)  # no client certificate / an expired one
    assert https(url, None, good, good.ca)[0] == 200
    calls = len(refused_clients(pki))
    assert [len(w.requests) for w in harness.workers] == [calls, calls], "only the good clients' calls ran"


def test_bad_certificate_files_fail_naming_the_field(tmp_path: Path, pki: TestPKI) -> None:
    cert, key = pki.issue("router")
    missing, not_pem = tmp_path / "nope.crt", tmp_path / "key.txt"
    not_pem.write_text("not a key")
    with pytest.raises(TLSError, match=r"tls\.client_ca: cannot read .*nope\.crt"):
        ServerTLS(cert, key, client_ca=str(missing), require_client_cert=True).check()
    with pytest.raises(TLSError, match=r"tls\.cluster\.key: .*key\.txt' is not a PEM file"):
        TLSFiles(pki.ca_file, cert, str(not_pem), where="tls.cluster").check()
    with pytest.raises(TLSError, match=r"tls\.key: does not match tls\.cert"):
        ServerTLS(cert, pki.issue("other")[1]).check()
