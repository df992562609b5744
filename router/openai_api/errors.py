"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with the HTTP status that goes
with it. The router's failures are gRPC codes (router.errors.RouterError); this is their one translation.

    INVALID_ARGUMENT, OUT_OF_RANGE -> 400    NOT_FOUND -> 404           RESOURCE_EXHAUSTED -> 429 + Retry-After
    UNAUTHENTICATED -> 401                   UNAVAILABLE -> 503 + Retry-After (no worker, draining)
    DEADLINE_EXCEEDED -> 504                 anything else -> 500

The router's messages name gRPC field paths ("sampling.temperature: must be ..."); `openai_param` renames the
path to the JSON field the client sent ("temperature"), so the message and `param` point at the same thing.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import grpc

from router.errors import RouterError

RETRY_AFTER_S = 1  # what a 429 or 503 asks the client to wait: admission frees up as requests end

_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
# gRPC field paths (router.validation) -> the JSON fields of a completion or chat request.
_SAMPLING_PARAMS = (
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "logprobs",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "prompt_logprobs",  # vLLM's (completions); echo's scores are asked with logprobs, whose own check comes first
)
_PATH = re.compile(r"^(?P<path>[a-z_]+(?:\.[a-z_]+)*(?:\[\d+\](?:\.[a-z_]+)?)?): (?P<rest>.*)$", re.DOTALL)


@dataclass
class ApiError(Exception):
    """One failed HTTP request: the status, and the body's error object. (Not frozen: raising sets attributes
    on an exception.)"""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    retry_after_s: float | None = None  # the router's own delay (a key's quota); else RETRY_AFTER_S

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        if self.status == 401:
            return {"WWW-Authenticate": 'Bearer realm="tandem"'}
        if self.status not in (429, 503):
            return {}
        wait = RETRY_AFTER_S if self.retry_after_s is None else max(1, math.ceil(self.retry_after_s))
        return {"Retry-After": str(wait)}  # whole seconds: RFC 9110 delay-seconds


def bad_request(param: str | None, problem: str) -> ApiError:
    message = f"{param}: {problem}" if param else problem
    return ApiError(400, message, param=param)


def from_router_error(exc: RouterError, chat: bool, max_tokens_field: str = "max_tokens") -> ApiError:
    status, kind = _STATUS.get(exc.code, (500, "server_error"))
    message, param = openai_param(exc.details, chat, max_tokens_field)
    code = {
        401: "invalid_api_key",
        404: "model_not_found",
        429: "rate_limit_exceeded" if exc.quota else "overloaded",
        503: "unavailable",
        504: "deadline_exceeded",
    }.get(status)
    param = param if status in (400, 404) else None
    return ApiError(status, message, kind, param, code, exc.retry_after_s)


def openai_param(details: str, chat: bool, max_tokens_field: str = "max_tokens") -> tuple[str, str | None]:
    """("sampling.top_p: must be ...", chat) -> ("top_p: must be ...", "top_p"); a message that names no
    known field comes back as it is, with param None."""
    match = _PATH.match(details)
    if match is None:
        return details, None
    path, rest = match["path"], match["rest"]
    param = _rename(path, chat, max_tokens_field)
    if param is None:
        return details, None
    return f"{param}: {rest}", param


def _rename(path: str, chat: bool, max_tokens_field: str) -> str | None:
    prompt = "messages" if chat else "prompt"
    if path in ("input", "input.text", "input.token_ids", "input.chat", "input.chat.messages"):
        return prompt
    if path.startswith("input.chat.messages["):
        return "messages" + path.removeprefix("input.chat.messages")
    if path == "sampling.max_tokens":
        return max_tokens_field
    if path.startswith("sampling."):
        name = path.removeprefix("sampling.")
        if name == "logprobs" and chat:
            return "top_logprobs"
        return name if name in _SAMPLING_PARAMS or name == "ignore_eos" else None
    if path in ("model", "request_id"):
        return path
    return None
