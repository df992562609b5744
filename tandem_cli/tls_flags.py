"""The TLS flags of the commands that call a router (generate, status, scale): --tls-ca, --tls-cert, --tls-key,
--tls-server-name. Unset, the SDK reads $TANDEM_TLS_CA / _CERT / _KEY / _SERVER_NAME; none of them: plaintext."""

from __future__ import annotations

import argparse

from tandem_client.tls import TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV, TLS_SERVER_NAME_ENV, TLSFiles


def add_tls_flags(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("TLS (a router with the deploy config's tls.router)")
    group.add_argument(
        "--tls-ca",
        metavar="FILE",
        help=f"PEM roots that sign the router's certificate; turns TLS on (default: ${TLS_CA_ENV})",
    )
    group.add_argument(
        "--tls-cert",
        metavar="FILE",
        help=f"client certificate (PEM), for a router that asks for one (${TLS_CERT_ENV})",
    )
    group.add_argument(
        "--tls-key", metavar="FILE", help=f"the client certificate's private key (${TLS_KEY_ENV})"
    )
    group.add_argument(
        "--tls-server-name",
        metavar="NAME",
        help=f"the name the router's certificate carries, when --server dials another (${TLS_SERVER_NAME_ENV})",
    )


def tls_from_args(args: argparse.Namespace) -> TLSFiles | None:
    """TLSFiles from the flags; None when no flag is given (the SDK then looks at the environment)."""
    values = {
        "ca": args.tls_ca or "",
        "cert": args.tls_cert or "",
        "key": args.tls_key or "",
        "server_name": args.tls_server_name or "",
    }
    return TLSFiles(**values, where="--tls") if any(values.values()) else None
