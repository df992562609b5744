"""TLS material from PEM files -> gRPC credentials and ssl contexts: the one place Tandem reads certificates.

    TLSFiles      what a client presents and trusts: ca (roots; "" = the system's), cert + key (its own
                  certificate, for servers that ask for one), server_name (the name the server's certificate
                  must carry, when the dialled address is not that name, e.g. a pod IP)
    ServerTLS     what a server presents (cert + key) and, with client_ca, which client certificates it checks;
                  require_client_cert refuses a handshake without one (mutual TLS)

Clients (the SDK, the CLI, the router's worker channels, the controller's router channels) use
`TLSFiles.channel_credentials()` and `TLSFiles.channel_options()`; servers (the router's gRPC and HTTP APIs, the
workers) use `ServerTLS.server_credentials()` / `ServerTLS.ssl_context()`. Inside a cluster both sides hold a
certificate from one cluster CA (`ServerTLS(cert, key, client_ca=ca, require_client_cert=True)` on a worker,
`TLSFiles(ca, cert, key, server_name)` on the router), so a worker takes calls only from a peer that holds one.

It lives in the SDK because the SDK is the lowest package that may use grpc and that every other package may
import (the router may not import worker_host, model_runtime may not import grpc). Files are read when
credentials are built, not at construction: a dataclass of paths crosses Ray to a worker on another node and
is read there; every error names the field and the file.
"""

from __future__ import annotations

import ipaddress
import os
import ssl
from dataclasses import dataclass

import grpc

TLS_CA_ENV = "TANDEM_TLS_CA"
TLS_CERT_ENV = "TANDEM_TLS_CERT"
TLS_KEY_ENV = "TANDEM_TLS_KEY"
TLS_SERVER_NAME_ENV = "TANDEM_TLS_SERVER_NAME"
_PEM_BEGIN = b"-----BEGIN "


class TLSError(ValueError):
    """A TLS setting or file is unusable; the message starts with the field's name (e.g. `tls.cluster.cert:`)."""


