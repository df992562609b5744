"""The asyncio SDK: `AsyncClient` (grpc.aio) and `AsyncGenerationStream`, mirroring tandem_client.client.

async with AsyncClient(timeout=30) as client:
    result = await client.generate("Hello", max_tokens=32)
    async with client.stream("Hello") as events:
        async for event in events:
            ...
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from types import TracebackType
from typing import Any, Unpack

import grpc
import grpc.aio

from tandem_api.tandem.v1 import admin_pb2, admin_pb2_grpc, generate_pb2, generate_pb2_grpc
from tandem_client import wire
from tandem_client.channel import DEFAULT_MAX_MESSAGE_BYTES, ChannelOption, make_config
from tandem_client.errors import error_from_rpc
from tandem_client.tls import TLSFiles
from tandem_client.types import (
    ClusterStatus,
    GenerationDelta,
    GenerationResult,
    MessageInput,
    ModelInfo,
    Prompt,
    Sampling,
    SamplingFields,
)

StreamEvent = GenerationDelta | GenerationResult


class AsyncGenerationStream(AsyncIterator[StreamEvent]):
    """Async twin of GenerationStream: deltas, then the GenerationResult. aclose() cancels the RPC, and so
    does cancelling the task that is waiting on it."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self._builder = wire.ResultBuilder()
        self._done = False
        self.result: GenerationResult | None = None

    def __aiter__(self) -> AsyncGenerationStream:
        return self

    async def __anext__(self) -> StreamEvent:
        if self._done:
            raise StopAsyncIteration
        try:
            message = await self._call.read()
        except grpc.RpcError as exc:
            self._done = True
            raise error_from_rpc(exc) from exc
        except asyncio.CancelledError:
            self.close()  # our task was cancelled: stop the server's work too
            raise
        if message is grpc.aio.EOF:
            self._done = True
            raise wire.stream_ended_early()
        event = wire.event_from_proto(message, self._builder)
        if isinstance(event, GenerationResult):
            self.result, self._done = event, True
        return event

    async def collect(self) -> GenerationResult:
        async for _ in self:
            pass
        if self.result is None:
            raise wire.stream_ended_early()
        return self.result

    def close(self) -> None:
        """Cancel the RPC unless it already finished (synchronous; aclose is the awaitable spelling)."""
        if not self._done:
            self._done = True
            self._call.cancel()

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> AsyncGenerationStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_call", None) is not None:
            self.close()


class AsyncClient:
    """Same arguments as Client. The channel is opened on first use, inside the running event loop, so the
    client may be built outside one; use it from a single event loop."""

    def __init__(
        self,
        address: str | None = None,
        *,
        timeout: float | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        retries: int = 2,
        credentials: grpc.ChannelCredentials | None = None,
        metadata: Sequence[tuple[str, str]] = (),
        options: Sequence[ChannelOption] = (),
        api_key: str | None = None,
        tls: TLSFiles | None = None,
    ) -> None:
        self._config = make_config(
            address, timeout, max_message_bytes, retries, credentials, metadata, options, api_key, tls
        )
        self._channel: grpc.aio.Channel | None = None

    @property
    def address(self) -> str:
        return self._config.address

    def _open(self) -> grpc.aio.Channel:
        if self._channel is None:
            cfg = self._config
            if cfg.credentials is None:
                self._channel = grpc.aio.insecure_channel(cfg.address, options=cfg.grpc_options())
            else:
                self._channel = grpc.aio.secure_channel(
                    cfg.address, cfg.credentials, options=cfg.grpc_options()
                )
        return self._channel

    def stream(
        self,
        prompt: str | Prompt | None = None,
        *,
        messages: Sequence[MessageInput] | None = None,
        token_ids: Sequence[int] | None = None,
        sampling: Sampling | None = None,
        model: str | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
        **sampling_fields: Unpack[SamplingFields],
    ) -> AsyncGenerationStream:
        """Start generating (call from a running event loop); see Client.stream."""
        full = replace(sampling or Sampling(), **sampling_fields)
        request = wire.build_request(Prompt.of(prompt, messages, token_ids), full, model, request_id)
        stub = generate_pb2_grpc.GenerationStub(self._open())
        call = stub.Generate(request, timeout=self._config.deadline(timeout), metadata=self._config.metadata)
        return AsyncGenerationStream(call)

    async def generate(
        self,
        prompt: str | Prompt | None = None,
        *,
        messages: Sequence[MessageInput] | None = None,
        token_ids: Sequence[int] | None = None,
        sampling: Sampling | None = None,
        model: str | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
        **sampling_fields: Unpack[SamplingFields],
    ) -> GenerationResult:
        async with self.stream(
            prompt,
            messages=messages,
            token_ids=token_ids,
            sampling=sampling,
            model=model,
            request_id=request_id,
            timeout=timeout,
            **sampling_fields,
        ) as events:
            return await events.collect()

    async def list_models(self, *, timeout: float | None = None) -> tuple[ModelInfo, ...]:
        stub = generate_pb2_grpc.GenerationStub(self._open())
        try:
            response = await stub.ListModels(
                generate_pb2.ListModelsRequest(),
                timeout=self._config.deadline(timeout),
                metadata=self._config.metadata,
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from exc
        return wire.models_from_proto(response)

    async def status(self, *, timeout: float | None = None) -> ClusterStatus:
        stub = admin_pb2_grpc.AdminStub(self._open())
        try:
            response = await stub.Status(
                admin_pb2.StatusRequest(),
                timeout=self._config.deadline(timeout),
                metadata=self._config.metadata,
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from exc
        return wire.status_from_proto(response)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
