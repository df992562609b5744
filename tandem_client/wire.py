"""Translation between the SDK's dataclasses and tandem.v1 protobuf messages (the only place that knows both)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import fields

import grpc

from tandem_api.tandem.v1 import admin_pb2, generate_pb2, kv_pb2
from tandem_client.errors import Internal, InvalidArgument
from tandem_client.types import (
    ActivePair,
    ClusterStatus,
    FinishReason,
    GenerationDelta,
    GenerationResult,
    ModelInfo,
    PoolInfo,
    Prompt,
    RouterInfo,
    Sampling,
    Timings,
    TokenLogprob,
    TopLogprob,
    Usage,
    WorkerInfo,
    WorkerRole,
    WorkerState,
)

MAX_REQUEST_ID_CHARS = 128

_FINISH_REASONS = {
    generate_pb2.FINISH_REASON_STOP: FinishReason.STOP,
    generate_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    generate_pb2.FINISH_REASON_ABORT: FinishReason.ABORT,
}
_ROLES = {
    admin_pb2.WORKER_ROLE_PREFILL: WorkerRole.PREFILL,
    admin_pb2.WORKER_ROLE_DECODE: WorkerRole.DECODE,
    admin_pb2.WORKER_ROLE_COLOCATED: WorkerRole.COLOCATED,
}
_STATES = {
    admin_pb2.WORKER_STATE_STARTING: WorkerState.STARTING,
    admin_pb2.WORKER_STATE_READY: WorkerState.READY,
    admin_pb2.WORKER_STATE_DRAINING: WorkerState.DRAINING,
    admin_pb2.WORKER_STATE_DEAD: WorkerState.DEAD,
}


def _invalid(field: str, problem: str) -> InvalidArgument:
    return InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {problem}")


def sampling_to_proto(sampling: Sampling) -> generate_pb2.SamplingParams:
    """Copy the set fields; protobuf's own type/range checks (e.g. uint32 >= 0) become InvalidArgument."""
    message = generate_pb2.SamplingParams()
    for field in fields(sampling):
        value = getattr(sampling, field.name)
        if value is None or value == () or value is False:
            continue
        try:
            if field.name == "logit_bias":
                message.logit_bias.update(dict(value))
            elif isinstance(value, tuple):
                getattr(message, field.name).extend(value)
            else:
                setattr(message, field.name, value)
        except (TypeError, ValueError) as exc:
            raise _invalid(f"sampling.{field.name}", f"{value!r} is not valid ({exc})") from None
    return message


def build_request(
    prompt: Prompt, sampling: Sampling, model: str | None = None, request_id: str | None = None
) -> generate_pb2.GenerateRequest:
    if request_id is not None and len(request_id) > MAX_REQUEST_ID_CHARS:
        raise _invalid("request_id", f"at most {MAX_REQUEST_ID_CHARS} characters, got {len(request_id)}")
    request = generate_pb2.GenerateRequest(sampling=sampling_to_proto(sampling))
    if model:
        request.model = model
    if request_id is not None:
        request.request_id = request_id
    if prompt.text is not None:
        request.text = prompt.text
    elif prompt.messages is not None:
        request.chat.messages.extend(
            generate_pb2.ChatMessage(role=m.role, content=m.content) for m in prompt.messages
        )
    else:
        try:
            request.token_ids.ids.extend(prompt.token_ids or ())
        except (TypeError, ValueError) as exc:
            raise _invalid("token_ids", f"must be non-negative integers < 2^32 ({exc})") from None
    return request


def _logprob(message: generate_pb2.TokenLogprob) -> TokenLogprob:
    top = tuple(TopLogprob(t.token_id, t.logprob) for t in message.top)
    return TokenLogprob(message.token_id, message.logprob, top)


def delta_from_proto(message: generate_pb2.Delta) -> GenerationDelta:
    return GenerationDelta(
        token_ids=tuple(message.token_ids),
        text=message.text,
        logprobs=tuple(_logprob(lp) for lp in message.logprobs),
        prompt_logprobs=tuple(_logprob(lp) for lp in message.prompt_logprobs),
    )


