"""`ControlGuard`: who may replace the router's worker set (RouterControl.SetWorkers) on its public port.

    guard = ControlGuard(check_admin, cluster_ca_pem)     # either may be None
    guard.check(authorization, peer_cert_pem)             # returns, or raises RouterError

RouterControl shares the public port with the API, so whoever reaches that port could otherwise point the router
at workers of their own (and read every prompt). A call is let in when

- the peer's TLS client certificate was issued by a certificate of the cluster CA bundle (`cluster_ca_pem`: set
  when the router requires client certificates and knows tls.cluster's CA; the handshake already checked the
  chain and the dates against the client and cluster CAs, this tells a cluster member's certificate from an API
  client's), or
- API keys are on (`check_admin`) and the call carries an admin key (as Admin.Scale asks).

With neither (no keys, no cluster CA to check against) the router cannot tell the controller from anyone and the
call is let in, as before: such a router belongs on a private network (docs/operations.md, section 8). A refusal
is UNAUTHENTICATED (no key, a bad or non-admin key: what check_admin raises) or PERMISSION_DENIED (no keys: a
cluster certificate is the only way in), and is logged with the peer's address, never with the key.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import grpc

from router.errors import RouterError

log = logging.getLogger(__name__)

MUTUAL_TLS_HINT = "or call over mutual TLS with a certificate from the cluster CA (tls.cluster)"


class ControlGuard:
    def __init__(
        self, check_admin: Callable[[str | None], object] | None, cluster_ca_pem: bytes | None
    ) -> None:
        self._check_admin = check_admin
        self._cluster_cas = _load_cas(cluster_ca_pem) if cluster_ca_pem else ()

    @property
    def open(self) -> bool:
        """True when every caller is let in (no keys, no cluster CA)."""
        return self._check_admin is None and not self._cluster_cas

    def check(self, authorization: str | None, peer_cert_pem: bytes | None, peer: str = "") -> None:
        """Return when the call may change the worker set; raise RouterError (see the module docstring)."""
        if self.open or (peer_cert_pem and self._cluster_certificate(peer_cert_pem)):
            return
        if self._check_admin is None:
            error = RouterError(
                grpc.StatusCode.PERMISSION_DENIED,
                "RouterControl changes the worker set: call it over mutual TLS with a certificate from the "
                "cluster CA (tls.cluster)",
            )
        else:
            try:
                self._check_admin(authorization)
                return
            except RouterError as exc:
                error = RouterError(
                    exc.code, f"RouterControl needs an admin key ({exc.details}), {MUTUAL_TLS_HINT}"
                )
        log.warning("RouterControl: refused a worker set from %s (%s)", peer or "?", error.code.name)
        raise error

    def _cluster_certificate(self, pem: bytes) -> bool:
        from cryptography import x509
        from cryptography.exceptions import InvalidSignature

        try:
            leaf = x509.load_pem_x509_certificate(pem)
        except ValueError:
            return False
        for ca in self._cluster_cas:
            try:
                leaf.verify_directly_issued_by(ca)
            except (
                ValueError,
                TypeError,
                InvalidSignature,
            ):  # another issuer, or its signature does not verify
                continue
            return True
        return False


def _load_cas(pem: bytes) -> tuple[Any, ...]:
    from cryptography import x509  # only routers that check cluster certificates need it

    return tuple(x509.load_pem_x509_certificates(pem))


def peer_certificate(context: Any) -> bytes | None:
    """The PEM of the TLS client certificate a gRPC call came with (None: plaintext, or none asked for)."""
    values = (context.auth_context() or {}).get("x509_pem_cert") or ()
    return values[0] if values else None
