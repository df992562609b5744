"""Tandem's router: the front door, gRPC and OpenAI-compatible HTTP (validation, tokenization, placement,
streaming).

Module map: config (RouterConfig), server (RouterServer: the grpc.aio server and its services, and the HTTP
API), servicers (Generation, Admin, RouterControl), pipeline (one request's path from admission to its last
message, shared by both front doors), openai_api (the OpenAI-compatible HTTP API over that pipeline),
validation (GenerateRequest -> ValidatedRequest), placement (which worker gets a request; pure), pool
(membership, channels, Status polling), dispatch (one request's life on the workers), streams (worker calls as
typed streams), responses (tokens -> Deltas and Final, stop rules), admission (bounded queue), metrics
(counting hooks), model (the served model's tokenizer and limits).

The router reaches workers only over gRPC and never imports torch, Ray or the worker packages.
"""

from router.config import RouterConfig, RouterConfigError
from router.metrics import RequestRecord, RouterMetrics
from router.model import ServedModel
from router.server import RouterServer

__all__ = [
    "RequestRecord",
    "RouterConfig",
    "RouterConfigError",
    "RouterMetrics",
    "RouterServer",
    "ServedModel",
]
