"""`RequestPipeline`: the one path a request takes through the router, whichever front door it came in by.

    admitted = pipeline.admit(message, Protocol.GRPC)     # fields checked, a place in admission; or RouterError
    await pipeline.run(admitted, deadline, write)          # tokenize, wait for a slot, dispatch; or RouterError

Both front doors build the same `tandem.v1.GenerateRequest` (the gRPC server receives it; the OpenAI HTTP API
translates its JSON into one) and read the same `GenerateResponse` messages through `write`, so admission,
validation, placement, deadlines, cancellation and metrics exist once. A failure is a RouterError whose gRPC
code each front door turns into its own status; a cancelled task (the client went away) cancels the worker
calls on its way out. Every accepted request records exactly one outcome, every refused one a rejection.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass

import grpc

from router.admission import Admission, Ticket
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


class RequestPipeline:
    def __init__(
        self,
        config: RouterConfig,
        model: ServedModel,
        admission: Admission,
        dispatcher: Dispatcher,
        metrics: RouterMetrics,
        executor: Executor,
    ) -> None:
        self.config = config
        self.model = model
        self._admission = admission
        self._dispatcher = dispatcher
        self._metrics = metrics
        self._executor = executor

    def admit(self, message: generate_pb2.GenerateRequest, protocol: Protocol) -> Admitted:
        """Check the fields (not the prompt's length: that needs tokenizing) and take a place in admission.
        Raises RouterError (INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, UNAVAILABLE), counted as rejected."""
        clock = RequestClock(arrival=time.monotonic())
        try:
            parsed = parse_request(message, self.model, self.config)
            ticket = self._admission.enter()
        except RouterError as exc:
            self.reject(exc.code, protocol)
            raise
        return Admitted(parsed, ticket, clock, protocol)

    def reject(self, code: grpc.StatusCode, protocol: Protocol) -> None:
        """Count a request refused before admission (also one the front door could not even parse)."""
        self._metrics.request_rejected(code.name.lower(), protocol.value)

    async def run(self, admitted: Admitted, deadline: float, write: Write) -> ResponseBuilder:
        """Tokenize, wait for a slot, dispatch, all before `deadline` (loop time); the Deltas and the Final go
        through `write`. Returns the finished request's builder. Raises RouterError (DEADLINE_EXCEEDED once the
        deadline passed, INTERNAL for a router bug); CancelledError and ClientGone pass through as a cancel."""
        outcome = grpc.StatusCode.CANCELLED.name.lower()  # unless something below says otherwise
        out: ResponseBuilder | None = None
        with admitted.ticket:
            try:
                async with asyncio.timeout_at(deadline):
                    out = ResponseBuilder(await self._validate(admitted.parsed), self.model, admitted.clock)
                    await admitted.ticket.start()
                    await self._dispatcher.run(out.request, out, deadline, write)
                outcome = _finish_name(out)
                return out
            except TimeoutError:
                outcome = grpc.StatusCode.DEADLINE_EXCEEDED.name.lower()
                sent = (
                    f"after {len(out.token_ids)} tokens"
                    if out and out.token_ids
                    else "before the first token"
                )
                raise RouterError(
                    grpc.StatusCode.DEADLINE_EXCEEDED, f"the request's deadline passed {sent}"
                ) from None
            except RouterError as exc:
                outcome = exc.code.name.lower()
                raise
            except (asyncio.CancelledError, ClientGone):  # the client went away, or its deadline cancelled it
                outcome = _cancelled_outcome(out, deadline)
                raise
            except Exception as exc:  # a router bug: say so instead of a bare UNKNOWN
                log.exception("request %s failed inside the router", admitted.parsed.request_id)
                outcome = grpc.StatusCode.INTERNAL.name.lower()
                raise RouterError(
                    grpc.StatusCode.INTERNAL, f"router error: {type(exc).__name__}: {exc}"
                ) from exc
            finally:
                if out is None and outcome == "invalid_argument":
                    # the prompt itself was refused (length, template)
                    self._metrics.request_rejected(outcome, admitted.protocol.value)
                else:
                    self._record(outcome, out, admitted)

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
