"""`RouterError`: a failure with the gRPC status the client gets. Raised anywhere in the router, turned into
`context.abort(code, details, trailing_metadata)` by the gRPC front door (router.servicers) and into an HTTP
status by the OpenAI one (router.openai_api.errors)."""

from __future__ import annotations

import math

import grpc

RETRY_AFTER_MS_KEY = "retry-after-ms"  # gRPC trailing metadata: milliseconds to wait before retrying


class RouterError(Exception):
    """The request ends with `code`; `details` is what the client reads (for bad input, it starts with the
    field path, e.g. "sampling.temperature: ..."). `retry_after_s`, when set, is how long the client should
    wait before trying again: gRPC sends it as trailing metadata `retry-after-ms`, HTTP as `Retry-After`."""

    def __init__(
        self,
        code: grpc.StatusCode,
        details: str,
        retry_after_s: float | None = None,
        *,
        quota: bool = False,
    ) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.retry_after_s = retry_after_s
        self.quota = quota  # RESOURCE_EXHAUSTED by the caller's own API-key quota, not the router's load

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        """What the gRPC front door sends with the status (the retry delay, when there is one)."""
        if self.retry_after_s is None:
            return ()
        return ((RETRY_AFTER_MS_KEY, str(max(1, math.ceil(self.retry_after_s * 1000)))),)


class ClientGone(Exception):
    """The client closed its connection while its request ran (a front door's write failed): the request ends
    as CANCELLED, and leaving the pipeline cancels its worker calls."""


def invalid(field: str, problem: str) -> RouterError:
    return RouterError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {problem}")
