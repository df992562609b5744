"""A standalone router (Kubernetes Deployment): `python -m deploy.router --config /etc/tandem/tandem.yaml`.

It reads the same deployment config as the controller, serves the public API on router.host:router.port (gRPC)
and router.host:router.http_port (the OpenAI-compatible HTTP API, unless 0), and learns the workers from the
controller's RouterControl.SetWorkers pushes. SIGTERM stops it gracefully. `tandem serve` with router.processes
> 1 runs its extra routers this way too, each with `--process-index i` (its ports: the configured ones + i).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence
from dataclasses import replace

from deploy.config import load_config
from deploy.router_inputs import router_config
from model_runtime.config import ConfigError
from model_runtime.heap import freeze_startup_objects, thaw


async def run(config_path: str | None, process_index: int = 0) -> int:
    from router.auth import KeyFileError
    from router.server import RouterServer
    from tandem_client.tls import TLSError

    try:
        config = load_config(config_path)
        if process_index:  # one of `tandem serve`'s extra router processes: its own ports
            config = replace(config, router=config.router.process_ports(process_index))
    except (ConfigError, ValueError) as exc:
        print(f"tandem router: {exc}", file=sys.stderr)
        return 2
    from deploy.metrics import MetricsHTTPServer
    from router.prometheus import PrometheusRouterMetrics

    metrics = PrometheusRouterMetrics(config.model) if config.router.metrics_port else None
    router = RouterServer(router_config(config), metrics=metrics)
    try:
        address = await router.start()
    except KeyFileError as exc:  # router.auth.api_keys_file: missing or invalid
        print(f"tandem router: router.auth.api_keys_file: {exc}", file=sys.stderr)
        return 2
    except TLSError as exc:  # a certificate file went missing since the config was loaded
        print(f"tandem router: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # router.port (or router.http_port) held by another process
        await router.stop(0)
        print(f"tandem router: {exc}", file=sys.stderr)
        return 1
    try:
        http = (
            MetricsHTTPServer(config.router.host, config.router.metrics_port, metrics.registry)
            if metrics
            else None
        )
    except OSError as exc:  # router.metrics_port held by another process
        await router.stop(0)
        print(f"tandem router: router.metrics_port: {exc}", file=sys.stderr)
        return 1
    if http is not None:  # before the serving line: `tandem serve` reads both once it sees that one
        print(f"Router metrics on {http.address}", flush=True)
    print(f"Tandem router serving {config.model} on {address}", flush=True)
    if router.http_address:
        print(f"OpenAI-compatible API on {router.http_address}/v1", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    freeze_startup_objects()  # full collections then skip what start-up built (model_runtime.heap)
    await stop.wait()
    thaw()
    await router.stop(config.controller.drain_timeout_s)
    if http is not None:
        http.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.router", description=__doc__)
    parser.add_argument("--config", help="deployment YAML (the same file the controller uses)")
    parser.add_argument("--log-level", default="WARNING")
    parser.add_argument(
        "--process-index",
        type=int,
        default=0,
        help="this router's index among router.processes (tandem serve starts 1, 2, ... with it): it serves on "
        "the configured ports plus the index",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    return asyncio.run(run(args.config, args.process_index))


if __name__ == "__main__":
    sys.exit(main())
