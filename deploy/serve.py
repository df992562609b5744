"""`tandem serve [--config FILE]`: a whole Tandem cluster from one command.

Starts (or joins) Ray, the router on router.host:router.port, the worker pools through the controller, prints
the address once the service is healthy, and on Ctrl-C / SIGTERM drains and stops everything it started,
Ray included. `python -m deploy.job` is the same on an existing cluster (`ray job submit`).
The router serves gRPC on router.host:router.port and the OpenAI-compatible HTTP API on router.host:
router.http_port (0: off). Prometheus: the router's /metrics on router.host:router.metrics_port, each worker's on its own port, all of
them listed in router.metrics_file_sd when set (deploy/metrics.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from deploy.config import DeployConfig, load_config
from deploy.controller import Controller
from deploy.slots import Member
from model_runtime.config import ConfigError
from model_runtime.heap import freeze_startup_objects, thaw

if TYPE_CHECKING:
    from deploy.autoscaler.loop import Autoscaler
    from deploy.extra_routers import ExtraRouters
    from deploy.metrics import ServeMetrics
    from deploy.publish import RouterPublisher

log = logging.getLogger("tandem.serve")
_SERVING_WAIT_S = 30.0
_EXTRA_ROUTERS_WAIT_S = 60.0  # for router.processes - 1 standalone routers to start serving


def build_parser(prog: str = "tandem serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Run a Tandem cluster: router + worker pools on Ray."
    )
    parser.add_argument(
        "--config", help="deployment YAML (default: the embedded model, 1 prefill + 1 decode)"
    )
    parser.add_argument("--ray-address", default=None, help="join this Ray cluster instead of starting one")
    parser.add_argument("--log-level", default="WARNING", help="Python log level (default WARNING)")
    return parser


def main(argv: Sequence[str] | None = None, *, join_cluster: bool = False) -> int:
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"tandem serve: {exc}", file=sys.stderr)
        return 2
    config_path = args.config
    address = args.ray_address or ("auto" if join_cluster else None)
    if address is not None:
        from dataclasses import replace

        config = replace(config, ray=replace(config.ray, address=address))
    return asyncio.run(serve(config, config_path))


def _say(message: str) -> None:
    print(f"[tandem] {message}", file=sys.stderr, flush=True)


async def serve(config: DeployConfig, config_path: str | None = None) -> int:
    """Run until SIGINT/SIGTERM. With controller.routers set (Kubernetes), membership goes to those standalone
    routers over gRPC; otherwise a router runs in this process, and router.processes - 1 more beside it
    (standalone routers started from `config_path`, the file `config` was loaded from)."""
    from deploy.metrics import ServeMetrics
    from deploy.publish import AdminKeyError, RouterPublisher, admin_key_reader
    from deploy.router_inputs import endpoints, router_config

    loop = asyncio.get_running_loop()
    router = None
    publisher: RouterPublisher | None = None
    extra: ExtraRouters | None = None
    metrics = ServeMetrics(config, in_process_router=not config.controller.routers)
    try:  # the router's /metrics and the Prometheus target list (router.metrics_port, router.metrics_file_sd)
        metrics.start()
    except OSError as exc:
        metrics.close()
        print(f"tandem serve: {exc}", file=sys.stderr)
        return 1
    if config.router.processes > 1 and not config.controller.routers:
        try:
            extra, publisher = await _start_extra_routers(config, config_path)
        except StartFailed as exc:
            metrics.close()
            print(f"tandem serve: {exc}", file=sys.stderr)
            return exc.code
        metrics.add_router_targets(extra.metrics_addresses)
    if config.controller.routers:
        try:
            admin_key = admin_key_reader(config.controller.admin_key_file)
        except AdminKeyError as exc:
            metrics.close()
            print(f"tandem serve: {exc}", file=sys.stderr)
            return 2
        publisher = RouterPublisher(
            config.controller.routers,
            config.controller.health_interval_s,
            tls=config.tls.router_client(),
            api_key=admin_key,
        )
        controller = Controller(config, metrics.wrap(publisher.publish))
        address = ", ".join(config.controller.routers)
    else:
        from router.auth import KeyFileError
        from router.server import RouterServer
        from tandem_client.tls import TLSError

        def publish(members: list[Member], generation: int) -> object:
            if publisher is not None:  # router.processes > 1: the extra routers get the same set
                publisher.publish(members, generation)
            return in_process.set_workers(endpoints(members), generation)

        # The controller is the router's Scaler (Admin.Scale, `tandem scale`); it publishes to the router.
        controller = Controller(config, metrics.wrap(publish))
        router = in_process = RouterServer(
            router_config(config), metrics=metrics.router_metrics, scaler=controller
        )
        try:
            address = await router.start()
        except KeyFileError as exc:  # router.auth.api_keys_file: missing or invalid
            _stop_extra(extra, publisher)
            metrics.close()
            print(f"tandem serve: router.auth.api_keys_file: {exc}", file=sys.stderr)
            return 2
        except TLSError as exc:  # a certificate file went missing since the config was loaded
            _stop_extra(extra, publisher)
            metrics.close()
            print(f"tandem serve: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:  # router.port (or router.http_port) held by another process
            await router.stop(0)
            _stop_extra(extra, publisher)
            metrics.close()
            print(f"tandem serve: {exc}", file=sys.stderr)
            return 1
        if extra is not None:
            address = ", ".join([address, *extra.addresses])
    try:
        controller.connect()
    except Exception as exc:
        await _shutdown(router, publisher, controller, config, extra)
        metrics.close()
        print(f"tandem serve: cannot start Ray: {exc}", file=sys.stderr)
        return 1
    _say(f"router(s) {address}; starting workers for {config.model} ({config.mode})")
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    started = loop.run_in_executor(None, controller.start, _say)
    autoscaler = None
    code = 0
    try:
        stopped: asyncio.Future = asyncio.ensure_future(stop.wait())
        pending: list[asyncio.Future] = [started, stopped]
        done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        if started in done:
            started.result()
            if router is not None:  # the workers are up; the router knows once its first polls answer
                await _until_serving(router, _SERVING_WAIT_S)
            autoscaler = _start_autoscaler(config, controller, router, metrics, extra)
            freeze_startup_objects()  # the router's relay loop, not a full collection's walk over start-up's
            print(f"Tandem is serving {config.model} on {address} (Ctrl-C to stop)", flush=True)
            if router is not None and router.http_address:
                print(f"OpenAI-compatible API on {router.http_address}/v1", flush=True)
            await stop.wait()
            thaw()
        _say("stopping: draining in-flight requests")
    except Exception as exc:
        log.exception("start-up failed")
        print(f"tandem serve: start-up failed: {exc}", file=sys.stderr)
        code = 1
    finally:
        if autoscaler is not None:
            autoscaler.stop()
        await _shutdown(router, publisher, controller, config, extra)
        metrics.close()
    return code


class StartFailed(Exception):
    """A start-up step failed: the message for stderr and the exit status (2: the configuration)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


