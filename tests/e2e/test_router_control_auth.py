"""RouterControl (the worker set) on the router's public port is closed to API clients: on the real RouterServer
with fake workers (tests/e2e/fake_workers.py) and real certificates (tests/tls_certs.py), a SetWorkers call with
no key or a non-admin key is refused with UNAUTHENTICATED, without keys but with required client certificates a
public client's certificate is refused with PERMISSION_DENIED, and in every case the worker set is unchanged and
requests are still served; the controller's own pushes (deploy.publish.RouterPublisher) get through with an
admin key (controller.admin_key_file) or with a cluster certificate over mutual TLS."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from deploy.publish import AdminKeyError, RouterPublisher, admin_key_reader
from deploy.slots import Member
from model_runtime.roles import WorkerRole
from router.model import ServedModel
from tandem_api.tandem.v1 import admin_pb2, worker_pb2, worker_pb2_grpc
from tandem_client import TLSFiles
from tandem_client.tls import ServerTLS
from tests.e2e.fake_workers import FakeDecode, FakePrefill, LoopThread, RouterHarness, Script
from tests.polling import wait_until
from tests.tls_certs import TestPKI

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]
ADMIN = "tk-ops-0123456789abcdefgh"
USER = "tk-user-0123456789abcdefg"
ROGUE = worker_pb2.WorkerSet(
    workers=[
        worker_pb2.WorkerEndpoint(
            worker_id="evil", role=admin_pb2.WORKER_ROLE_COLOCATED, address="127.0.0.1:9"
        )
    ],
    generation=10**9,
)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> TestPKI:
    return TestPKI(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def make(
    router_loop: LoopThread, served_model: ServedModel, tmp_path: Path
) -> Iterator[Callable[..., RouterHarness]]:
    harnesses: list[RouterHarness] = []

    def build(keys: bool, **config: Any) -> RouterHarness:
        if keys:
            path = tmp_path / "keys.json"
            entries = [{"name": "ops", "secret": ADMIN, "admin": True}, {"name": "user", "secret": USER}]
            path.write_text(json.dumps({"keys": entries}))
            config["api_keys_file"] = str(path)
        tokens = served_model.tokenizer.encode(" one two three", False)
        harness = RouterHarness(router_loop, served_model, Script(tokens), **config)
        harness.add(FakePrefill, "p0")
        harness.add(FakeDecode, "d0")
        harnesses.append(harness)
        return harness.start(wait_ready=False)

    yield build
    for harness in harnesses:
        harness.close()


def set_workers(address: str, tls: TLSFiles | None = None, key: str | None = None) -> grpc.StatusCode:
    """One SetWorkers call with the rogue set; the status code it ended with (OK when taken)."""
    if tls is None:
        channel = grpc.insecure_channel(address)
    else:
        channel = grpc.secure_channel(
            address, tls.channel_credentials(), options=tls.channel_options("localhost")
        )
    metadata = (("authorization", f"Bearer {key}"),) if key else ()
    with channel:
        try:
            worker_pb2_grpc.RouterControlStub(channel).SetWorkers(ROGUE, timeout=5, metadata=metadata)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def worker_ids(harness: RouterHarness) -> list[str]:
    return sorted(w.worker_id for w in harness.router._pool.status())


def still_serving(harness: RouterHarness, **client: Any) -> None:
    """The worker set is the real one and a request is served end to end."""
    assert worker_ids(harness) == ["d0", "p0"]
    wait_until(lambda: harness.router.serving, what="the router SERVING", every_s=0.01)
    with harness.client(**client) as sdk:
        assert sdk.generate("hello", max_tokens=2).text


def members(harness: RouterHarness, ids: tuple[str, ...]) -> list[Member]:
    roles = {"p0": WorkerRole.PREFILL, "d0": WorkerRole.DECODE}
    return [Member(w.worker_id, roles[w.worker_id], w.address) for w in harness.workers if w.worker_id in ids]


def push(harness: RouterHarness, generation: int, ids: tuple[str, ...], **publisher: Any) -> None:
    """The controller's push of `ids` (RouterPublisher: one round, then closed)."""
    pub = RouterPublisher([harness.address], interval_s=3600, **publisher)
    try:
        pub.publish(members(harness, ids), generation)
    finally:
        pub.close()


