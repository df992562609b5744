"""The OpenAI-compatible HTTP API: an adapter in the router process, on its own port, over the same request
pipeline as gRPC (router.pipeline).

Module map: server (OpenAIServer: the aiohttp application, routes, server-sent events), requests (a JSON body ->
the router's GenerateRequest), responses (GenerateResponse messages -> OpenAI's JSON objects), errors (gRPC
codes -> HTTP statuses and OpenAI's error object).
"""

from router.openai_api.server import OpenAIServer

__all__ = ["OpenAIServer"]
