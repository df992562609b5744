"""The router's gRPC services: tandem.v1.Generation, tandem.v1.Admin and tandem.v1.RouterControl.

Generate sets the request's deadline (the client's, else request_timeout_s) and hands it to the shared request
pipeline (router.pipeline), which the OpenAI HTTP API uses too; a RouterError becomes the call's status here,
with its retry delay as trailing metadata `retry-after-ms` (RESOURCE_EXHAUSTED: router full, a key's quota).

With API keys on, Generate and ListModels need `authorization: Bearer <key>` metadata, and Admin.Scale an admin
key. RouterControl (the controller's membership pushes) needs an admin key or a cluster certificate over mutual
TLS (router.auth.control.ControlGuard). Admin.Status (read-only counters, which the controller's autoscaler
polls), health and reflection stay open.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from router.admission import Admission
from router.auth.control import ControlGuard, peer_certificate
from router.errors import RouterError
from router.pipeline import Protocol, RequestPipeline
from router.pool import Endpoint, WorkerPool, endpoints_from_proto
from router.recent_latency import RecentLatency
from router.scaling import Scaler, targets_from_proto
from tandem_api.tandem.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    generate_pb2,
    generate_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UndecodableRequest:
    """Generate's request bytes that do not parse as a GenerateRequest (for example a string field holding
    invalid UTF-8). gRPC's own deserializer would answer INTERNAL; this lets Generate answer INVALID_ARGUMENT."""

    problem: str


def decode_generate_request(data: bytes) -> generate_pb2.GenerateRequest | UndecodableRequest:
    try:
        return generate_pb2.GenerateRequest.FromString(data)
    except DecodeError as exc:
        return UndecodableRequest(str(exc))