def test_without_keys_or_client_certificates_it_stays_open_as_before(
    make: Callable[..., RouterHarness],
) -> None:
    harness = make(keys=False)  # nothing tells the controller from anyone: keep such a port private (docs)
    assert set_workers(harness.address) == grpc.StatusCode.OK
    assert worker_ids(harness) == ["evil"]


def test_with_keys_no_key_or_a_user_key_cannot_replace_the_worker_set(
    make: Callable[..., RouterHarness],
) -> None:
    harness = make(keys=True)
    assert set_workers(harness.address) == grpc.StatusCode.UNAUTHENTICATED
    assert set_workers(harness.address, key=USER) == grpc.StatusCode.UNAUTHENTICATED  # not an admin key
    assert set_workers(harness.address, key="tk-forged-0123456789abcdef") == grpc.StatusCode.UNAUTHENTICATED
    still_serving(harness, api_key=USER)


def test_with_keys_the_controllers_push_needs_its_admin_key(
    make: Callable[..., RouterHarness], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    harness = make(keys=True)
    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    push(harness, 5, ("d0",))  # no key: refused, nothing changes
    assert worker_ids(harness) == ["d0", "p0"]
    key_file = tmp_path / "admin.key"
    key_file.write_text(ADMIN + "\n")
    push(harness, 6, ("d0",), api_key=admin_key_reader(str(key_file)))
    assert worker_ids(harness) == ["d0"]
    monkeypatch.setenv("TANDEM_API_KEY", ADMIN)  # admin_key_file "": the environment's key
    push(harness, 7, ("d0", "p0"), api_key=admin_key_reader(""))
    still_serving(harness, api_key=USER)
    with pytest.raises(AdminKeyError, match=r"controller\.admin_key_file"):
        admin_key_reader(str(tmp_path / "missing.key"))


def public_router_tls(pki: TestPKI) -> ServerTLS:
    """Public port: client certificates required, from the public clients' CA or (cluster_ca) the cluster's."""
    cert, key = pki.issue("router-public")  # from the cluster CA: the controller checks it against that
    return ServerTLS(cert, key, client_ca=pki.other_ca_file, require_client_cert=True, cluster_ca=pki.ca_file)


@pytest.mark.parametrize("keys", [True, False], ids=["keys", "no-keys"])
def test_mutual_tls_a_cluster_certificate_may_set_workers_a_public_one_may_not(
    make: Callable[..., RouterHarness], pki: TestPKI, keys: bool
) -> None:
    harness = make(keys=keys, tls=public_router_tls(pki))
    public = TLSFiles(pki.ca_file, *pki.issue("api-client", ca=pki.other))
    cluster = TLSFiles(pki.ca_file, *pki.issue("controller"))
    refused = grpc.StatusCode.UNAUTHENTICATED if keys else grpc.StatusCode.PERMISSION_DENIED
    assert set_workers(harness.address, tls=public) == refused
    if keys:
        assert set_workers(harness.address, tls=public, key=USER) == grpc.StatusCode.UNAUTHENTICATED
    still_serving(harness, tls=public, api_key=USER if keys else None)
    push(harness, 3, ("d0",), tls=TLSFiles(pki.ca_file, *pki.issue("controller-push"), where="tls.cluster"))
    assert worker_ids(harness) == ["d0"]  # the controller's push, with its cluster certificate and no key
    assert set_workers(harness.address, tls=cluster) == grpc.StatusCode.OK
    assert worker_ids(harness) == ["evil"]
