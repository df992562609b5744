"""An OpenAI request body (JSON) -> the router's own `tandem.v1.GenerateRequest` plus how to answer it.

Only types and OpenAI-specific rules are checked here; every value rule (ranges, the vocabulary, the prompt's
length, the model) is the shared pipeline's (router.validation), so both front doors accept the same requests.

    POST /v1/completions       prompt (a string, or token ids; or a list of prompts, each either), max_tokens
    POST /v1/chat/completions  messages [{role, content}], max_completion_tokens or max_tokens
    completions                echo (the prompt before the completion; with logprobs, the prompt's tokens scored
                               too, the first with null; max_tokens 0 then scores the prompt alone); vLLM's
                               prompt_logprobs (0-20, not with stream: each prompt token's logprob and that many
                               alternatives, in the choice's prompt_logprobs)
    both                       model, temperature, top_p, seed, stop, n (1-64), user (ignored), stream,
                               stream_options.include_usage, logprobs (completions: top-n as an integer; chat:
                               true, with top_logprobs), logit_bias ({"token id": bias}), presence_penalty and
                               frequency_penalty (each in [-2, 2]), and vLLM's extensions top_k, ignore_eos,
                               stop_token_ids, repetition_penalty and return_token_ids

Unknown fields are ignored, as OpenAI's API does; known fields that would change the output in a way Tandem
cannot honour (chat's echo, suffix, best_of > 1, tools, a JSON response_format) are a 400 that says so, never
silently dropped.

n > 1 choices run as n requests of their own through the pipeline (each admitted, placed and counted as one),
with ids `<id>-<i>`; with a seed, choice i samples with seed + i, so that the choices differ and each is the
output a request with that seed alone would get. Without a seed they sample independently; greedy, they agree.
A completions request with a list of k prompts (as evaluation harnesses send them) is k * n choices the same
way, choice p * n + j being prompt p's j-th; k * n is at most MAX_CHOICES.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from router.openai_api.errors import bad_request
from tandem_api.tandem.v1 import generate_pb2

_NUMBER = (int, float)
MAX_CHOICES = 64  # n: each choice holds a place in admission as a request of its own
_SEED_RANGE = 2**63  # GenerateRequest's seed: [0, 2^63)
# Roles OpenAI clients send that the chat templates know by another name.
_ROLE_ALIASES = {"developer": "system"}
# Numeric sampling fields copied as they are (their ranges are the pipeline's checks).
_SCALARS = (
    ("temperature", _NUMBER),
    ("top_p", _NUMBER),
    ("top_k", int),
    ("seed", int),
    ("presence_penalty", _NUMBER),
    ("frequency_penalty", _NUMBER),
    ("repetition_penalty", _NUMBER),
)
# Known fields Tandem does not implement, and the value that means "not used".
_UNSUPPORTED = {
    "suffix": ("",),
    "best_of": (1,),
    "tools": ([],),
    "functions": ([],),
}


@dataclass(frozen=True)
class OpenAIRequest:
    """What the HTTP front door needs: the internal request and the answer's options."""

    message: generate_pb2.GenerateRequest
    chat: bool
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    logprobs: int | None  # top-n alternatives per token (0: the chosen token's only); None: no logprobs
    return_token_ids: bool  # vLLM's extension: token ids in each choice (and the prompt's in the response)
    max_tokens_field: str  # the name the client used, for error messages
    n: int = 1  # choices per prompt: requests of their own (choice_messages)
    echo: bool = False  # completions: the prompt comes before the completion (and its tokens' logprobs)
    # vLLM's extension (completions): each prompt token's logprob and this many alternatives, in the choice's
    # `prompt_logprobs` (whole responses only); None: not asked
    prompt_logprobs: int | None = None
    # completions with a list of prompts: the requests of prompts 1.. (`message` holds prompt 0)
    more_prompts: tuple[generate_pb2.GenerateRequest, ...] = ()

    @property
    def num_prompts(self) -> int:
        return 1 + len(self.more_prompts)

    @property
    def request_id(self) -> str:
        return self.message.request_id

    def prompt_of(self, choice: int) -> generate_pb2.GenerateRequest:
        """The request of the prompt that choice `choice` answers (choice p * n + j is prompt p's)."""
        return (self.message, *self.more_prompts)[choice // self.n]

    def choice_messages(self) -> list[generate_pb2.GenerateRequest]:
        """One internal request per choice: the message itself for one prompt and n = 1, else copies with ids
        `<id>-<p * n + j>` (prompt p's j-th choice) and, when a seed is set, seed + j (mod 2^63)."""
        if self.n == 1 and not self.more_prompts:
            return [self.message]
        messages = []
        for p, prompt in enumerate((self.message, *self.more_prompts)):
            for j in range(self.n):
                choice = generate_pb2.GenerateRequest()
                choice.CopyFrom(prompt)
                choice.request_id = f"{self.message.request_id}-{p * self.n + j}"
                if prompt.sampling.HasField("seed"):
                    choice.sampling.seed = (prompt.sampling.seed + j) % _SEED_RANGE
                messages.append(choice)
        return messages


def parse_completion(body: Mapping[str, Any]) -> OpenAIRequest:
    message = _common(body, chat=False)
    prompts = _prompts(body.get("prompt"))
    _check_unsupported(body)
    logprobs = _optional(body, "logprobs", int)
    echo = bool(_optional(body, "echo", bool))
    prompt_logprobs = _optional(body, "prompt_logprobs", int)
    max_tokens_field = _max_tokens(body, message, ("max_tokens",), allow_zero=echo)
    score_only = message.sampling.HasField("max_tokens") and message.sampling.max_tokens == 0
    # One request scores the prompt for echo's logprobs and for prompt_logprobs (the wider top-n); max_tokens 0
    # with echo is answered by the prompt's scores alone.
    asked = [n for n in (prompt_logprobs, logprobs if echo else None) if n is not None]
    if asked or (echo and score_only):
        param = "prompt_logprobs" if prompt_logprobs is not None else "logprobs"
        _set(message.sampling, "prompt_logprobs", max(asked, default=0), param)
    request = _finish(body, message, chat=False, logprobs=logprobs, max_tokens_field=max_tokens_field)
    if prompt_logprobs is not None and request.stream:
        raise bad_request("prompt_logprobs", "is not available with stream: true (as vLLM's)")
    request = dataclasses.replace(request, echo=echo, prompt_logprobs=prompt_logprobs)
    if len(prompts) * request.n > MAX_CHOICES:
        raise bad_request(
            "prompt", f"{len(prompts)} prompts x n = {request.n} make more than {MAX_CHOICES} choices"
        )
    messages = []
    for i, prompt in enumerate(prompts):
        one = message if i == 0 else generate_pb2.GenerateRequest()
        if i:
            one.CopyFrom(message)
        where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if isinstance(prompt, str):
            one.text = prompt
        else:
            one.ClearField("token_ids")
            _set_repeated(one.token_ids.ids, prompt, where)
        messages.append(one)
    return dataclasses.replace(request, more_prompts=tuple(messages[1:]))


def parse_chat(body: Mapping[str, Any]) -> OpenAIRequest:
    message = _common(body, chat=True)
    _messages(body.get("messages"), message)
    _check_unsupported(body)
    if _optional(body, "echo", bool):
        raise bad_request("echo", "is not supported for chat completions (got True)")
    if _optional(body, "prompt_logprobs", int) is not None:
        raise bad_request("prompt_logprobs", "is supported on /v1/completions only")
    rf = _optional(body, "response_format", dict)
    if rf is not None and rf.get("type", "text") != "text":
        raise bad_request("response_format", f"only {{'type': 'text'}} is supported, got {rf.get('type')!r}")
    wants = _optional(body, "logprobs", bool)
    top = _optional(body, "top_logprobs", int)
    if top is not None and not wants:
        raise bad_request("top_logprobs", "needs logprobs: true")
    logprobs = (top or 0) if wants else None
    max_tokens_field = _max_tokens(body, message, ("max_completion_tokens", "max_tokens"))
    return _finish(body, message, chat=True, logprobs=logprobs, max_tokens_field=max_tokens_field)


def _common(body: Mapping[str, Any], chat: bool) -> generate_pb2.GenerateRequest:
    prefix = "chatcmpl" if chat else "cmpl"
    message = generate_pb2.GenerateRequest(request_id=f"{prefix}-{uuid.uuid4().hex}")
    model = _optional(body, "model", str)
    if model:
        message.model = model
    _optional(body, "user", str)  # accepted for compatibility; the router keeps no per-user state
    sampling = message.sampling
    for name, kind in _SCALARS:
        value = _optional(body, name, kind)
        if value is not None:
            _set(sampling, name, value)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise bad_request("stop", f"must be a string or a list of strings, got {_kind(stop)}")
        sampling.stop.extend(stop)
    ids = _optional(body, "stop_token_ids", list)
    if ids is not None:
        if not all(_is_int(i) for i in ids):
            raise bad_request("stop_token_ids", "must be a list of integers")
        _set_repeated(sampling.stop_token_ids, ids, "stop_token_ids")
    sampling.ignore_eos = bool(_optional(body, "ignore_eos", bool))
    _logit_bias(body, sampling)
    return message


def _logit_bias(body: Mapping[str, Any], sampling: generate_pb2.SamplingParams) -> None:
    """logit_bias: {"token id": bias}, the ids as JSON object keys (strings of digits). The range of each bias
    and the vocabulary are the pipeline's checks."""
    bias = _optional(body, "logit_bias", dict)
    for key, value in (bias or {}).items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise bad_request("logit_bias", f"keys must be token ids (strings of digits), got {key!r}")
        if not isinstance(value, _NUMBER) or isinstance(value, bool):
            raise bad_request("logit_bias", f"token {key}: the bias must be a number, got {_kind(value)}")
        if int(key) >= 2**32:
            raise bad_request("logit_bias", f"token id {key} is outside the vocabulary")
        sampling.logit_bias[int(key)] = float(value)


def _finish(
    body: Mapping[str, Any],
    message: generate_pb2.GenerateRequest,
    *,
    chat: bool,
    logprobs: int | None,
    max_tokens_field: str,
) -> OpenAIRequest:
    if logprobs is not None:
        _set(message.sampling, "logprobs", logprobs, "top_logprobs" if chat else "logprobs")
    stream = bool(_optional(body, "stream", bool))
    options = _optional(body, "stream_options", dict) or {}
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise bad_request("stream_options.include_usage", f"must be a boolean, got {_kind(include_usage)}")
    n = _optional(body, "n", int)
    if n is not None and not 1 <= n <= MAX_CHOICES:
        raise bad_request("n", f"must be an integer in [1, {MAX_CHOICES}], got {n}")
    return OpenAIRequest(
        message=message,
        chat=chat,
        stream=stream,
        include_usage=stream and include_usage,
        logprobs=logprobs,
        return_token_ids=bool(_optional(body, "return_token_ids", bool)),
        max_tokens_field=max_tokens_field,
        n=n or 1,
    )


def _max_tokens(
    body: Mapping[str, Any],
    message: generate_pb2.GenerateRequest,
    names: tuple[str, ...],
    allow_zero: bool = False,
) -> str:
    """The first of `names` the client set becomes sampling.max_tokens; returns the name used. `allow_zero`:
    completions with echo, where 0 asks for the prompt alone."""
    for name in names:
        value = _optional(body, name, int)
        if value is not None:
            if value < (0 if allow_zero else 1):
                least = "0 (with echo)" if allow_zero else "1"
                raise bad_request(name, f"must be an integer >= {least}, got {value}")
            _set(message.sampling, "max_tokens", value, name)
            return name
    return names[0]


def _prompts(prompt: Any) -> list[str | list[int]]:
    """A string or a list of token ids, or a non-empty list of prompts, each either (a list of one is the same
    as the one)."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_int(i) for i in prompt)):
        return [prompt]
    if prompt is None:
        raise bad_request("prompt", "is required")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        for i, p in enumerate(prompt):
            if not isinstance(p, str) and not (p and all(_is_int(t) for t in p)):
                raise bad_request(f"prompt[{i}]", f"must be a string or a list of token ids, got {_kind(p)}")
        return list(prompt)
    raise bad_request("prompt", f"must be a string or a list of token ids, got {_kind(prompt)}")


def _messages(messages: Any, message: generate_pb2.GenerateRequest) -> None:
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages", f"must be a non-empty list of messages, got {_kind(messages)}")
    chat = message.chat.messages
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(where, f"must be an object with role and content, got {_kind(m)}")
        role = m.get("role")
        if not isinstance(role, str):
            raise bad_request(f"{where}.role", f"must be a string, got {_kind(role)}")
        chat.add(role=_ROLE_ALIASES.get(role, role), content=_content(m.get("content"), f"{where}.content"))


def _content(content: Any, where: str) -> str:
    """A string, or a list of text parts ({"type": "text", "text": ...}) joined; null is empty."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                kind = part.get("type") if isinstance(part, dict) else _kind(part)
                raise bad_request(f"{where}[{j}]", f"only text parts are supported, got {kind!r}")
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request(where, f"must be a string or a list of text parts, got {_kind(content)}")


def _check_unsupported(body: Mapping[str, Any]) -> None:
    for name, unused in _UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and not any(value == u and type(value) is type(u) for u in unused):
            raise bad_request(name, f"is not supported by this server (got {value!r})")


def _optional(body: Mapping[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    """body[name] when present and not null, after a type check (a JSON true is no number)."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) and kind is not bool:
        raise bad_request(name, f"must be {_kind_name(kind)}, got a boolean")
    if not isinstance(value, kind):
        raise bad_request(name, f"must be {_kind_name(kind)}, got {_kind(value)}")
    return value


def _set(target: Any, field: str, value: Any, param: str | None = None) -> None:
    """Protobuf refuses what its field cannot hold (a negative uint, 2^64): that is the client's 400."""
    try:
        setattr(target, field, value)
    except (TypeError, ValueError):
        raise bad_request(param or field, f"{value!r} is out of range") from None


def _set_repeated(target: Any, values: list[int], param: str) -> None:
    try:
        target.extend(values)
    except (TypeError, ValueError):
        bad = next((v for v in values if not 0 <= v < 2**32), values[0])
        raise bad_request(param, f"token id {bad!r} is outside the vocabulary") from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kind(value: Any) -> str:
    return {
        type(None): "null",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "an object",
    }.get(type(value), type(value).__name__)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    if kind == _NUMBER:
        return "a number"
    return {bool: "a boolean", int: "an integer", str: "a string", dict: "an object", list: "a list"}.get(
        kind if isinstance(kind, type) else kind[0], str(kind)
    )
