"""`RouterError`: a failure with the gRPC status the client gets. Raised anywhere in the router, turned into
`context.abort(code, details)` in one place (router.servicers)."""

from __future__ import annotations

import grpc


class RouterError(Exception):
    """The request ends with `code`; `details` is what the client reads (for bad input, it starts with the
    field path, e.g. "sampling.temperature: ...")."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


def invalid(field: str, problem: str) -> RouterError:
    return RouterError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {problem}")