def read_pem(path: str, field: str) -> bytes:
    """The PEM bytes of `path`; TLSError naming `field` when the file is missing, unreadable or not PEM."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise TLSError(f"{field}: cannot read {path!r} ({exc.strerror or exc})") from None
    if _PEM_BEGIN not in data:
        raise TLSError(f"{field}: {path!r} is not a PEM file (no '-----BEGIN' line)")
    return data


def _check_path(value: object, field: str, what: str) -> None:
    if not isinstance(value, str):
        raise TLSError(f"{field}: must be the path of {what} (a string), got {value!r}")


@dataclass(frozen=True)
class TLSFiles:
    """A TLS client: the roots it trusts (`ca`; "" = the system's), its own certificate (`cert` + `key`, both
    or neither) and the name the server's certificate must carry (`server_name`; "" = the dialled host)."""

    ca: str = ""
    cert: str = ""
    key: str = ""
    server_name: str = ""
    where: str = "tls"  # the config path that errors name ("tls.cluster"); not part of the setting

    def __post_init__(self) -> None:
        for name, what in (("ca", "a CA bundle"), ("cert", "a certificate"), ("key", "a private key")):
            _check_path(getattr(self, name), f"{self.where}.{name}", what)
        _check_path(self.server_name, f"{self.where}.server_name", "a host name")
        if bool(self.cert) != bool(self.key):
            missing = "key" if self.cert else "cert"
            raise TLSError(f"{self.where}.{missing}: cert and key go together; set both or neither")

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Reads the files now; TLSError names the field of one that is missing or not PEM."""
        return grpc.ssl_channel_credentials(
            root_certificates=read_pem(self.ca, f"{self.where}.ca") if self.ca else None,
            private_key=read_pem(self.key, f"{self.where}.key") if self.key else None,
            certificate_chain=read_pem(self.cert, f"{self.where}.cert") if self.cert else None,
        )

    def channel_options(self, server_name: str = "") -> list[tuple[str, str]]:
        """The gRPC option that checks the server's certificate for `server_name` (else self.server_name)
        instead of the dialled host; [] when neither is set."""
        name = server_name or self.server_name
        return [("grpc.ssl_target_name_override", name)] if name else []

    def check(self) -> None:
        """Read every file once (TLSError naming the first bad one), so a process fails at start-up."""
        self.channel_credentials()

    @classmethod
    def from_env(cls) -> TLSFiles | None:
        """$TANDEM_TLS_CA / _CERT / _KEY / _SERVER_NAME; None when none of them is set (plaintext)."""
        values = {
            "ca": os.environ.get(TLS_CA_ENV, ""),
            "cert": os.environ.get(TLS_CERT_ENV, ""),
            "key": os.environ.get(TLS_KEY_ENV, ""),
            "server_name": os.environ.get(TLS_SERVER_NAME_ENV, ""),
        }
        return cls(**values, where="$TANDEM_TLS") if any(values.values()) else None


@dataclass(frozen=True)
class ServerTLS:
    """A TLS server: its certificate chain and key, and with `client_ca` the roots that client certificates must
    chain to; `require_client_cert` refuses every handshake without a valid one (it needs client_ca).
    `cluster_ca`, with client_ca, is a second bundle client certificates may chain to: a router that requires
    client certificates still lets in the controller and in-pod health checks, which hold cluster ones.

    gRPC's Python server either asks for a client certificate and requires it, or does not ask at all, so a
    client_ca without require_client_cert checks client certificates only on the HTTP API (which asks for one
    and verifies it when sent)."""

    cert: str = ""
    key: str = ""
    client_ca: str = ""
    require_client_cert: bool = False
    cluster_ca: str = ""
    where: str = "tls"

    def __post_init__(self) -> None:
        _check_path(self.cluster_ca, "tls.cluster.ca", "a CA bundle")
        _check_path(self.cert, f"{self.where}.cert", "a certificate")
        _check_path(self.key, f"{self.where}.key", "a private key")
        _check_path(self.client_ca, f"{self.where}.client_ca", "a CA bundle")
        if not self.cert or not self.key:
            missing = "key" if self.cert else "cert"
            raise TLSError(f"{self.where}.{missing}: a TLS server needs both cert and key")
        if not isinstance(self.require_client_cert, bool):
            raise TLSError(
                f"{self.where}.require_client_cert: must be true or false, got {self.require_client_cert!r}"
            )
        if self.require_client_cert and not self.client_ca:
            raise TLSError(
                f"{self.where}.require_client_cert: needs {self.where}.client_ca (the CA client certificates "
                "must chain to)"
            )

    def _pair(self) -> tuple[bytes, bytes]:
        return read_pem(self.key, f"{self.where}.key"), read_pem(self.cert, f"{self.where}.cert")

    def server_credentials(self) -> grpc.ServerCredentials:
        """Reads the files now; TLSError names the field of one that is missing or not PEM."""
        require = self.require_client_cert
        roots = self._client_roots() if require else None
        return grpc.ssl_server_credentials(
            [self._pair()], root_certificates=roots, require_client_auth=require
        )

    def _client_roots(self) -> bytes:
        roots = read_pem(self.client_ca, f"{self.where}.client_ca")
        if self.cluster_ca:
            roots += b"\n" + read_pem(self.cluster_ca, "tls.cluster.ca")
        return roots

    def ssl_context(self) -> ssl.SSLContext:
        """The same policy for an HTTP server (TLS 1.2+): with client_ca a client certificate is asked for and
        verified (required when require_client_cert)."""
        self._pair()  # clear errors for missing files before ssl's own
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        self._load_own_pair(context)
        if self.client_ca:
            context.load_verify_locations(cadata=self._client_roots().decode("ascii", errors="replace"))
            context.verify_mode = ssl.CERT_REQUIRED if self.require_client_cert else ssl.CERT_OPTIONAL
        return context

    def _load_own_pair(self, context: ssl.SSLContext) -> None:
        try:
            context.load_cert_chain(self.cert, self.key)
        except ssl.SSLError as exc:
            raise TLSError(
                f"{self.where}.key: does not match {self.where}.cert or is unusable ({exc})"
            ) from None

    def member_client_context(self) -> ssl.SSLContext:
        """A client context for dialling another cluster member's TLS server with this server's own
        certificate (the KV handoff: a prefill worker connecting to a decode worker). The peer's certificate
        must chain to client_ca (the cluster CA); its host name is not checked, because members are dialled by
        IP and hold one shared name: the identity checked is membership in the cluster."""
        if not self.client_ca:
            raise TLSError(f"{self.where}.client_ca: a cluster member's client context needs the cluster CA")
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.check_hostname = False
        context.load_verify_locations(cadata=self._client_roots().decode("ascii", errors="replace"))
        self._load_own_pair(context)
        return context

    def check(self) -> None:
        """Read every file once (TLSError naming the first bad one), so a process fails at start-up."""
        self.server_credentials()
        self.ssl_context()


def is_loopback(host: str) -> bool:
    """True for a host that no other machine can reach: localhost, 127.0.0.0/8, ::1."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def plaintext_warning(what: str, host: str) -> str | None:
    """The warning for a plaintext listener on `host` that other machines can reach; None on loopback."""
    if is_loopback(host):
        return None
    return (
        f"{what} listens on {host} without TLS: anyone who can reach it can read and send its traffic "
        "(set the deploy config's tls section; docs/operations.md, Security)"
    )


def tls_credentials(ca: str = "", cert: str = "", key: str = "") -> grpc.ChannelCredentials:
    """Credentials for Client(credentials=...) from PEM files: `ca` the roots that sign the router's certificate
    ("" = the system's), `cert` + `key` a client certificate for a router that asks for one."""
    return TLSFiles(ca=ca, cert=cert, key=key, where="tls_credentials").channel_credentials()