def add_generation_service(service: GenerationService, server: Any) -> None:
    """generate_pb2_grpc.add_GenerationServicer_to_server, with Generate's lenient deserializer."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            service.Generate,
            request_deserializer=decode_generate_request,
            response_serializer=generate_pb2.GenerateResponse.SerializeToString,
        ),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            service.ListModels,
            request_deserializer=generate_pb2.ListModelsRequest.FromString,
            response_serializer=generate_pb2.ListModelsResponse.SerializeToString,
        ),
    }
    name = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)


class GenerationService(generate_pb2_grpc.GenerationServicer):
    """tandem.v1.Generation over the shared request pipeline (router.pipeline)."""

    def __init__(self, pipeline: RequestPipeline) -> None:
        self._pipeline = pipeline

    async def Generate(
        self, request: generate_pb2.GenerateRequest | UndecodableRequest, context: Any
    ) -> None:
        if isinstance(request, UndecodableRequest):
            try:  # without a valid key, the caller learns nothing about its bytes
                self._pipeline.authenticate(authorization(context), Protocol.GRPC)
            except RouterError as exc:
                await abort(context, exc)
                return
            self._pipeline.reject(grpc.StatusCode.INVALID_ARGUMENT, Protocol.GRPC)
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request: not a valid tandem.v1.GenerateRequest ({request.problem}); "
                "string fields (text, chat content, stop, request_id, model) must be UTF-8",
            )
            return
        remaining = context.time_remaining()
        timeout = remaining if remaining is not None else self._pipeline.config.request_timeout_s
        deadline = asyncio.get_running_loop().time() + timeout
        try:
            admitted = self._pipeline.admit(request, Protocol.GRPC, authorization(context))
        except RouterError as exc:
            await abort(context, exc)
            return
        _cancel_on_client_cancel(context)
        try:
            await self._pipeline.run(admitted, deadline, context.write)
        except RouterError as exc:
            await abort(context, exc)

    async def ListModels(self, request: generate_pb2.ListModelsRequest, context: Any) -> Any:
        try:
            self._pipeline.authenticate(authorization(context), Protocol.GRPC)
        except RouterError as exc:
            await abort(context, exc)
        model = self._pipeline.model
        info = generate_pb2.ModelInfo(
            id=model.id, max_model_len=model.max_model_len, vocab_size=model.vocab_size
        )
        return generate_pb2.ListModelsResponse(models=[info])


class AdminService(admin_pb2_grpc.AdminServicer):
    """Status of the router and its workers (and, when asked, its recent latency window: the SLO autoscaler's
    input); Scale when a controller runs beside the router (`scaler`). `check_admin` (API keys on) raises
    RouterError unless the call's `authorization` names an admin key; Scale asks it."""

    def __init__(
        self,
        pool: WorkerPool,
        admission: Admission,
        scaler: Scaler | None = None,
        recent: RecentLatency | None = None,
        check_admin: Callable[[str | None], object] | None = None,
    ) -> None:
        self._pool = pool
        self._admission = admission
        self._scaler = scaler
        self._recent = recent
        self._check_admin = check_admin

    async def Status(self, request: admin_pb2.StatusRequest, context: Any) -> Any:
        router = admin_pb2.RouterInfo(
            queued_requests=self._admission.queued,
            in_flight_requests=self._admission.in_flight,
            active_pairs=self._pool.pairs.to_proto(),
        )
        window_s = request.latency_window_seconds
        if self._recent is not None and window_s > 0:  # NaN and negatives ask for nothing
            router.recent_latency.CopyFrom(self._recent.counts(window_s).to_proto())
        pools = [] if self._scaler is None else await asyncio.to_thread(self._scaler.pool_sizes)
        autoscaler = "" if self._scaler is None else self._scaler.autoscaler_status()
        return admin_pb2.ClusterStatus(
            workers=self._pool.status(),
            router=router,
            pools=[p.to_proto() for p in pools],
            autoscaler=autoscaler,
        )

    async def Scale(self, request: admin_pb2.ScaleRequest, context: Any) -> Any:
        if self._check_admin is not None:
            try:
                self._check_admin(authorization(context))
            except RouterError as exc:
                await abort(context, exc)
        if self._scaler is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this router runs without a controller beside it (a standalone router): send Scale to the "
                "router of `tandem serve` or `deploy.job`, which runs the controller",
            )
        try:
            targets = targets_from_proto(request.targets)
        except RouterError as exc:
            await context.abort(exc.code, exc.details)
        scaler = self._scaler
        assert scaler is not None
        try:
            pools = await asyncio.to_thread(scaler.scale, targets)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        log.info("scale: %s", ", ".join(f"{p.role.value} -> {p.target}" for p in pools))
        return admin_pb2.ScaleReply(pools=[p.to_proto() for p in pools])


class RouterControlService(worker_pb2_grpc.RouterControlServicer):
    """SetWorkers from the controller: the whole membership each time; an older generation is ignored. `guard`
    refuses callers that may not change it (see ControlGuard) before the message is read."""

    def __init__(
        self, apply: Callable[[Sequence[Endpoint], int | None], bool], guard: ControlGuard | None = None
    ) -> None:
        self._apply = apply
        self._guard = guard

    async def SetWorkers(self, request: worker_pb2.WorkerSet, context: Any) -> Any:
        if self._guard is not None:
            try:
                self._guard.check(authorization(context), peer_certificate(context), context.peer())
            except RouterError as exc:
                await abort(context, exc)
        try:
            endpoints = endpoints_from_proto(request.workers)
        except RouterError as exc:
            await context.abort(exc.code, exc.details)
        self._apply(endpoints, request.generation)
        return worker_pb2.SetWorkersReply()


def authorization(context: Any) -> str | None:
    """The call's `authorization` metadata (gRPC keys are lower case), or None."""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return value if isinstance(value, str) else None
    return None


async def abort(context: Any, exc: RouterError) -> None:
    """End the call with the error's status, details and retry delay."""
    await context.abort(exc.code, exc.details, trailing_metadata=exc.trailing_metadata())


def _cancel_on_client_cancel(context: Any) -> None:
    """Cancel this handler's task the moment the client cancels: grpc.aio would only notice at a later write,
    and until then the workers keep generating (and holding KV) for nobody."""
    task = asyncio.current_task()

    def on_done(ctx: Any) -> None:
        if ctx.cancelled() and task is not None and not task.done():
            task.cancel()

    context.add_done_callback(on_done)
