"""`RouterError`: a failure with the gRPC status the client gets. Raised anywhere in the router, turned into
`context.abort(code, details)` by the gRPC front door (router.servicers) and into an HTTP status by the OpenAI one
(router.openai_api.errors)."""

from __future__ import annotations

import grpc


class RouterError(Exception):
    """The request ends with `code`; `details` is what the client reads (for bad input, it starts with the
    field path, e.g. "sampling.temperature: ...")."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class ClientGone(Exception):
    """The client closed its connection while its request ran (a front door's write failed): the request ends
    as CANCELLED, and leaving the pipeline cancels its worker calls."""


def invalid(field: str, problem: str) -> RouterError:
    return RouterError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {problem}")
