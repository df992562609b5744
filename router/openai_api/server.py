"""`OpenAIServer`: the OpenAI-compatible HTTP API, an aiohttp application on the router's event loop.

    POST /v1/completions, POST /v1/chat/completions    -> the shared request pipeline (router.pipeline); n > 1
                                                          choices (and a list of prompts) run as requests of
                                                          their own, at once
    GET  /v1/models, GET /v1/models/{id}               -> the served model
    GET  /health                                       -> 200 while a request could be placed, else 503

With API keys on (router.auth), every /v1 route needs `Authorization: Bearer <key>` (401 in OpenAI's error
shape otherwise; a key over its quota gets 429 with Retry-After); /health stays open.

Each request is translated into the router's own GenerateRequest and runs through the same admission,
validation, placement, deadlines and metrics as a gRPC call; no second router. The deadline is the
`X-Request-Timeout` header (seconds) or the router's request_timeout_s.

Streams send headers at the first token, not before, so a request refused before it produced anything
(overloaded, no worker, a prompt too long, the deadline) still gets its own status code; once streaming, a
failure is one `data: {"error": ...}` event. A client that disconnects cancels its handler (aiohttp's
handler_cancellation), and the cancel reaches the worker calls at once, as a gRPC cancel does.

aiohttp: maintained, already installed with Ray's dashboard, and it runs on the loop that serves gRPC, so the
HTTP path adds no thread hop; it parses HTTP, limits the body (client_max_size) and frames the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import grpc
from aiohttp import web

from router.errors import ClientGone, RouterError
from router.openai_api.errors import ApiError, bad_request, from_router_error
from router.openai_api.requests import OpenAIRequest, parse_chat, parse_completion
from router.openai_api.responses import Answer, usage_chunk, whole_response
from router.pipeline import Admitted, Protocol, RequestPipeline
from tandem_api.tandem.v1 import generate_pb2

log = logging.getLogger(__name__)

TIMEOUT_HEADER = "X-Request-Timeout"
AUTHORIZATION = "Authorization"
# stop() comes after the router's drain (RouterServer.drain waits for every admitted request, HTTP ones
# included): what still runs then gets this long before it is cancelled.
STOP_GRACE_S = 2.0
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_DONE = b"data: [DONE]\n\n"


class OpenAIServer:
    def __init__(
        self,
        pipeline: RequestPipeline,
        host: str,
        port: int,
        *,
        max_body_bytes: int,
        serving: Callable[[], bool],
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._pipeline = pipeline
        self._host, self._port = host, port
        self._max_body_bytes = max_body_bytes
        self._serving = serving
        self._ssl_context = ssl_context  # None: plaintext HTTP
        self._created = int(time.time())
        self._runner: web.AppRunner | None = None
        self.address = ""  # http(s)://host:port once started

    async def start(self) -> str:
        app = web.Application(client_max_size=self._max_body_bytes, middlewares=[_openai_errors])
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{model:.+}", self._model)
        app.router.add_get("/health", self._health)
        # access_log None: no log line per request on the router's loop (the metrics count them).
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=STOP_GRACE_S)
        await runner.setup()
        site = web.TCPSite(runner, self._host, self._port, reuse_address=True, ssl_context=self._ssl_context)
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            raise OSError(f"cannot bind the OpenAI HTTP API to {self._host}:{self._port}: {exc}") from exc
        self._runner = runner
        port = runner.addresses[0][1]
        host = f"[{self._host}]" if ":" in self._host else self._host
        scheme = "https" if self._ssl_context is not None else "http"
        self.address = f"{scheme}://{host}:{port}"
        return self.address

    async def stop(self) -> None:
        """Stop listening; requests still running get STOP_GRACE_S, then are cancelled. Safe to call twice."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    # --- handlers -------------------------------------------------------------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        if self._serving():
            return web.json_response({"status": "serving"})
        return web.json_response({"status": "not serving"}, status=503)

    def _authenticate(self, request: web.Request) -> None:
        try:
            self._pipeline.authenticate(request.headers.get(AUTHORIZATION), Protocol.HTTP)
        except RouterError as exc:
            raise from_router_error(exc, chat=False) from None

    async def _models(self, request: web.Request) -> web.Response:
        self._authenticate(request)
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def _model(self, request: web.Request) -> web.Response:
        self._authenticate(request)
        name = request.match_info["model"]
        if name != self._pipeline.model.id:
            raise ApiError(404, f"model: unknown model {name!r}; serving {self._pipeline.model.id!r}",
                           param="model", code="model_not_found")  # fmt: skip
        return web.json_response(self._model_card())

    def _model_card(self) -> dict[str, Any]:
        model = self._pipeline.model
        return {
            "id": model.id,
            "object": "model",
            "created": self._created,
            "owned_by": "tandem",
            "max_model_len": model.max_model_len,
            "vocab_size": model.vocab_size,
        }

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_completion)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_chat)

    async def _generate(
        self, request: web.Request, parse: Callable[[Mapping[str, Any]], OpenAIRequest]
    ) -> web.StreamResponse:
        self._authenticate(request)  # before the body: without a key, a bad body is still a 401
        try:
            parsed = parse(await self._read_json(request))
            timeout = _timeout(request, self._pipeline.config.request_timeout_s)
        except ApiError:
            self._pipeline.reject(grpc.StatusCode.INVALID_ARGUMENT, Protocol.HTTP)
            raise
        deadline = asyncio.get_running_loop().time() + timeout
        admitted = self._admit(parsed, request.headers.get(AUTHORIZATION))
        model = self._pipeline.model
        choices = parsed.n * parsed.num_prompts
        several = choices > 1
        answers = [
            Answer(parsed, model.id, model.tokenizer, i, usage_chunk=not several) for i in range(choices)
        ]
        stream = EventStream(request)
        writes = [self._streaming(a, stream) if parsed.stream else self._collecting(a) for a in answers]
        try:
            await self._run_all(admitted, deadline, writes)
        except ClientGone:
            return stream.response  # the pipeline counted it as cancelled; nobody reads what we would send
        except RouterError as exc:
            error = from_router_error(exc, parsed.chat, parsed.max_tokens_field)
            if not stream.started:
                raise error from None
            with contextlib.suppress(ClientGone):  # headers are gone: the error is the stream's last event
                await stream.send(error.body())
            return stream.response
        if parsed.stream:
            if several and parsed.include_usage:
                with contextlib.suppress(ClientGone):
                    await stream.send(usage_chunk(answers))
            return await stream.done()
        return web.json_response(whole_response(answers), dumps=_dumps_str)

    def _admit(self, parsed: OpenAIRequest, authorization: str | None) -> list[Admitted]:
        """Every choice's request admitted, or none (those admitted before a refusal give their places back)."""
        admitted: list[Admitted] = []
        try:
            for message in parsed.choice_messages():
                admitted.append(self._pipeline.admit(message, Protocol.HTTP, authorization))
        except RouterError as exc:
            for a in admitted:
                a.close()
            raise from_router_error(exc, parsed.chat, parsed.max_tokens_field) from None
        return admitted

    async def _run_all(
        self,
        admitted: list[Admitted],
        deadline: float,
        writes: list[Callable[[generate_pb2.GenerateResponse], Awaitable[None]]],
    ) -> None:
        """Run the choices' requests at once; the first to fail (or a client gone) cancels the others and is
        raised. One choice runs in this task, as a request without choices did."""
        if len(admitted) == 1:
            await self._pipeline.run(admitted[0], deadline, writes[0])
            return
        tasks = [asyncio.ensure_future(self._pipeline.run(a, deadline, w)) for a, w in zip(admitted, writes)]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:  # a failure, or this handler cancelled (the client left): the rest stop too
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for task in tasks:  # in choice order: the first choice's error is the one reported
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]

    def _streaming(
        self, answer: Answer, stream: EventStream
    ) -> Callable[[generate_pb2.GenerateResponse], Awaitable[None]]:
        async def write(message: generate_pb2.GenerateResponse) -> None:
            if message.HasField("delta"):
                await stream.send(answer.chunk(message.delta))
            else:
                for chunk in answer.last_chunks(message.final):
                    await stream.send(chunk)

        return write

    def _collecting(self, answer: Answer) -> Callable[[generate_pb2.GenerateResponse], Awaitable[None]]:
        async def write(message: generate_pb2.GenerateResponse) -> None:
            if message.HasField("delta"):
                answer.add(message.delta)
            else:
                answer.add_final(message.final)

        return write

    async def _read_json(self, request: web.Request) -> Mapping[str, Any]:
        limit = self._max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise _too_large(request.content_length, limit)
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise _too_large(None, limit) from None
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise bad_request(None, f"the body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise bad_request(None, f"the body must be a JSON object, got {type(body).__name__}")
        return body


class EventStream:
    """Server-sent events: `data: <json>\\n\\n` per event, `data: [DONE]\\n\\n` at the end. Headers go out
    with the first event; a failed write means the client left (ClientGone). Writes go one at a time: the
    choices of one request write from tasks of their own."""

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self.response = web.StreamResponse(headers=_SSE_HEADERS)
        self._lock = asyncio.Lock()

    @property
    def started(self) -> bool:
        return self.response.prepared

    async def send(self, event: dict[str, Any]) -> None:
        await self._write(b"data: " + _dumps(event) + b"\n\n")

    async def done(self) -> web.StreamResponse:
        try:
            await self._write(_DONE)
            await self.response.write_eof()
        except (ClientGone, ConnectionError):
            pass  # the request is finished and counted; a client may close as soon as it has the Final
        return self.response

    async def _write(self, data: bytes) -> None:
        async with self._lock:
            try:
                if not self.response.prepared:
                    await self.response.prepare(self._request)
                await self.response.write(data)
            except ConnectionError as exc:  # aiohttp's ClientConnectionResetError is one
                raise ClientGone(str(exc)) from None


@web.middleware
async def _openai_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """ApiError, and aiohttp's own 404/405, as OpenAI's error object."""
    try:
        return await handler(request)
    except ApiError as exc:
        return web.json_response(exc.body(), status=exc.status, headers=exc.headers())
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        error = ApiError(exc.status, f"{request.method} {request.path}: {exc.reason}", code=str(exc.status))
        return web.json_response(error.body(), status=exc.status)


def _timeout(request: web.Request, default: float) -> float:
    text = request.headers.get(TIMEOUT_HEADER)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise bad_request(None, f"header {TIMEOUT_HEADER}: must be a number of seconds > 0, got {text!r}")
    return value


def _too_large(size: int | None, limit: int) -> ApiError:
    got = f"{size} bytes" if size is not None else "more"
    return ApiError(
        413, f"the request body is too large: {got}, at most {limit} bytes", code="request_too_large"
    )


def _dumps(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def _dumps_str(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