class ResultBuilder:
    """Joins the deltas of one stream; `finish` turns the Final message into the whole GenerationResult."""

    def __init__(self) -> None:
        self._token_ids: list[int] = []
        self._text: list[str] = []
        self._logprobs: list[TokenLogprob] = []
        self._prompt_logprobs: tuple[TokenLogprob, ...] = ()

    def add(self, delta: GenerationDelta) -> None:
        self._token_ids.extend(delta.token_ids)
        self._text.append(delta.text)
        self._logprobs.extend(delta.logprobs)
        self._prompt_logprobs = self._prompt_logprobs or delta.prompt_logprobs

    def finish(self, final: generate_pb2.Final) -> GenerationResult:
        if final.finish_reason not in _FINISH_REASONS:
            raise Internal(
                grpc.StatusCode.INTERNAL, f"final message has no finish reason ({final.finish_reason})"
            )
        stop_kind = final.WhichOneof("stop_reason")
        stop_reason: str | int | None = getattr(final, stop_kind) if stop_kind else None
        return GenerationResult(
            request_id=final.request_id,
            text="".join(self._text),
            token_ids=tuple(self._token_ids),
            prompt_token_ids=tuple(final.prompt_token_ids),
            finish_reason=_FINISH_REASONS[final.finish_reason],
            usage=Usage(
                final.usage.prompt_tokens, final.usage.completion_tokens, final.usage.cached_prompt_tokens
            ),
            timings=Timings(
                final.timings.queue_seconds,
                final.timings.time_to_first_token_seconds,
                final.timings.e2e_seconds,
            ),
            logprobs=tuple(self._logprobs),
            stop_reason=stop_reason,
            prompt_logprobs=self._prompt_logprobs,
        )


def event_from_proto(
    message: generate_pb2.GenerateResponse, builder: ResultBuilder
) -> GenerationDelta | GenerationResult:
    """One stream message as the SDK yields it: a delta (also recorded in builder) or the final result."""
    kind = message.WhichOneof("kind")
    if kind == "delta":
        delta = delta_from_proto(message.delta)
        builder.add(delta)
        return delta
    if kind == "final":
        return builder.finish(message.final)
    raise Internal(grpc.StatusCode.INTERNAL, "stream message carries neither a delta nor a final result")


def stream_ended_early() -> Internal:
    return Internal(grpc.StatusCode.INTERNAL, "the stream ended without a final message")


def models_from_proto(message: generate_pb2.ListModelsResponse) -> tuple[ModelInfo, ...]:
    return tuple(ModelInfo(m.id, m.max_model_len, m.vocab_size) for m in message.models)


def _worker(message: admin_pb2.WorkerInfo) -> WorkerInfo:
    return WorkerInfo(
        worker_id=message.worker_id,
        role=_ROLES.get(message.role, WorkerRole.UNSPECIFIED),
        address=message.address,
        state=_STATES.get(message.state, WorkerState.UNSPECIFIED),
        kv_blocks_used=message.kv_blocks_used,
        kv_blocks_total=message.kv_blocks_total,
        running_requests=message.running_requests,
        waiting_requests=message.waiting_requests,
        active_leases=message.active_leases,
        last_heartbeat_age_seconds=message.last_heartbeat_age_seconds,
        queued_prefill_tokens=message.queued_prefill_tokens,
        model=message.model,
        requests_total=message.requests_total,
        node_id=message.node_id,
        kv_transports=tuple(_transport_name(t) for t in message.kv_transports),
        busy_seconds_total=message.busy_seconds_total,
        devices=message.devices,
    )


def _transport_name(value: int) -> str:
    """KV_TRANSPORT_CUDA_IPC -> "cuda_ipc" (the config's spelling); an unknown value as its number."""
    try:
        return kv_pb2.KVTransport.Name(value).removeprefix("KV_TRANSPORT_").lower()
    except ValueError:
        return str(value)


def pools_from_proto(pools: Iterable[admin_pb2.PoolSize]) -> tuple[PoolInfo, ...]:
    return tuple(
        PoolInfo(
            _ROLES.get(p.role, WorkerRole.UNSPECIFIED), p.target, p.ready, p.starting, p.draining, p.waiting
        )
        for p in pools
    )


def status_from_proto(message: admin_pb2.ClusterStatus) -> ClusterStatus:
    pairs = tuple(
        ActivePair(p.prefill_worker_id, p.decode_worker_id, p.kv_transport, p.nodes, p.requests)
        for p in message.router.active_pairs
    )
    router = RouterInfo(message.router.queued_requests, message.router.in_flight_requests, pairs)
    workers = tuple(_worker(w) for w in message.workers)
    return ClusterStatus(
        workers=workers,
        router=router,
        pools=pools_from_proto(message.pools),
        autoscaler=message.autoscaler,
    )
