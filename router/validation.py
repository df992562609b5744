"""GenerateRequest (protobuf) -> `ValidatedRequest`: every field checked, the prompt tokenized, defaults resolved.

Three steps, so the server can run the middle one (tokenization, the only slow one) off the event loop:

    parsed = parse_request(message, model, config)      # fields, sampling, model, request id
    ids = encode_prompt(parsed, model.tokenizer)        # text / chat -> token ids
    request = check_lengths(parsed, ids, model, config) # prompt and max_tokens against the context

Each failure is a RouterError: INVALID_ARGUMENT whose details start with the field path (for example
"sampling.temperature: must be ..."), or NOT_FOUND for an unknown model (as generate.proto documents).

The rules every layer shares (vocabulary, room for output) come from model_runtime.request_rules; this module
names the client's fields and adds the router's own policies. Length policy (as vLLM): a prompt must leave
room for at least one output token, and an explicit max_tokens larger than what the context leaves is
rejected, not clamped, so a client never silently gets less than it asked for. When max_tokens is unset the
default is clamped to what the context leaves.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass

import grpc

from model_runtime.request import SamplingError, SamplingParams
from model_runtime.request_rules import EMPTY_PROMPT, out_of_vocab, prompt_leaves_no_room
from model_runtime.tokenizer import ChatMessage, ChatTemplateError, Tokenizer
from router.admission import Priority
from router.config import RouterConfig
from router.errors import RouterError, invalid
from router.model import ServedModel
from tandem_api.tandem.v1 import generate_pb2, worker_pb2

MAX_REQUEST_ID_CHARS = 128
# Roles a chat message may take. The template pastes the role into the prompt, so a free-form role could smuggle
# the template's own markers in; these are the roles the supported templates know.
CHAT_ROLES = ("system", "user", "assistant", "tool")
DEFAULT_TEMPERATURE = 1.0


@dataclass(frozen=True)
class ParsedRequest:
    """A request whose fields are valid; the prompt is not tokenized yet. Exactly one of text, messages and
    token_ids is set. sampling.max_tokens is the client's value, or the default when `max_tokens_given` is
    false (check_lengths clamps it then)."""

    request_id: str
    sampling: SamplingParams
    max_tokens_given: bool
    text: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    token_ids: tuple[int, ...] | None = None
    score_only: bool = False  # max_tokens 0 with prompt_logprobs (ValidatedRequest.score_only)

    @property
    def input_field(self) -> str:
        return "input.text" if self.text is not None else "input.chat" if self.messages else "input.token_ids"


@dataclass(frozen=True)
class ValidatedRequest:
    """What dispatch works with: every value resolved, nothing left to defaults. `priority` is the API key's
    class (interactive without keys); the workers' schedulers order their waiting prompts by it."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    priority: Priority = Priority.INTERACTIVE
    # max_tokens 0 with prompt_logprobs: score the prompt, generate nothing (the workers sample one token, which
    # the client never sees)
    score_only: bool = False


def validate_request(
    message: generate_pb2.GenerateRequest, model: ServedModel, config: RouterConfig
) -> ValidatedRequest:
    """All three steps in the calling thread (the server runs encode_prompt in an executor instead)."""
    parsed = parse_request(message, model, config)
    return check_lengths(parsed, encode_prompt(parsed, model.tokenizer), model, config)


def parse_request(
    message: generate_pb2.GenerateRequest, model: ServedModel, config: RouterConfig
) -> ParsedRequest:
    _check_model(message, model)
    request_id = _request_id(message)
    sampling, given = _sampling(message.sampling, model, config)
    score_only = given and message.sampling.max_tokens == 0
    kind = message.WhichOneof("input")
    if kind is None:
        raise invalid("input", "one of text, token_ids, chat is required")
    if kind == "text":
        if not message.text:
            raise invalid("input.text", "must not be empty")
        return ParsedRequest(request_id, sampling, given, text=message.text, score_only=score_only)
    if kind == "token_ids":
        ids = _token_ids(message.token_ids, model)
        return ParsedRequest(request_id, sampling, given, token_ids=ids, score_only=score_only)
    return ParsedRequest(request_id, sampling, given, messages=_messages(message.chat), score_only=score_only)


def encode_prompt(parsed: ParsedRequest, tokenizer: Tokenizer) -> list[int]:
    """Token ids of the prompt. Plain text gets the tokenizer's special tokens (BOS); a chat's template writes
    its own."""
    if parsed.token_ids is not None:
        return list(parsed.token_ids)
    if parsed.text is not None:
        return tokenizer.encode(parsed.text)
    try:
        return tokenizer.encode_chat(parsed.messages or ())
    except ChatTemplateError as exc:
        raise invalid("input.chat", str(exc)) from None