async def _start_extra_routers(
    config: DeployConfig, config_path: str | None
) -> tuple[ExtraRouters, RouterPublisher]:
    """router.processes - 1 standalone routers, serving, and the publisher that pushes the worker set to them;
    StartFailed when they cannot start (1) or could never take the worker set (2: no admin key where the
    routers ask for API keys)."""
    from deploy.extra_routers import ExtraRouters
    from deploy.publish import AdminKeyError, RouterPublisher, admin_key_reader

    try:
        admin_key = admin_key_reader(config.controller.admin_key_file)
    except AdminKeyError as exc:
        raise StartFailed(str(exc), 2) from None
    if config.router.auth.api_keys_file and admin_key() is None and config.tls.router_client() is None:
        raise StartFailed(
            "router.processes: the extra routers ask for API keys (router.auth.api_keys_file) and take the "
            "worker set only from an admin: set controller.admin_key_file (or TANDEM_API_KEY) to an admin key",
            2,
        )
    extra = ExtraRouters(config_path, config.router.processes - 1)
    _say(f"starting {config.router.processes - 1} more router process(es)")
    try:
        await asyncio.get_running_loop().run_in_executor(None, extra.start, _EXTRA_ROUTERS_WAIT_S)
    except RuntimeError as exc:
        extra.stop()
        raise StartFailed(str(exc), 1) from None
    publisher = RouterPublisher(
        extra.addresses,
        config.controller.health_interval_s,
        tls=config.tls.router_client(),
        api_key=admin_key,
    )
    # One that exits is started again (on its ports; with router.port 0 on new ones, which the pushes follow).
    extra.supervise(config.controller.restart_limit, _say, moved=publisher.set_targets)
    return extra, publisher


def _stop_extra(extra: ExtraRouters | None, publisher: RouterPublisher | None) -> None:
    if publisher is not None:
        publisher.close()
    if extra is not None:
        extra.stop()


def _start_autoscaler(
    config: DeployConfig,
    controller: Controller,
    router,
    metrics: ServeMetrics,
    extra: ExtraRouters | None = None,
) -> Autoscaler | None:
    """The SLO autoscaler (autoscaler.enabled): it reads the in-process router's latency window and workers, or
    asks the standalone routers (controller.routers, or with router.processes > 1 every router process) for
    theirs, and asks this controller for pool sizes. Its decisions are counted on router.metrics_port's /metrics
    served from this process."""
    if not config.autoscaler.enabled:
        return None
    from deploy.autoscaler.loop import Autoscaler, LatencySource, WorkerSource
    from deploy.autoscaler.routers import RouterLatency

    latency: LatencySource
    workers: WorkerSource
    if router is not None and extra is None:
        latency, workers = router.metrics.recent.stats, router.worker_status
    else:
        if router is None:
            targets: tuple[str, ...] = tuple(config.controller.routers)
        else:
            assert extra is not None
            targets = (router.address, *extra.addresses)
        routers = RouterLatency(targets, tls=config.tls.router_client())
        latency, workers = routers, routers.workers
    autoscaler = Autoscaler(config.autoscaler, controller, latency, workers, metrics.registry)
    controller.autoscaler_status = lambda: autoscaler.last_decision
    autoscaler.start()
    return autoscaler


async def _until_serving(router, timeout_s: float) -> None:
    """Wait until the router's health is SERVING, so "Tandem is serving" is never printed while a request
    would still get UNAVAILABLE; past timeout_s say so and go on (health tells the truth either way)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not router.serving:
        if loop.time() >= deadline:
            _say(f"workers started, but the router is not SERVING after {timeout_s:g}s; see tandem status")
            return
        await asyncio.sleep(0.05)


async def _shutdown(
    router, publisher, controller: Controller, config: DeployConfig, extra: ExtraRouters | None = None
) -> None:
    """Stop admission, drain and stop the workers, stop the routers, and stop Ray if we started it."""
    import ray

    loop = asyncio.get_running_loop()
    if router is not None:
        drain = getattr(router, "drain", None)
        if drain is not None:
            await drain(config.controller.drain_timeout_s)
    await loop.run_in_executor(None, controller.stop, True)
    if publisher is not None:
        publisher.close()
    if extra is not None:  # SIGTERM: each drains what it still relays (the workers are gone by now)
        await loop.run_in_executor(None, extra.stop)
    if router is not None:
        await router.stop(2.0)
    if config.ray.address is None and ray.is_initialized():
        ray.shutdown()
    _say("stopped")
