"""The router's gRPC services: tandem.v1.Generation, tandem.v1.Admin and tandem.v1.RouterControl.

Generate is where a request's deadline, admission, validation and dispatch meet; a RouterError anywhere
becomes the call's status here and nowhere else.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from router.admission import Admission, Ticket
from router.config import RouterConfig
from router.dispatch import Dispatcher
from router.errors import RouterError
from router.metrics import RequestRecord, RouterMetrics
from router.model import ServedModel
from router.pool import Endpoint, WorkerPool, endpoints_from_proto
from router.responses import RequestClock, ResponseBuilder
from router.validation import ParsedRequest, ValidatedRequest, check_lengths, encode_prompt, parse_request
from tandem_api.tandem.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    generate_pb2,
    generate_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

log = logging.getLogger(__name__)

# Prompts longer than this (characters) are tokenized in the executor so one long prompt does not stall every
# other stream on the event loop; shorter ones cost less than the thread hop.
INLINE_TOKENIZE_CHARS = 2048
# gRPC's own deadline timer and this loop's clock fire a hair apart: a call cancelled this close to its
# deadline was cancelled by the deadline.
_DEADLINE_SLACK_S = 0.1


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
    def __init__(
        self,
        config: RouterConfig,
        model: ServedModel,
        admission: Admission,
        dispatcher: Dispatcher,
        metrics: RouterMetrics,
        executor: Executor,
    ) -> None:
        self._config = config
        self._model = model
        self._admission = admission
        self._dispatcher = dispatcher
        self._metrics = metrics
        self._executor = executor

    async def Generate(
        self, request: generate_pb2.GenerateRequest | UndecodableRequest, context: Any
    ) -> None:
        if isinstance(request, UndecodableRequest):
            self._metrics.request_rejected(grpc.StatusCode.INVALID_ARGUMENT.name.lower())
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request: not a valid tandem.v1.GenerateRequest ({request.problem}); "
                "string fields (text, chat content, stop, request_id, model) must be UTF-8",
            )
            return
        clock = RequestClock(arrival=time.monotonic())
        remaining = context.time_remaining()
        timeout = remaining if remaining is not None else self._config.request_timeout_s
        deadline = asyncio.get_running_loop().time() + timeout
        try:
            parsed = parse_request(request, self._model, self._config)
            ticket = self._admission.enter()
        except RouterError as exc:
            self._metrics.request_rejected(exc.code.name.lower())
            await context.abort(exc.code, exc.details)
            return
        _cancel_on_client_cancel(context)
        with ticket:
            await self._serve(parsed, ticket, clock, deadline, context)

    async def _serve(
        self, parsed: ParsedRequest, ticket: Ticket, clock: RequestClock, deadline: float, context: Any
    ) -> None:
        """Tokenize, wait for a slot, dispatch: all under the deadline. Every way out records one outcome."""
        outcome = grpc.StatusCode.CANCELLED.name.lower()  # unless something below says otherwise
        out: ResponseBuilder | None = None
        try:
            async with asyncio.timeout_at(deadline):
                out = ResponseBuilder(await self._validate(parsed), self._model, clock)
                await ticket.start()
                await self._dispatcher.run(out.request, out, deadline, context.write)
            outcome = _finish_name(out)
        except TimeoutError:
            outcome = grpc.StatusCode.DEADLINE_EXCEEDED.name.lower()
            sent = f"after {len(out.token_ids)} tokens" if out and out.token_ids else "before the first token"
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"the request's deadline passed {sent}")
        except RouterError as exc:
            outcome = exc.code.name.lower()
            await context.abort(exc.code, exc.details)
        except asyncio.CancelledError:  # gRPC cancelled the call: the client went away or its deadline passed
            outcome = _cancelled_outcome(out, deadline)
            raise
        except Exception as exc:  # a router bug: say so instead of gRPC's bare UNKNOWN
            log.exception("request %s failed inside the router", parsed.request_id)
            outcome = grpc.StatusCode.INTERNAL.name.lower()
            await context.abort(grpc.StatusCode.INTERNAL, f"router error: {type(exc).__name__}: {exc}")
        finally:
            if out is None and outcome == "invalid_argument":
                self._metrics.request_rejected(outcome)  # the prompt itself was refused (length, template)
            else:
                self._record(outcome, out, clock)

    async def _validate(self, parsed: ParsedRequest) -> ValidatedRequest:
        tokenizer = self._model.tokenizer
        if _prompt_chars(parsed) > INLINE_TOKENIZE_CHARS:
            loop = asyncio.get_running_loop()
            ids = await loop.run_in_executor(self._executor, encode_prompt, parsed, tokenizer)
        else:
            ids = encode_prompt(parsed, tokenizer)
        return check_lengths(parsed, ids, self._model, self._config)

    def _record(self, outcome: str, out: ResponseBuilder | None, clock: RequestClock) -> None:
        now = time.monotonic()
        self._metrics.request_done(
            RequestRecord(
                outcome=outcome,
                prompt_tokens=len(out.request.prompt_token_ids) if out else 0,
                completion_tokens=len(out.token_ids) if out else 0,
                e2e_seconds=now - clock.arrival,
                queue_seconds=None if clock.started is None else clock.started - clock.arrival,
                ttft_seconds=None if clock.first_token is None else clock.first_token - clock.arrival,
            )
        )

    async def ListModels(self, request: generate_pb2.ListModelsRequest, context: Any) -> Any:
        info = generate_pb2.ModelInfo(
            id=self._model.id, max_model_len=self._model.max_model_len, vocab_size=self._model.vocab_size
        )
        return generate_pb2.ListModelsResponse(models=[info])


def _prompt_chars(parsed: ParsedRequest) -> int:
    if parsed.text is not None:
        return len(parsed.text)
    return sum(len(m.content) for m in parsed.messages or ())


def _cancelled_outcome(out: ResponseBuilder | None, deadline: float) -> str:
    """How a call that gRPC cancelled under the handler ended. A request that had finished counts as finished
    (a client drops its call once it has read the Final, which can overtake the handler's return); one whose
    deadline had passed counts as DEADLINE_EXCEEDED (the client's deadline cancels the call here)."""
    if out is not None and out.finish_reason is not None:
        return _finish_name(out)
    if asyncio.get_running_loop().time() >= deadline - _DEADLINE_SLACK_S:
        return grpc.StatusCode.DEADLINE_EXCEEDED.name.lower()
    return grpc.StatusCode.CANCELLED.name.lower()


def _finish_name(out: ResponseBuilder | None) -> str:
    if out is None or out.finish_reason is None:
        return "unknown"
    names: dict[int, str] = {
        generate_pb2.FINISH_REASON_STOP: "stop",
        generate_pb2.FINISH_REASON_LENGTH: "length",
        generate_pb2.FINISH_REASON_ABORT: "abort",
    }
    return names.get(out.finish_reason, "unknown")


class AdminService(admin_pb2_grpc.AdminServicer):
    def __init__(self, pool: WorkerPool, admission: Admission) -> None:
        self._pool = pool
        self._admission = admission

    async def Status(self, request: admin_pb2.StatusRequest, context: Any) -> Any:
        router = admin_pb2.RouterInfo(
            queued_requests=self._admission.queued, in_flight_requests=self._admission.in_flight
        )
        return admin_pb2.ClusterStatus(workers=self._pool.status(), router=router)


class RouterControlService(worker_pb2_grpc.RouterControlServicer):
    """SetWorkers from the controller: the whole membership each time; an older generation is ignored."""

    def __init__(self, apply: Callable[[Sequence[Endpoint], int | None], bool]) -> None:
        self._apply = apply

    async def SetWorkers(self, request: worker_pb2.WorkerSet, context: Any) -> Any:
        try:
            endpoints = endpoints_from_proto(request.workers)
        except RouterError as exc:
            await context.abort(exc.code, exc.details)
        self._apply(endpoints, request.generation)
        return worker_pb2.SetWorkersReply()


def _cancel_on_client_cancel(context: Any) -> None:
    """Cancel this handler's task the moment the client cancels: grpc.aio would only notice at a later write,
    and until then the workers keep generating (and holding KV) for nobody."""
    task = asyncio.current_task()

    def on_done(ctx: Any) -> None:
        if ctx.cancelled() and task is not None and not task.done():
            task.cancel()

    context.add_done_callback(on_done)