def check_lengths(
    parsed: ParsedRequest, prompt_ids: list[int], model: ServedModel, config: RouterConfig
) -> ValidatedRequest:
    n, context = len(prompt_ids), model.max_model_len
    if n == 0:
        raise invalid(parsed.input_field, "tokenizes to no tokens")
    no_room = prompt_leaves_no_room(n, context)
    if no_room is not None:
        raise invalid("input", no_room)
    if config.max_prompt_tokens is not None and n > config.max_prompt_tokens:
        raise invalid("input", f"{n} tokens exceed the router's limit of {config.max_prompt_tokens}")
    room = context - n
    sampling = parsed.sampling
    if not parsed.max_tokens_given:
        sampling = dataclasses.replace(sampling, max_tokens=min(sampling.max_tokens, room))
    elif sampling.max_tokens > room:
        raise invalid(
            "sampling.max_tokens",
            f"{sampling.max_tokens} plus the prompt's {n} tokens exceed the model's context of {context} "
            f"tokens; at most {room}",
        )
    return ValidatedRequest(parsed.request_id, tuple(prompt_ids), sampling, score_only=parsed.score_only)


WORKER_PRIORITY = {
    Priority.INTERACTIVE: worker_pb2.PRIORITY_CLASS_INTERACTIVE,
    Priority.BATCH: worker_pb2.PRIORITY_CLASS_BATCH,
}


def engine_sampling(sampling: SamplingParams) -> worker_pb2.EngineSampling:
    """The resolved sampling parameters as the workers receive them (stop strings stay in the router)."""
    message = worker_pb2.EngineSampling(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        max_tokens=sampling.max_tokens,
        stop_token_ids=list(sampling.stop_token_ids),
        ignore_eos=sampling.ignore_eos,
        logit_bias=dict(sampling.logit_bias),
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
    )
    if sampling.repetition_penalty != 1:
        message.repetition_penalty = sampling.repetition_penalty
    if sampling.seed is not None:
        message.seed = sampling.seed
    if sampling.logprobs is not None:
        message.logprobs = sampling.logprobs
    if sampling.prompt_logprobs is not None:
        message.prompt_logprobs = sampling.prompt_logprobs
    return message


def _check_model(message: generate_pb2.GenerateRequest, model: ServedModel) -> None:
    if message.HasField("model") and message.model and message.model != model.id:
        raise RouterError(
            grpc.StatusCode.NOT_FOUND, f"model: unknown model {message.model!r}; serving {model.id!r}"
        )


def _request_id(message: generate_pb2.GenerateRequest) -> str:
    if not message.HasField("request_id"):
        return uuid.uuid4().hex
    rid = message.request_id
    if not 1 <= len(rid) <= MAX_REQUEST_ID_CHARS:
        raise invalid("request_id", f"must be 1..{MAX_REQUEST_ID_CHARS} characters, got {len(rid)}")
    if not rid.isprintable():
        raise invalid("request_id", "must not contain control characters")
    return rid


def _sampling(
    message: generate_pb2.SamplingParams, model: ServedModel, config: RouterConfig
) -> tuple[SamplingParams, bool]:
    """SamplingParams validates the ranges; its errors name the parameter, so they get the "sampling." prefix.
    max_tokens 0 is a request to score the prompt only (prompt_logprobs set): SamplingParams then says 1."""
    given = message.HasField("max_tokens")
    scoring = message.HasField("prompt_logprobs")
    if given and message.max_tokens == 0 and not scoring:
        raise invalid(
            "sampling.max_tokens",
            "must be an integer >= 1, got 0 (0 only with prompt_logprobs: score the prompt)",
        )
    try:
        params = SamplingParams(
            temperature=message.temperature if message.HasField("temperature") else DEFAULT_TEMPERATURE,
            top_p=message.top_p if message.HasField("top_p") else 1.0,
            top_k=message.top_k if message.HasField("top_k") else 0,
            seed=message.seed if message.HasField("seed") else None,
            max_tokens=(message.max_tokens or 1) if given else config.default_max_tokens,
            stop=tuple(message.stop),
            stop_token_ids=tuple(message.stop_token_ids),
            ignore_eos=message.ignore_eos,
            logprobs=message.logprobs if message.HasField("logprobs") else None,
            logit_bias=tuple(sorted(message.logit_bias.items())),
            presence_penalty=message.presence_penalty,
            frequency_penalty=message.frequency_penalty,
            repetition_penalty=message.repetition_penalty if message.HasField("repetition_penalty") else 1.0,
            prompt_logprobs=message.prompt_logprobs if scoring else None,
        )
        params.check_vocab(model.vocab_size)
    except SamplingError as exc:
        # SamplingError messages start with the parameter's name: "temperature: must be ...".
        raise RouterError(grpc.StatusCode.INVALID_ARGUMENT, f"sampling.{exc}") from None
    return params, given


def _token_ids(message: generate_pb2.TokenIds, model: ServedModel) -> tuple[int, ...]:
    ids = tuple(message.ids)
    if not ids:
        raise invalid("input.token_ids", EMPTY_PROMPT)
    bad = out_of_vocab(ids, model.vocab_size)
    if bad is not None:
        raise invalid("input.token_ids", f"{bad} is outside the vocabulary [0, {model.vocab_size})")
    return ids


def _messages(message: generate_pb2.ChatMessages) -> tuple[ChatMessage, ...]:
    if not message.messages:
        raise invalid("input.chat.messages", "must hold at least one message")
    for i, m in enumerate(message.messages):
        if m.role not in CHAT_ROLES:
            raise invalid(
                f"input.chat.messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}; got {m.role!r}"
            )
    return tuple(ChatMessage(m.role, m.content) for m in message.messages)
