"""Tandem's client SDK: `Client` (blocking) and `AsyncClient` (asyncio) over the tandem.v1 gRPC API.

Needs only grpc, protobuf and the generated stubs in tandem_api; the `tandem` command line lives in
tandem_cli.cli.
"""

from tandem_client.aio import AsyncClient, AsyncGenerationStream
from tandem_client.channel import DEFAULT_ADDRESS
from tandem_client.client import Client, GenerationStream
from tandem_client.errors import (
    Aborted,
    Cancelled,
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    TandemError,
    Unauthenticated,
    Unavailable,
)
from tandem_client.tls import TLSError, TLSFiles, tls_credentials
from tandem_client.types import (
    ActivePair,
    ChatMessage,
    ClusterStatus,
    FinishReason,
    GenerationDelta,
    GenerationResult,
    MessageInput,
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

__all__ = [
    "DEFAULT_ADDRESS",
    "Aborted",
    "ActivePair",
    "AsyncClient",
    "AsyncGenerationStream",
    "Cancelled",
    "ChatMessage",
    "Client",
    "ClusterStatus",
    "DeadlineExceeded",
    "FinishReason",
    "GenerationDelta",
    "GenerationResult",
    "GenerationStream",
    "Internal",
    "InvalidArgument",
    "MessageInput",
    "ModelInfo",
    "NotFound",
    "PoolInfo",
    "Prompt",
    "ResourceExhausted",
    "RouterInfo",
    "Sampling",
    "TLSError",
    "TLSFiles",
    "TandemError",
    "Timings",
    "TokenLogprob",
    "TopLogprob",
    "Unauthenticated",
    "Unavailable",
    "Usage",
    "WorkerInfo",
    "WorkerRole",
    "WorkerState",
    "tls_credentials",
]
