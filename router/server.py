"""`RouterServer`: one grpc.aio server with Generation, Admin, RouterControl, health and reflection, and (when
config.http_port is set) the OpenAI-compatible HTTP API on the same event loop, over the same request pipeline.

    server = RouterServer(RouterConfig(port=0, http_port=0))
    address = await server.start()             # "127.0.0.1:41234"
    server.http_address                        # "http://127.0.0.1:41235" ("" when the HTTP API is off)
    server.set_workers([WorkerEndpoint(worker_id="d0", role=WORKER_ROLE_DECODE, address="..."), ...])
    ...
    await server.stop(grace=5)

Health ("" and "tandem.v1.Generation") is SERVING exactly while placement could place a request: a READY
prefill/decode pair with matching KV layouts, or a READY colocated worker (router.placement.can_serve).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from router.admission import Admission
from router.auth import AuthGate
from router.auth.control import ControlGuard
from router.config import RouterConfig
from router.dispatch import Dispatcher
from router.errors import RouterError
from router.loop_lag import probe_loop_lag
from router.metrics import RouterMetrics
from router.model import ServedModel
from router.openai_api import OpenAIServer
from router.pipeline import Protocol, RequestPipeline
from router.placement import can_serve, placer_for
from router.pool import Endpoint, WorkerPool, endpoints_from_proto
from router.prometheus import PrometheusRouterMetrics
from router.scaling import Scaler
from router.servicers import AdminService, GenerationService, RouterControlService, add_generation_service
from tandem_api.tandem.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    generate_pb2,
    worker_pb2,
    worker_pb2_grpc,
)
from tandem_client.tls import plaintext_warning, read_pem

log = logging.getLogger(__name__)

GENERATION_SERVICE = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
ADMIN_SERVICE = admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name
ROUTER_CONTROL_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["RouterControl"].full_name
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
_SET_WORKERS_TIMEOUT_S = 10.0
_DRAIN_POLL_S = 0.05


class RouterServer:
    """The router. `model` may be passed preloaded (tests, or a launcher that already has it); otherwise
    start() loads config.model's tokenizer. `metrics` receives the router's counting hooks."""

    def __init__(
        self,
        config: RouterConfig,
        *,
        model: ServedModel | None = None,
        metrics: RouterMetrics | None = None,
        scaler: Scaler | None = None,
    ) -> None:
        self.config = config
        self._scaler = scaler  # the controller beside this router, for Admin.Scale (None: standalone)
        self.metrics = metrics or RouterMetrics()
        self._model = model
        self._pool = WorkerPool(
            poll_interval_s=config.poll_interval_s,
            poll_timeout_s=config.poll_timeout_s,
            dead_after_failed_polls=config.dead_after_failed_polls,
            max_message_bytes=config.max_message_bytes,
            metrics=self.metrics,
            on_change=self._mark_health_dirty,
            tls=config.worker_tls,
        )
        self._admission = Admission(config.max_inflight, config.max_queue)
        self._placer = placer_for(config)  # the dispatcher's, and what health asks (can_serve)
        self._gate = (
            AuthGate(config.api_keys_file, config.api_keys_reload_s) if config.api_keys_file else None
        )
        if isinstance(self.metrics, PrometheusRouterMetrics):  # running/waiting gauges read admission
            self.metrics.track_admission(self._admission)
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="router-tokenize")
        self._health = health_aio.HealthServicer()
        self._health_dirty = asyncio.Event()
        self._health_task: asyncio.Task[None] | None = None
        self._lag_task: asyncio.Task[None] | None = None
        self._serving: bool | None = None
        self._draining = False  # once set, health stays NOT_SERVING whatever the membership says
        self._server: grpc.aio.Server | None = None
        self._http: OpenAIServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._generation: int | None = None
        self._pending: tuple[list[Endpoint], int | None] | None = None
        self._address = ""

    @property
    def address(self) -> str:
        """host:port the server is bound to ("" before start)."""
        return self._address

    @property
    def http_address(self) -> str:
        """http(s)://host:port of the OpenAI-compatible API ("" before start, or when config.http_port is None)."""
        return self._http.address if self._http is not None else ""

    @property
    def serving(self) -> bool:
        """True while health says SERVING: a request could be placed now."""
        return bool(self._serving)

    @property
    def model(self) -> ServedModel | None:
        return self._model

    async def start(self) -> str:
        """Load the tokenizer (unless given), bind, start serving and polling; returns the bound host:port."""
        if self._server is not None:
            return self._address
        if self._gate is not None:
            self._gate.load()  # a bad key file fails start (KeyFileError) before anything loads or binds
        for tls in (self.config.tls, self.config.worker_tls):
            if tls is not None:
                tls.check()  # a missing or bad certificate fails start (TLSError naming it), before binding
        model = self._model
        if model is None:
            model = await asyncio.to_thread(ServedModel.load, self.config.model, self.config.max_model_len)
            self._model = model
        cfg = self.config
        if self._gate is not None:
            await self._gate.start()  # polls the key file for changes
        dispatcher = Dispatcher(self._pool, cfg, self.metrics, self._placer)
        pipeline = RequestPipeline(
            cfg, model, self._admission, dispatcher, self.metrics, self._executor, self._gate
        )
        server = self._grpc_server(pipeline)
        try:
            port = self._bind(server)
        except RuntimeError:  # grpcio raises where older releases returned 0
            port = 0
        if port == 0:
            raise OSError(
                f"router.port: cannot bind the router to {self.config.bind_address} (in use by another process?)"
            )
        await self._set_health(False)  # the health servicer starts out SERVING; no worker is known yet
        self._loop, self._loop_thread = asyncio.get_running_loop(), threading.get_ident()
        if self._pending is not None:  # before serving, so a SetWorkers call cannot be overtaken by it
            self._pool.replace(self._pending[0])
            self._pending = None
        self._pool.start()
        self._health_task = asyncio.create_task(self._sync_health(), name="router-health")
        self._lag_task = asyncio.create_task(probe_loop_lag(self.metrics.loop_lagged), name="router-loop-lag")
        await server.start()
        self._server = server
        host = self.config.host
        self._address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if cfg.http_port is not None:
            http = OpenAIServer(
                pipeline,
                cfg.host,
                cfg.http_port,
                max_body_bytes=cfg.http_max_body_bytes,
                serving=lambda: self.serving,
                ssl_context=cfg.tls.ssl_context() if cfg.tls is not None else None,
            )
            try:
                await http.start()
            except OSError:
                await self.stop(0)
                raise
            self._http = http
        log.info("router serving %s on %s %s", model.id, self._address, self.http_address)
        return self._address

    def _bind(self, server: grpc.aio.Server) -> int:
        """The public port: TLS with config.tls, else plaintext (warned about beyond loopback)."""
        cfg = self.config
        if cfg.tls is not None:
            return server.add_secure_port(cfg.bind_address, cfg.tls.server_credentials())
        apis = "gRPC and HTTP APIs" if cfg.http_port is not None else "gRPC API"
        warning = plaintext_warning(f"the router's {apis}", cfg.host)
        if warning:
            log.warning(warning)
        return server.add_insecure_port(cfg.bind_address)

    def _grpc_server(self, pipeline: RequestPipeline) -> grpc.aio.Server:
        cfg = self.config
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", cfg.max_message_bytes),
                ("grpc.max_send_message_length", cfg.max_message_bytes),
                # gRPC binds with SO_REUSEPORT by default: a second router given the same port would start and
                # silently take half the clients' connections. Off, it fails to bind instead.
                ("grpc.so_reuseport", 0),
            ]
        )
        add_generation_service(GenerationService(pipeline), server)
        check_admin = None
        if self._gate is not None:
            check_admin = partial(pipeline.authenticate, protocol=Protocol.GRPC, admin=True)
        admin = AdminService(self._pool, self._admission, self._scaler, self.metrics.recent, check_admin)
        admin_pb2_grpc.add_AdminServicer_to_server(admin, server)
        control = RouterControlService(self._apply, ControlGuard(check_admin, self._cluster_ca()))
        worker_pb2_grpc.add_RouterControlServicer_to_server(control, server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        services = (GENERATION_SERVICE, ADMIN_SERVICE, ROUTER_CONTROL_SERVICE, HEALTH_SERVICE)
        reflection.enable_server_reflection((*services, reflection.SERVICE_NAME), server)
        return server

    def _cluster_ca(self) -> bytes | None:
        """The cluster CA bundle RouterControl callers' certificates are checked against: known when the public
        port requires client certificates that may also come from the cluster CA (tls.cluster_ca)."""
        tls = self.config.tls
        if tls is None or not tls.require_client_cert or not tls.cluster_ca:
            return None
        return read_pem(tls.cluster_ca, "tls.cluster.ca")

    async def stop(self, grace: float | None = 5.0) -> None:
        """Report NOT_SERVING, let in-flight calls finish for up to `grace` seconds, then cancel the rest
        (which cancels their worker calls), stop polling and close the worker channels. Safe to call twice."""
        if self._server is None:
            return
        server, self._server = self._server, None
        http, self._http = self._http, None
        await self._health.enter_graceful_shutdown()
        if http is not None:
            await asyncio.gather(server.stop(grace), http.stop())
        else:
            await server.stop(grace)
        for task in (self._health_task, self._lag_task):
            if task is not None:
                task.cancel()
        if self._gate is not None:
            await self._gate.stop()
        await self._pool.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def drain(self, timeout_s: float) -> bool:
        """Stop admitting (new requests get UNAVAILABLE "draining"), report NOT_SERVING, and wait up to
        `timeout_s` for every accepted request to end. True when all ended in time; the server keeps running
        (stop() follows and cancels whatever is left)."""
        self._draining = True
        self._admission.close("router is draining (shutting down); retry on another router")
        await self._set_health(False)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._admission.accepted > 0:
            if loop.time() >= deadline:
                log.warning(
                    "drain: %d requests still running after %.1fs", self._admission.accepted, timeout_s
                )
                return False
            await asyncio.sleep(_DRAIN_POLL_S)
        return True

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    # --- membership ----------------------------------------------------------------------------------
    def set_workers(
        self, workers: Sequence[worker_pb2.WorkerEndpoint], generation: int | None = None
    ) -> bool:
        """Replace the membership (the in-process twin of RouterControl.SetWorkers). Callable from any thread,
        before or after start(). Returns False when `generation` is older than the one applied last (ignored);
        None always applies. A bad entry raises ValueError naming it ("workers[1].address: ...")."""
        try:
            endpoints = endpoints_from_proto(workers)
        except RouterError as exc:
            raise ValueError(exc.details) from None
        if self._loop is None:  # not started: start() applies it
            if _older(generation, self._generation):
                return False
            self._generation = generation if generation is not None else self._generation
            self._pending = (endpoints, generation)
            return True
        if threading.get_ident() == self._loop_thread:
            return self._apply(endpoints, generation)
        future = asyncio.run_coroutine_threadsafe(self._apply_async(endpoints, generation), self._loop)
        return future.result(_SET_WORKERS_TIMEOUT_S)

    async def _apply_async(self, endpoints: Sequence[Endpoint], generation: int | None) -> bool:
        return self._apply(endpoints, generation)

    def _apply(self, endpoints: Sequence[Endpoint], generation: int | None) -> bool:
        """On the event loop only: the pool's channels belong to it."""
        if _older(generation, self._generation):
            log.info("ignoring worker set generation %s (have %s)", generation, self._generation)
            return False
        if generation is not None:
            self._generation = generation
        self._pool.replace(endpoints)
        return True

    def worker_status(self) -> list[admin_pb2.WorkerInfo]:
        """Every worker as last polled (what Admin.Status lists); safe from any thread."""
        return self._pool.status()

    # --- health --------------------------------------------------------------------------------------
    def _mark_health_dirty(self) -> None:
        self._health_dirty.set()

    async def _sync_health(self) -> None:
        """One task applies health changes, in order (two concurrent set() calls could land out of order)."""
        while True:
            await self._health_dirty.wait()
            self._health_dirty.clear()
            await self._set_health(can_serve(self._pool.loads(), self._placer))

    async def _set_health(self, serving: bool) -> None:
        serving = serving and not self._draining
        if serving == self._serving:
            return
        self._serving = serving
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in ("", GENERATION_SERVICE):
            await self._health.set(service, status)
        log.info("health: %s", "SERVING" if serving else "NOT_SERVING")


def _older(generation: int | None, current: int | None) -> bool:
    return generation is not None and current is not None and generation < current
