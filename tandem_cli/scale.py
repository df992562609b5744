"""`tandem scale`: set pool sizes while the cluster serves (Admin.Scale on the router of `tandem serve` or
`deploy.job`, whose controller adds workers, which join once ready, and drains the ones it removes).

    tandem scale --prefill 3 --decode 1          # prints every pool: target, ready, starting, draining
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

import grpc

from tandem_api.tandem.v1 import admin_pb2, admin_pb2_grpc
from tandem_cli.inputs import InputError, positive_int
from tandem_cli.output import pools_table
from tandem_cli.tls_flags import add_tls_flags, tls_from_args
from tandem_client import wire
from tandem_client.channel import ADDRESS_ENV, API_KEY_ENV, DEFAULT_ADDRESS, auth_metadata, resolve_address
from tandem_client.errors import error_from_rpc
from tandem_client.tls import TLSFiles

ROLES = {
    "prefill": admin_pb2.WORKER_ROLE_PREFILL,
    "decode": admin_pb2.WORKER_ROLE_DECODE,
    "colocated": admin_pb2.WORKER_ROLE_COLOCATED,
}


def add_scale_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("scale", help="set pool sizes while serving (new workers join once ready)")
    p.add_argument(
        "--server", metavar="HOST:PORT", help=f"router address (default: ${ADDRESS_ENV} or {DEFAULT_ADDRESS})"
    )
    for role in ROLES:
        p.add_argument(f"--{role}", type=positive_int, metavar="N", help=f"workers in the {role} pool")
    p.add_argument("--json", action="store_true", help="print the pools as JSON")
    p.add_argument("--timeout", type=float, default=30.0, metavar="S")
    add_api_key_flag(p, "an admin key (admin: true in the router's key file)")
    add_tls_flags(p)
    p.set_defaults(handler=cmd_scale)


def add_api_key_flag(p: argparse.ArgumentParser, which: str = "the router's API key") -> None:
    p.add_argument(
        "--api-key",
        metavar="KEY",
        help=f"{which}, when the router asks for keys (default: ${API_KEY_ENV}; the variable keeps it out of "
        "the process list)",
    )


def cmd_scale(args: argparse.Namespace) -> int:
    targets = [
        admin_pb2.PoolTarget(role=wire_role, replicas=getattr(args, role))
        for role, wire_role in ROLES.items()
        if getattr(args, role) is not None
    ]
    if not targets:
        raise InputError("give at least one of --prefill, --decode, --colocated")
    with router_channel(resolve_address(args.server), tls_from_args(args) or TLSFiles.from_env()) as channel:
        try:
            reply = admin_pb2_grpc.AdminStub(channel).Scale(
                admin_pb2.ScaleRequest(targets=targets),
                timeout=args.timeout,
                metadata=auth_metadata(args.api_key),
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from exc
    pools = wire.pools_from_proto(reply.pools)
    print(json.dumps([asdict(p) for p in pools]) if args.json else pools_table(pools))
    return 0


def router_channel(address: str, tls: TLSFiles | None) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, tls.channel_credentials(), options=tls.channel_options())
