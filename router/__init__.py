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

import importlib
from typing import Any

# The package's names resolve on first use (PEP 562), not at import: `import router.recent_latency` (the
# autoscaler's settings, which every worker process imports through deploy.config) would otherwise import the
# whole server, aiohttp and grpc.aio with it, about 0.7 s of CPU a process.
_EXPORTS = {
    "RequestRecord": "router.metrics",
    "RouterConfig": "router.config",
    "RouterConfigError": "router.config",
    "RouterMetrics": "router.metrics",
    "RouterServer": "router.server",
    "ServedModel": "router.model",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'router' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
