"""`RequestPipeline`: the one path a request takes through the router, whichever front door it came in by.

    admitted = pipeline.admit(message, Protocol.GRPC, authorization)  # key, quota, fields, a place; or RouterError
    await pipeline.run(admitted, deadline, write)          # tokenize, wait for a slot, dispatch; or RouterError

Both front doors build the same `tandem.v1.GenerateRequest` (the gRPC server receives it; the OpenAI HTTP API
translates its JSON into one) and read the same `GenerateResponse` messages through `write`, so admission,
validation, placement, deadlines, cancellation and metrics exist once. A failure is a RouterError whose gRPC
code each front door turns into its own status; a cancelled task (the client went away) cancels the worker
calls on its way out. Every accepted request records exactly one outcome, every refused one a rejection.
With API keys on (router.auth), the key is checked first: a request without a valid key is refused before its
fields are read and never reaches a worker; then the key's quota, then admission in the key's priority class.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass

import grpc

from router.admission import Admission, Priority, Ticket
from router.auth import ApiKey, AuthGate, Grant, QuotaExceeded, Unauthenticated
from router.config import RouterConfig
from router.dispatch import Dispatcher
from router.errors import ClientGone, RouterError
from router.metrics import RequestRecord, RouterMetrics
from router.model import ServedModel
from router.responses import RequestClock, ResponseBuilder
from router.validation import ParsedRequest, ValidatedRequest, check_lengths, encode_prompt, parse_request
from tandem_api.tandem.v1 import generate_pb2

log = logging.getLogger(__name__)

# Prompts longer than this (characters) are tokenized in the executor so one long prompt does not stall every
# other stream on the event loop; shorter ones cost less than the thread hop.
INLINE_TOKENIZE_CHARS = 2048
# gRPC's own deadline timer and this loop's clock fire a hair apart: a call cancelled this close to its
# deadline was cancelled by the deadline.
_DEADLINE_SLACK_S = 0.1

Write = Callable[[generate_pb2.GenerateResponse], Awaitable[None]]


class Protocol(enum.StrEnum):
    """The front door a request came in by (the `protocol` label of the router's metrics)."""

    GRPC = "grpc"
    HTTP = "http"


@dataclass(frozen=True)
class Admitted:
    """A request whose fields are valid and that holds a place in admission (its ticket)."""

    parsed: ParsedRequest
    ticket: Ticket
    clock: RequestClock
    protocol: Protocol
    grant: Grant | None = None  # the key's hold on its quota (None: the router asks for no keys)

    @property
    def key_name(self) -> str:
        return "" if self.grant is None else self.grant.key.name

    def close(self) -> None:
        """Give back the admission place and the key's concurrency; idempotent."""
        self.ticket.close()
        if self.grant is not None:
            self.grant.release()


class RequestPipeline:
    def __init__(
        self,
        config: RouterConfig,
        model: ServedModel,
        admission: Admission,
        dispatcher: Dispatcher,
        metrics: RouterMetrics,
        executor: Executor,
        gate: AuthGate | None = None,
    ) -> None:
        self.config = config
        self.model = model
        self._admission = admission
        self._dispatcher = dispatcher
        self._metrics = metrics
        self._executor = executor
        self.gate = gate

    def admit(
        self, message: generate_pb2.GenerateRequest, protocol: Protocol, authorization: str | None = None
    ) -> Admitted:
        """Check the API key (when the router asks for keys) and its quota, the fields (not the prompt's length:
        that needs tokenizing), and take a place in admission. Raises RouterError (UNAUTHENTICATED,
        INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, UNAVAILABLE), counted as rejected."""
        clock = RequestClock(arrival=time.monotonic())
        key = self.authenticate(authorization, protocol)
        priority = Priority.INTERACTIVE if key is None else key.priority
        grant: Grant | None = None
        try:
            parsed = parse_request(message, self.model, self.config)
            grant = None if self.gate is None or key is None else self.gate.quotas.acquire(key)
            ticket = self._admission.enter(priority)
        except RouterError as exc:
            if grant is not None:
                grant.release()
            if key is not None and exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                reason = exc.reason if isinstance(exc, QuotaExceeded) else "overload"
                self._metrics.key_rejected(key.name, priority.value, reason)
            self.reject(exc.code, protocol)
            raise
        return Admitted(parsed, ticket, clock, protocol, grant)

    def authenticate(
        self, authorization: str | None, protocol: Protocol, admin: bool = False
    ) -> ApiKey | None:
        """The caller's key (None when the router asks for no keys); UNAUTHENTICATED, counted, when it has none
        that serves (`admin`: an admin key)."""
        if self.gate is None:
            return None
        try:
            if admin:
                return self.gate.authenticate_admin(authorization)
            return self.gate.authenticate(authorization)
        except Unauthenticated as exc:
            self._metrics.auth_failed(exc.reason, protocol.value)
            self.reject(exc.code, protocol)
            raise

    def reject(self, code: grpc.StatusCode, protocol: Protocol) -> None:
        """Count a request refused before admission (also one the front door could not even parse)."""
        self._metrics.request_rejected(code.name.lower(), protocol.value)

    async def run(self, admitted: Admitted, deadline: float, write: Write) -> ResponseBuilder:
        """Tokenize, wait for a slot, dispatch, all before `deadline` (loop time); the Deltas and the Final go
        through `write`. Returns the finished request's builder. Raises RouterError (DEADLINE_EXCEEDED once the
        deadline passed, RESOURCE_EXHAUSTED when shed, INTERNAL for a router bug); CancelledError and ClientGone
        pass through as a cancel. The admission place and the key's hold end here, however it ends."""
        try:
            return await self._run(admitted, deadline, write)
        finally:
            admitted.close()

    async def _run(self, admitted: Admitted, deadline: float, write: Write) -> ResponseBuilder:
        outcome = grpc.StatusCode.CANCELLED.name.lower()  # unless something below says otherwise
        out: ResponseBuilder | None = None
        try:
            async with asyncio.timeout_at(deadline):
                request = await self._validate(admitted.parsed)
                request = dataclasses.replace(request, priority=admitted.ticket.priority)
                out = ResponseBuilder(request, self.model, admitted.clock)
                if admitted.grant is not None:
                    admitted.grant.charge_prompt(len(out.request.prompt_token_ids))
                await admitted.ticket.start()
                await self._dispatcher.run(out.request, out, deadline, write)
            outcome = _finish_name(out)
            return out
        except TimeoutError:
            outcome = grpc.StatusCode.DEADLINE_EXCEEDED.name.lower()
            sent = f"after {len(out.token_ids)} tokens" if out and out.token_ids else "before the first token"
            raise RouterError(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"the request's deadline passed {sent}"
            ) from None
        except RouterError as exc:
            outcome = exc.code.name.lower()
            if admitted.ticket.shed and admitted.grant is not None:
                self._metrics.key_rejected(admitted.key_name, admitted.ticket.priority.value, "shed")
            raise
        except (asyncio.CancelledError, ClientGone):  # the client went away, or its deadline cancelled it
            outcome = _cancelled_outcome(out, deadline)
            raise
        except Exception as exc:  # a router bug: say so instead of a bare UNKNOWN
            log.exception("request %s failed inside the router", admitted.parsed.request_id)
            outcome = grpc.StatusCode.INTERNAL.name.lower()
            raise RouterError(grpc.StatusCode.INTERNAL, f"router error: {type(exc).__name__}: {exc}") from exc
        finally:
            if out is None and outcome == "invalid_argument":
                # the prompt itself was refused (length, template)
                self._metrics.request_rejected(outcome, admitted.protocol.value)
            else:
                self._record(outcome, out, admitted)
            if admitted.grant is not None and out is not None:
                admitted.grant.charge_output(len(out.token_ids))

    async def _validate(self, parsed: ParsedRequest) -> ValidatedRequest:
        tokenizer = self.model.tokenizer
        if _prompt_chars(parsed) > INLINE_TOKENIZE_CHARS:
            loop = asyncio.get_running_loop()
            ids = await loop.run_in_executor(self._executor, encode_prompt, parsed, tokenizer)
        else:
            ids = encode_prompt(parsed, tokenizer)
        return check_lengths(parsed, ids, self.model, self.config)

    def _record(self, outcome: str, out: ResponseBuilder | None, admitted: Admitted) -> None:
        clock, now = admitted.clock, time.monotonic()
        self._metrics.request_done(
            RequestRecord(
                outcome=outcome,
                prompt_tokens=len(out.request.prompt_token_ids) if out else 0,
                completion_tokens=len(out.token_ids) if out else 0,
                e2e_seconds=now - clock.arrival,
                queue_seconds=None if clock.started is None else clock.started - clock.arrival,
                ttft_seconds=None if clock.first_token is None else clock.first_token - clock.arrival,
                protocol=admitted.protocol.value,
                key=admitted.key_name,
                priority=admitted.ticket.priority.value,
            )
        )


def _prompt_chars(parsed: ParsedRequest) -> int:
    if parsed.text is not None:
        return len(parsed.text)
    return sum(len(m.content) for m in parsed.messages or ())


def _cancelled_outcome(out: ResponseBuilder | None, deadline: float) -> str:
    """How a request that was cancelled under the pipeline ended. A request that had finished counts as
    finished (a client drops its call once it has read the Final, which can overtake the handler's return);
    one whose deadline had passed counts as DEADLINE_EXCEEDED (the client's deadline cancels the call here)."""
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
