"""`python -m router`: run the router alone (a Kubernetes Deployment; workers arrive through SetWorkers)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence
from dataclasses import fields

from router.config import RouterConfig, RouterConfigError
from router.server import RouterServer

_FLAGS = {f.name: f for f in fields(RouterConfig)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m router", description="Tandem's gRPC router")
    defaults = RouterConfig()
    for name in _FLAGS:
        default = getattr(defaults, name)
        kind = type(default) if default is not None else int
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=default, metavar=name.upper())
    parser.add_argument("--log-level", default="INFO")
    return parser


async def serve(config: RouterConfig) -> None:
    server = RouterServer(config)
    address = await server.start()
    print(f"tandem router listening on {address}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=10.0)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = RouterConfig(**{name: getattr(args, name) for name in _FLAGS})
    except RouterConfigError as exc:
        print(f"router: error: {exc}", file=sys.stderr)
        return 2
    asyncio.run(serve(config))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
