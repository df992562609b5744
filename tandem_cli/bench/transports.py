"""How `tandem bench` reaches the router: gRPC through the SDK, or the OpenAI-compatible HTTP API, so the two
front doors can be measured with the same workload and the same timing.

    async with transport_for("openai", "http://127.0.0.1:8000") as transport:
        model = await transport.served_model()
        cached = await transport.send(spec, timeout_s, on_delta)  # on_delta(tokens) per delta; raises RequestFailed

Both send the same request: the spec's token ids as the prompt, max_tokens = its output length, ignore_eos,
greedy. Over HTTP that is a streaming /v1/completions call with vLLM's ignore_eos and return_token_ids
extensions (the token ids count each chunk's tokens, as the gRPC Delta's do) and stream_options.include_usage;
the deadline travels as the X-Request-Timeout header, as the gRPC deadline travels with the call. `send` returns
the prompt tokens the server's prefix cache served (usage.cached_prompt_tokens; prompt_tokens_details.cached_tokens
over HTTP), None if the server did not say.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from types import TracebackType
from typing import Protocol

import grpc

from tandem_cli.bench.workload import RequestSpec
from tandem_client.aio import AsyncClient
from tandem_client.channel import auth_metadata
from tandem_client.errors import TandemError
from tandem_client.types import GenerationDelta, GenerationResult, ModelInfo

PROTOCOLS = ("grpc", "openai")
DEFAULT_OPENAI_SERVER = "http://127.0.0.1:8000"
_MODELS_TIMEOUT_S = 30.0

OnDelta = Callable[[int], None]


class RequestFailed(Exception):
    """One request failed; `code` is the gRPC status name, or HTTP_<status> for the HTTP API."""

    def __init__(self, code: str | None) -> None:
        super().__init__(code)
        self.code = code


class Transport(Protocol):
    async def served_model(self) -> ModelInfo: ...

    async def send(self, spec: RequestSpec, timeout_s: float | None, on_delta: OnDelta) -> int | None: ...

    async def close(self) -> None: ...


class GrpcTransport:
    def __init__(self, address: str) -> None:
        self._client = AsyncClient(address)

    async def served_model(self) -> ModelInfo:
        models = await self._client.list_models(timeout=_MODELS_TIMEOUT_S)
        if not models:
            raise TandemError(
                grpc.StatusCode.UNAVAILABLE, "the router serves no model (ListModels returned none)"
            )
        return models[0]

    async def send(self, spec: RequestSpec, timeout_s: float | None, on_delta: OnDelta) -> int | None:
        try:
            stream = self._client.stream(
                token_ids=spec.prompt_token_ids,
                max_tokens=spec.output_len,
                ignore_eos=True,
                temperature=0.0,
                timeout=timeout_s,
            )
            async with stream as events:
                async for event in events:
                    if isinstance(event, GenerationDelta):
                        on_delta(len(event.token_ids))
                    elif isinstance(event, GenerationResult):
                        return event.usage.cached_prompt_tokens
        except TandemError as exc:
            raise RequestFailed(exc.code.name) from None
        raise RequestFailed(None)  # the SDK raises before a stream ends without its result; never reached

    async def close(self) -> None:
        await self._client.close()


class OpenAITransport:
    """aiohttp (a dependency of the router) as the client: one session, no connection limit, so C concurrent
    streams are C connections, as C openai clients would open. Imported here: other `tandem` commands do not
    pay for it."""

    def __init__(self, base_url: str) -> None:
        import aiohttp

        self._base = base_url.rstrip("/") if "://" in base_url else f"http://{base_url}"
        # $TANDEM_API_KEY, as the gRPC transport's AsyncClient sends it, for a router that asks for keys
        auth = dict(auth_metadata(None))
        headers = {"Authorization": auth["authorization"]} if auth else None
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None),
            headers=headers,
        )
        self._model: ModelInfo | None = None

    async def served_model(self) -> ModelInfo:
        import aiohttp

        url = f"{self._base}/v1/models"
        async with self._session.get(url, timeout=aiohttp.ClientTimeout(total=_MODELS_TIMEOUT_S)) as response:
            if response.status != 200:
                raise TandemError(grpc.StatusCode.UNAVAILABLE, f"{url} answered HTTP {response.status}")
            card = (await response.json())["data"][0]
        self._model = ModelInfo(card["id"], card.get("max_model_len", 0), card.get("vocab_size", 0))
        return self._model

    async def send(self, spec: RequestSpec, timeout_s: float | None, on_delta: OnDelta) -> int | None:
        body = {
            "model": self._model.id if self._model else None,
            "prompt": list(spec.prompt_token_ids),
            "max_tokens": spec.output_len,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream_options": {"include_usage": True},
        }
        headers = {} if timeout_s is None else {"X-Request-Timeout": str(timeout_s)}
        async with self._session.post(f"{self._base}/v1/completions", json=body, headers=headers) as response:
            if response.status != 200:
                raise RequestFailed(f"HTTP_{response.status}")
            finished, cached = False, None
            async for line in response.content:
                if not line.startswith(b"data: "):
                    continue  # the blank line between events
                data = line[6:].strip()
                if data == b"[DONE]":
                    if finished:
                        return cached
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RequestFailed(f"HTTP_STREAM_{chunk['error'].get('code') or 'error'}".upper())
                for choice in chunk["choices"]:
                    if "token_ids" in choice:
                        on_delta(len(choice["token_ids"]))
                    finished |= choice.get("finish_reason") is not None
                usage = chunk.get("usage") or {}
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", cached)
        raise RequestFailed("HTTP_STREAM_INCOMPLETE")

    async def close(self) -> None:
        await self._session.close()


class RoundRobin:
    """Several routers of one deployment (`tandem serve` with router.processes > 1, router replicas behind no
    load balancer): request i goes to router i mod n. Each must serve the same model."""

    def __init__(self, transports: list[GrpcTransport | OpenAITransport], addresses: list[str]) -> None:
        self._transports = transports
        self._addresses = addresses
        self._next = 0

    async def served_model(self) -> ModelInfo:
        models = [await t.served_model() for t in self._transports]
        for address, model in zip(self._addresses, models):
            if model.id != models[0].id:
                raise TandemError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"--server: {address} serves {model.id!r}, {self._addresses[0]} serves {models[0].id!r}; "
                    "give routers of one deployment",
                )
        return models[0]

    async def send(self, spec: RequestSpec, timeout_s: float | None, on_delta: OnDelta) -> int | None:
        transport = self._transports[self._next]
        self._next = (self._next + 1) % len(self._transports)
        return await transport.send(spec, timeout_s, on_delta)

    async def close(self) -> None:
        for transport in self._transports:
            await transport.close()


AnyTransport = GrpcTransport | OpenAITransport | RoundRobin


def servers(server: str) -> list[str]:
    """The addresses of a --server value: one, or several separated by commas."""
    addresses = [a.strip() for a in server.split(",")]
    if not all(addresses):
        raise ValueError(f"--server: an empty address in {server!r} (give HOST:PORT[,HOST:PORT...])")
    return addresses


class _Opened:
    def __init__(self, transport: AnyTransport) -> None:
        self.transport = transport

    async def __aenter__(self) -> AnyTransport:
        return self.transport

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.transport.close()


def transport_for(protocol: str, server: str) -> _Opened:
    """An async context manager holding the transport for `protocol` ("grpc" or "openai") to `server`: one
    address, or several separated by commas (RoundRobin over them)."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"--protocol: must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    kind = GrpcTransport if protocol == "grpc" else OpenAITransport
    addresses = servers(server)
    if len(addresses) == 1:
        return _Opened(kind(addresses[0]))
    return _Opened(RoundRobin([kind(a) for a in addresses], addresses))
