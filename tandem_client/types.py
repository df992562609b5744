"""The SDK's typed values: what a caller sends (Prompt, Sampling) and what comes back (results, status).

All frozen dataclasses; protobuf stays inside tandem_client.wire.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TypeAlias, TypedDict

import grpc

from tandem_client.errors import InvalidArgument


def _bad(field: str, problem: str) -> InvalidArgument:
    return InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {problem}")


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str

    @classmethod
    def of(cls, message: ChatMessage | Mapping[str, object], where: str = "message") -> ChatMessage:
        """A ChatMessage, or a plain {"role": ..., "content": ...} dict as OpenAI clients write them (other keys,
        such as "name", are ignored)."""
        if isinstance(message, ChatMessage):
            return message
        if not isinstance(message, Mapping):
            raise _bad(
                where, f"must be a ChatMessage or a {{'role', 'content'}} dict, got {type(message).__name__}"
            )
        role, content = message.get("role"), message.get("content")
        for key, value in (("role", role), ("content", content)):
            if not isinstance(value, str):
                raise _bad(f"{where}.{key}", f"must be a string, got {type(value).__name__}")
        return cls(str(role), str(content))


# What the SDK's messages= takes: ChatMessage objects or plain dicts, mixed as the caller likes.
MessageInput: TypeAlias = ChatMessage | Mapping[str, object]


@dataclass(frozen=True)
class Prompt:
    """Exactly one of text, messages (a chat, rendered with the model's template) or token_ids."""

    text: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        given = [f.name for f in fields(self) if getattr(self, f.name) is not None]
        if len(given) != 1:
            raise _bad("prompt", f"give exactly one of text, messages, token_ids (got {given or 'none'})")
        if self.messages is not None and not self.messages:
            raise _bad("messages", "must hold at least one message")
        if self.token_ids is not None and not self.token_ids:
            raise _bad("token_ids", "must hold at least one token id")

    @classmethod
    def of(
        cls,
        prompt: str | Prompt | None = None,
        messages: Sequence[MessageInput] | None = None,
        token_ids: Sequence[int] | None = None,
    ) -> Prompt:
        """The Prompt for the SDK's (prompt | messages= | token_ids=) arguments."""
        if isinstance(prompt, Prompt):
            if messages is not None or token_ids is not None:
                raise _bad("prompt", "pass either a Prompt or messages/token_ids, not both")
            return prompt
        if isinstance(messages, (str, Mapping)):
            raise _bad("messages", "must be a list of messages, not one message")
        return cls(
            text=prompt,
            messages=None
            if messages is None
            else tuple(ChatMessage.of(m, f"messages[{i}]") for i, m in enumerate(messages)),
            token_ids=None if token_ids is None else tuple(token_ids),
        )


class SamplingFields(TypedDict, total=False):
    """Keyword arguments that Client.generate/stream accept; see Sampling."""

    temperature: float
    top_p: float
    top_k: int
    seed: int
    max_tokens: int
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    logprobs: int
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...]
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    prompt_logprobs: int


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters; None means "the server's default". Ranges are checked by the server (or engine)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    # token id -> bias in [-100, 100] added to its logit before each token is chosen; a mapping is accepted and
    # kept as (id, bias) pairs
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()
    # OpenAI's penalties on the tokens generated so far, each in [-2, 2] (None: 0, off)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # vLLM's repetition penalty on the prompt's and the output's tokens, in (0, 10] (None: 1, off)
    repetition_penalty: float | None = None
    # score the prompt: each prompt token after the first with its logprob and this many alternatives (0-20);
    # max_tokens=0 then scores without generating
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        # Accept a single stop string and lists for convenience; store tuples so the value stays hashable.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        pairs = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(tuple(pair) for pair in pairs))


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's log-probability and the top-n alternatives, most likely first."""

    token_id: int
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class GenerationDelta:
    """Tokens produced since the previous delta; `text` may lag token_ids by an incomplete UTF-8 character."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    # the first delta of a request that asked for prompt_logprobs: prompt tokens 1..n-1 (token_id is the prompt's)
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


@dataclass(frozen=True)
class Timings:
    """Seconds, measured by the router from the request's arrival."""

    queue_seconds: float
    time_to_first_token_seconds: float
    e2e_seconds: float


@dataclass(frozen=True)
class GenerationResult:
    """The whole result of one request (the joined deltas plus the final message)."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    prompt_token_ids: tuple[int, ...]
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    logprobs: tuple[TokenLogprob, ...] = ()
    # The stop string or token id that ended generation when finish_reason is STOP, else None.
    stop_reason: str | int | None = None
    # Sampling.prompt_logprobs: one entry per prompt token after the first
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class ModelInfo:
    id: str
    max_model_len: int
    vocab_size: int


class WorkerRole(enum.StrEnum):
    UNSPECIFIED = "unspecified"
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"


class WorkerState(enum.StrEnum):
    UNSPECIFIED = "unspecified"
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    DEAD = "dead"


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str
    role: WorkerRole
    address: str
    state: WorkerState
    kv_blocks_used: int
    kv_blocks_total: int
    running_requests: int
    waiting_requests: int
    active_leases: int
    last_heartbeat_age_seconds: float
    queued_prefill_tokens: int = 0
    model: str = ""
    requests_total: int = 0  # requests the worker accepted since it started
    node_id: str = ""  # its Ray node id (or host identity outside Ray); "" from an older worker
    kv_transports: tuple[str, ...] = ()  # KV transports its cache can use: "tcp", "nccl", "cuda_ipc"
    busy_seconds_total: float = 0.0  # seconds its engine spent running steps since it started
    devices: int = 0  # devices it spans (its tensor-parallel size); 0 from an older worker


@dataclass(frozen=True)
class RouterInfo:
    queued_requests: int
    in_flight_requests: int
    active_pairs: tuple[ActivePair, ...] = ()  # prefill/decode pairs with requests on them now


@dataclass(frozen=True)
class ActivePair:
    """A prefill/decode pair that requests run on now, with the KV transport it uses ("" when the router
    cannot tell) and whether both workers share a node ("same", "cross", "unknown")."""

    prefill_worker_id: str
    decode_worker_id: str
    kv_transport: str
    nodes: str
    requests: int


@dataclass(frozen=True)
class PoolInfo:
    """One pool as the controller sees it: the size asked for (`tandem scale`) and where its workers are."""

    role: WorkerRole
    target: int
    ready: int
    starting: int
    draining: int
    waiting: str = (
        ""  # why starting workers are not placed yet, e.g. after a node was lost ("" when none waits)
    )


@dataclass(frozen=True)
class ClusterStatus:
    workers: tuple[WorkerInfo, ...]
    router: RouterInfo
    pools: tuple[PoolInfo, ...] = ()  # empty from a router without a controller beside it
    autoscaler: str = ""  # the SLO autoscaler's last decision ("" when off or none yet)
