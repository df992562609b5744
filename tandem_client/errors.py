"""Exceptions the SDK raises: one class per gRPC status a caller can act on, all under TandemError.

Each class also derives from the matching built-in where there is one (InvalidArgument is a ValueError,
DeadlineExceeded a TimeoutError, Unavailable a ConnectionError), so generic handlers keep working.
"""

from __future__ import annotations

import grpc

RETRY_AFTER_MS_KEY = "retry-after-ms"  # trailing metadata the router sends with RESOURCE_EXHAUSTED


class TandemError(Exception):
    """A failed call. `code` is the gRPC status code, `details` the server's (or the SDK's) explanation,
    `retry_after_s` the delay the server asked for before a retry (None when it named none)."""

    def __init__(self, code: grpc.StatusCode, details: str, retry_after_s: float | None = None) -> None:
        super().__init__(f"{code.name}: {details}" if details else code.name)
        self.code = code
        self.details = details
        self.retry_after_s = retry_after_s


class InvalidArgument(TandemError, ValueError):
    """The request is malformed or out of range; `details` names the field. Retrying will not help."""


class NotFound(TandemError):
    """The named model (or other resource) does not exist on the server."""


class ResourceExhausted(TandemError):
    """No capacity now, the API key is over its quota, or a message exceeded the size limit. Retry after
    `retry_after_s` when the server gave one, or send less."""


class Unavailable(TandemError, ConnectionError):
    """The server (or every worker) is unreachable. Safe to retry with backoff before the first token."""


class DeadlineExceeded(TandemError, TimeoutError):
    """The call's deadline passed before it finished."""


class Cancelled(TandemError):
    """The call was cancelled (by the server, or by this client closing the stream)."""


class Aborted(TandemError):
    """The server gave up on a request after it had started (for example a worker died mid-stream)."""


class Unauthenticated(TandemError):
    """Missing or bad credentials (no API key, a wrong or revoked one, or not an admin key for Scale)."""


class Internal(TandemError):
    """A server bug or a broken stream (for example one that ended without its final message)."""


_BY_CODE: dict[grpc.StatusCode, type[TandemError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.ABORTED: Aborted,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: Unauthenticated,
    grpc.StatusCode.INTERNAL: Internal,
    grpc.StatusCode.DATA_LOSS: Internal,
}


def error_for_status(code: grpc.StatusCode, details: str, retry_after_s: float | None = None) -> TandemError:
    """The exception for a status code; codes without a class of their own give a plain TandemError."""
    return _BY_CODE.get(code, TandemError)(code, details, retry_after_s)


def error_from_rpc(error: grpc.RpcError) -> TandemError:
    """Translate a grpc (or grpc.aio) RpcError, which carries code(), details() and trailing_metadata()."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    return error_for_status(code or grpc.StatusCode.UNKNOWN, tls_hint(details or ""), _retry_after_s(error))


# What gRPC says when a TLS handshake fails: on this side (the server's certificate or name was not accepted),
# or on the server's, which just closes the connection ("Socket closed") and says why only in its own log.
_SERVER_REJECTED = ("CERTIFICATE_VERIFY_FAILED", "Hostname Verification", "Tls handshake failed")
TLS_HINT_SERVER = (
    " [TLS: the server's certificate was not accepted: check the CA (--tls-ca, $TANDEM_TLS_CA) and the name "
    "the certificate carries (--tls-server-name)]"
)
TLS_HINT_CLOSED = (
    " [the server closed the connection before answering: if it serves TLS, connect with --tls-ca "
    "($TANDEM_TLS_CA); if it requires client certificates, with --tls-cert/--tls-key from its client CA, "
    "unexpired; the server's log names the reason]"
)


def tls_hint(details: str) -> str:
    """`details` with what to check when they show a failed TLS handshake (unchanged otherwise)."""
    if any(marker in details for marker in _SERVER_REJECTED):
        return details + TLS_HINT_SERVER
    if details.endswith("Socket closed"):
        return details + TLS_HINT_CLOSED
    return details


def _retry_after_s(error: grpc.RpcError) -> float | None:
    metadata = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    for key, value in metadata or ():
        if key == RETRY_AFTER_MS_KEY:
            try:
                return max(0.0, int(value) / 1000)
            except (TypeError, ValueError):
                return None  # a malformed value says nothing usable
    return None
