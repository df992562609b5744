"""The deploy config's `tls` section and what it turns into: errors that name the field (structure when parsed,
files when loaded), the worker's and the router's settings, the controller's router channels, the SDK's
environment, and the plaintext warning's loopback test."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from deploy.config import load_config, parse_config
from deploy.router_inputs import router_config
from deploy.slots import worker_spec
from model_runtime.config import ConfigError
from model_runtime.roles import WorkerRole
from tandem_client.channel import make_config
from tandem_client.errors import TLS_HINT_CLOSED, TLS_HINT_SERVER, tls_hint
from tandem_client.tls import ServerTLS, TLSFiles, is_loopback, plaintext_warning
from tests.tls_certs import TestPKI

pytestmark = pytest.mark.unit


def files(tmp_path: Path) -> dict[str, str]:
    """A cluster CA, a cluster certificate and a router certificate (real ones: loading checks them)."""
    pki = TestPKI(tmp_path)
    cert, key = pki.issue("member")
    router_cert, router_key = pki.issue("router")
    return {"ca": pki.ca_file, "cert": cert, "key": key, "router_cert": router_cert, "router_key": router_key}


def tls_section(f: dict[str, str]) -> dict:
    return {
        "router": {"cert": f["router_cert"], "key": f["router_key"]},
        "cluster": {"ca": f["ca"], "cert": f["cert"], "key": f["key"]},
    }


def test_no_tls_section_is_plaintext_everywhere() -> None:
    config = parse_config({})
    assert config.tls.router is None and config.tls.cluster is None
    assert router_config(config).tls is None and router_config(config).worker_tls is None
    assert worker_spec(config, WorkerRole.DECODE, 0).tls is None
    assert config.tls.router_client() is None


def test_a_tls_section_reaches_the_router_the_workers_and_the_controller(tmp_path: Path) -> None:
    f = files(tmp_path)
    config = parse_config({"tls": tls_section(f)})
    router = router_config(config)
    assert router.tls == ServerTLS(f["router_cert"], f["router_key"], where="tls.router")
    assert router.worker_tls == TLSFiles(f["ca"], f["cert"], f["key"], "tandem-worker", where="tls.cluster")
    spec = worker_spec(config, WorkerRole.PREFILL, 0)
    assert spec.tls == ServerTLS(f["cert"], f["key"], f["ca"], require_client_cert=True, where="tls.cluster")
    # a router that checks client certificates also takes cluster ones (the controller's, the health probes')
    checked = parse_config(
        {"tls": {**tls_section(f), "router": {**tls_section(f)["router"], "client_ca": f["ca"]}}}
    )
    assert router_config(checked).tls.cluster_ca == f["ca"]  # type: ignore[union-attr]
    # the controller dials routers with the cluster certificate and checks theirs against the cluster CA
    assert config.tls.router_client() == TLSFiles(f["ca"], f["cert"], f["key"], where="tls.cluster")


@pytest.mark.parametrize(
    ("tls", "message"),
    [
        ("yes", "tls: must be a mapping"),
        ({"public": {}}, "tls.public: unknown key"),
        ({"router": {"cert": "a.pem"}}, "tls.router.key: a TLS server needs both cert and key"),
        ({"router": {"cert": "a", "key": "b", "pem": "c"}}, "tls.router.pem: unknown key"),
        (
            {"router": {"cert": "a", "key": "b", "require_client_cert": True}},
            "tls.router.require_client_cert: needs tls.router.client_ca",
        ),
        ({"router": {"cert": "a", "key": "b", "require_client_cert": "no"}}, "must be true or false"),
        ({"cluster": {"ca": "a", "cert": "b"}}, "tls.cluster.key: must be a non-empty string"),
        ({"cluster": {"ca": "a", "cert": "b", "key": 3}}, "tls.cluster.key: must be a non-empty string"),
    ],
)
def test_a_malformed_tls_section_names_the_field(tls: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"tls": tls})


def test_loading_checks_every_file_and_names_the_first_bad_one(tmp_path: Path) -> None:
    f = files(tmp_path)
    section = tls_section(f)
    section["cluster"]["key"] = str(tmp_path / "missing.key")
    path = tmp_path / "tandem.yaml"
    path.write_text(yaml.safe_dump({"tls": section}))
    with pytest.raises(ConfigError, match=r"tls\.cluster\.key: cannot read .*missing\.key.*No such file"):
        load_config(path)
    Path(f["router_cert"]).write_text("not PEM")
    with pytest.raises(ConfigError, match=r"tls\.router\.cert: .* is not a PEM file"):
        load_config(path)
    section["cluster"]["key"] = f["key"]
    section["router"]["cert"] = f["cert"]  # another certificate than router_key's
    path.write_text(yaml.safe_dump({"tls": section}))
    with pytest.raises(ConfigError, match=r"tls\.router\.key: does not match tls\.router\.cert"):
        load_config(path)
    again = TestPKI(tmp_path / "again")
    cert, key = again.issue("router")
    section["router"] = {"cert": cert, "key": key}  # a good pair: the file loads
    path.write_text(yaml.safe_dump({"tls": section}))
    assert load_config(path).tls.router is not None


def test_the_sdk_takes_tls_files_or_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("CA", "CERT", "KEY", "SERVER_NAME"):
        monkeypatch.delenv(f"TANDEM_TLS_{name}", raising=False)
    plain = make_config("h:1", None, 1024, 0, None, (), ())
    assert plain.credentials is None
    f = files(tmp_path)
    monkeypatch.setenv("TANDEM_TLS_CA", f["ca"])
    monkeypatch.setenv("TANDEM_TLS_SERVER_NAME", "router.example")
    from_env = make_config("h:1", None, 1024, 0, None, (), ())
    assert from_env.credentials is not None
    assert ("grpc.ssl_target_name_override", "router.example") in from_env.grpc_options()
    with pytest.raises(ValueError, match="give one of them"):
        make_config("h:1", None, 1024, 0, from_env.credentials, (), (), tls=TLSFiles(f["ca"]))
    with pytest.raises(ValueError, match=r"tls\.cert: cert and key go together"):
        TLSFiles(f["ca"], key=f["key"])


def test_only_a_listener_beyond_loopback_is_warned_about() -> None:
    for host in ("127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"):
        assert is_loopback(host) and plaintext_warning("x", host) is None, host
    for host in ("0.0.0.0", "::", "10.1.2.3", "router.example"):
        assert not is_loopback(host), host
        assert "x listens on " + host + " without TLS" in (plaintext_warning("x", host) or "")


def test_a_failed_handshake_says_what_to_check() -> None:
    closed = "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1: Socket closed"
    assert tls_hint(closed) == closed + TLS_HINT_CLOSED
    verify = "Tls handshake failed (TSI_PROTOCOL_FAILURE): CERTIFICATE_VERIFY_FAILED: certificate has expired"
    assert tls_hint(verify) == verify + TLS_HINT_SERVER
    assert tls_hint("no worker is ready") == "no worker is ready"
