"""The synchronous SDK: `Client` and the `GenerationStream` that Client.stream returns.

with Client("127.0.0.1:50051", timeout=30) as client:
    result = client.generate("Hello", max_tokens=32, temperature=0)
    for event in client.stream(messages=[ChatMessage("user", "Hi")]):
        ...  # GenerationDelta, GenerationDelta, ..., GenerationResult
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from types import TracebackType
from typing import Any, Unpack

import grpc

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


class GenerationStream(Iterator[StreamEvent]):
    """Yields GenerationDeltas as tokens arrive, then the GenerationResult, then stops.

    close() (or leaving a `with` block, or dropping the last reference) cancels the RPC, so the server stops
    generating. `result` holds the final result once it has been yielded.
    """

    def __init__(self, call: Any) -> None:
        self._call = call
        self._builder = wire.ResultBuilder()
        self._done = False
        self.result: GenerationResult | None = None

    def __iter__(self) -> GenerationStream:
        return self

    def __next__(self) -> StreamEvent:
        if self._done:
            raise StopIteration
        try:
            message = next(self._call)
        except StopIteration:
            self._done = True
            raise wire.stream_ended_early() from None
        except grpc.RpcError as exc:
            self._done = True
            raise error_from_rpc(exc) from exc
        event = wire.event_from_proto(message, self._builder)
        if isinstance(event, GenerationResult):
            self.result, self._done = event, True
        return event

    def collect(self) -> GenerationResult:
        """Read the rest of the stream and return the whole result."""
        for _ in self:
            pass
        if self.result is None:  # only after an earlier close() or error
            raise wire.stream_ended_early()
        return self.result

    def close(self) -> None:
        """Cancel the RPC unless it already finished. Safe to call more than once."""
        if not self._done:
            self._done = True
            self._call.cancel()

    def __enter__(self) -> GenerationStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_call", None) is not None:
            self.close()


class Client:
    """A connection to a Tandem router. Thread-safe; one per process is enough.

    timeout: default deadline in seconds for every call (None: no deadline); each call may pass its own.
    retries: how often UNAVAILABLE is retried before the server has answered (never once tokens flowed).
    metadata: sent with every call.
    api_key: the router's API key, sent as `authorization: Bearer <key>`; default $TANDEM_API_KEY, else none.
    tls: TLS from PEM files (TLSFiles(ca=..., cert=..., key=..., server_name=...)): the roots that sign the
      router's certificate and a client certificate for a router that asks for one; default $TANDEM_TLS_CA /
      _CERT / _KEY / _SERVER_NAME, else plaintext. `credentials` (grpc's own) is the alternative.
    options: extra gRPC channel options, appended after the SDK's own.
    """

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
        cfg = self._config
        if cfg.credentials is None:
            self._channel = grpc.insecure_channel(cfg.address, options=cfg.grpc_options())
        else:
            self._channel = grpc.secure_channel(cfg.address, cfg.credentials, options=cfg.grpc_options())
        self._generation = generate_pb2_grpc.GenerationStub(self._channel)
        self._admin = admin_pb2_grpc.AdminStub(self._channel)

    @property
    def address(self) -> str:
        return self._config.address

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
    ) -> GenerationStream:
        """Start generating; give exactly one of prompt (text), messages or token_ids.

        `sampling` is a base Sampling; keyword sampling fields (max_tokens=, temperature=, ...) override it.
        The RPC starts now; iterate the stream to read it, close it to cancel.
        """
        full = replace(sampling or Sampling(), **sampling_fields)
        request = wire.build_request(Prompt.of(prompt, messages, token_ids), full, model, request_id)
        call = self._generation.Generate(
            request, timeout=self._config.deadline(timeout), metadata=self._config.metadata
        )
        return GenerationStream(call)

    def generate(
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
        """Generate and return the whole result (same arguments as stream)."""
        with self.stream(
            prompt,
            messages=messages,
            token_ids=token_ids,
            sampling=sampling,
            model=model,
            request_id=request_id,
            timeout=timeout,
            **sampling_fields,
        ) as events:
            return events.collect()

    def list_models(self, *, timeout: float | None = None) -> tuple[ModelInfo, ...]:
        try:
            response = self._generation.ListModels(
                generate_pb2.ListModelsRequest(),
                timeout=self._config.deadline(timeout),
                metadata=self._config.metadata,
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from exc
        return wire.models_from_proto(response)

    def status(self, *, timeout: float | None = None) -> ClusterStatus:
        try:
            response = self._admin.Status(
                admin_pb2.StatusRequest(),
                timeout=self._config.deadline(timeout),
                metadata=self._config.metadata,
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from exc
        return wire.status_from_proto(response)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
