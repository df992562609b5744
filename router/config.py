"""`RouterConfig`: everything the router needs to know, validated once at start-up."""

from __future__ import annotations

import math
from dataclasses import dataclass

from model_runtime.weights.source import EMBEDDED_MODEL
from router.transport_choice import TRANSPORT_NAMES
from tandem_client.tls import ServerTLS, TLSFiles

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # long prompts' ids plus logprobs pass gRPC's 4 MiB default
# A JSON request body holds a prompt as text or token ids: 8 MiB is a 128k-token prompt several times over.
DEFAULT_HTTP_MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_STREAM_INTERVAL = 256  # output tokens per client message at most (RouterConfig.stream_interval)


class RouterConfigError(ValueError):
    """A router setting is out of range; the message starts with the field's name."""


@dataclass(frozen=True)
class RouterConfig:
    """Settings of one router. Times are seconds; counts are requests unless the name says tokens.

    host, port: where the public gRPC server listens (port 0: any free port, see RouterServer.start).
    model: the model spec (model_runtime.weights.resolve_model); the router loads only its tokenizer and config.
    max_model_len: prompt plus output tokens per request; None: the model's context. Workers must use the same.
    max_prompt_tokens: longest prompt accepted; None: max_model_len - 1 (room for one output token).
    default_max_tokens: max_tokens for requests that set none (clamped to what the context leaves).
    max_inflight: requests placed on workers at once; max_queue: accepted requests waiting for a slot.
      A request arriving when max_inflight + max_queue are taken gets RESOURCE_EXHAUSTED at once.
    request_timeout_s: deadline of a request whose client set none.
    poll_interval_s, poll_timeout_s: how often each worker's Status is polled, and how long one poll may take.
    dead_after_failed_polls: a worker that fails this many polls in a row is DEAD (skipped) until one succeeds.
    lease_ttl_s: the term of a decode worker's reservation: the decode call renews it while it waits for the
      prefill worker's KV (so a queued prompt keeps its room), and a transfer that began must land within it.
    worker_rpc_timeout_s: longest wait for a worker's control answer (the decode reservation).
    worker_retries: how many times one request is moved to other workers after a worker failed it (before its
      first token: a fresh start; after: a resume that re-prefills prompt + the tokens sent). Past it the
      client gets UNAVAILABLE.
    max_message_bytes: gRPC send/receive limit on the public server and on the worker channels.
    transfer_kinds: the deployment's transfer.kinds (KV transports allowed, in order of preference): a
      prefill/decode pair with none in common is not placed (router.transport_choice). (): not checked.
    local_prefill_max_tokens: a disaggregated request whose chosen decode worker would compute at most this many
      prompt tokens (short, or mostly in its prefix cache) is prefilled there, with no KV transfer; 0: never.
    local_prefill_max_queued_tokens: ... only while that worker's queued prompt tokens, this one included, stay
      within this (router.placement.LocalPrefill).
    local_prefill_spill_tokens: any prompt is prefilled on its decode worker when the least loaded prefill
      worker has at least this many prompt tokens queued and the decode worker's queue, this prompt included,
      stays within it (LocalPrefill.spill_queued_tokens); 0: never.
    stream_interval: output tokens the router gathers before it writes them to a client's stream (the first token
      and a finished request's last tokens go at once); 1: each step's tokens as they come. N cuts the router's
      messages, and its CPU per token, about N-fold at the cost of a burstier stream (router.relay).
    http_port: where the OpenAI-compatible HTTP API listens, on `host` (router.openai_api); None: not served,
      0: any free port (RouterServer.http_address says which).
    http_max_body_bytes: largest HTTP request body; a larger one gets 413.
    api_keys_file: the API key file (router.auth.keys: names, secrets, quotas, priority classes); None: no keys
      are asked for. When set, Generation (gRPC) and /v1 (HTTP) need `authorization: Bearer <key>`, and
      Admin.Scale needs an admin key.
    api_keys_reload_s: how often the key file's mtime is checked; a changed, valid file replaces the keys.
    tls: the public gRPC and HTTP APIs' certificate (and client CA); None: plaintext (a warning when `host` is
      not loopback).
    worker_tls: how the router dials workers (the cluster CA, its cluster certificate, the workers' certificate
      name); None: plaintext.
    """

    host: str = "127.0.0.1"
    port: int = 50051
    model: str = EMBEDDED_MODEL
    max_model_len: int | None = None
    max_prompt_tokens: int | None = None
    default_max_tokens: int = 256
    max_inflight: int = 256
    max_queue: int = 256
    request_timeout_s: float = 600.0
    poll_interval_s: float = 0.5
    poll_timeout_s: float = 1.0
    dead_after_failed_polls: int = 3
    lease_ttl_s: float = 30.0
    worker_rpc_timeout_s: float = 10.0
    worker_retries: int = 2
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    local_prefill_max_tokens: int = 0
    local_prefill_max_queued_tokens: int = 2048
    local_prefill_spill_tokens: int = 0
    stream_interval: int = 1
    http_port: int | None = None
    http_max_body_bytes: int = DEFAULT_HTTP_MAX_BODY_BYTES
    api_keys_file: str | None = None
    api_keys_reload_s: float = 2.0
    tls: ServerTLS | None = None
    worker_tls: TLSFiles | None = None
    transfer_kinds: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check(isinstance(self.host, str) and bool(self.host), "host", "must be a non-empty string")
        _check(_is_int(self.port) and 0 <= self.port <= 65535, "port", "must be an integer in [0, 65535]")
        _check(
            self.http_port is None or (_is_int(self.http_port) and 0 <= self.http_port <= 65535),
            "http_port",
            "must be None (no HTTP API) or an integer in [0, 65535]",
        )
        _check(isinstance(self.model, str) and bool(self.model.strip()), "model", "must be a model spec")
        for name in ("max_model_len", "max_prompt_tokens"):
            value = getattr(self, name)
            _check(value is None or (_is_int(value) and value >= 1), name, "must be None or an integer >= 1")
        for name in (
            "default_max_tokens",
            "max_inflight",
            "dead_after_failed_polls",
            "max_message_bytes",
            "http_max_body_bytes",
            "local_prefill_max_queued_tokens",
        ):
            _check(_is_int(getattr(self, name)) and getattr(self, name) >= 1, name, "must be an integer >= 1")
        _check(
            _is_int(self.stream_interval) and 1 <= self.stream_interval <= MAX_STREAM_INTERVAL,
            "stream_interval",
            f"must be an integer in [1, {MAX_STREAM_INTERVAL}] (output tokens per client message)",
        )
        for name in ("max_queue", "worker_retries", "local_prefill_max_tokens", "local_prefill_spill_tokens"):
            _check(_is_int(getattr(self, name)) and getattr(self, name) >= 0, name, "must be an integer >= 0")
        for name in (
            "request_timeout_s",
            "poll_interval_s",
            "poll_timeout_s",
            "lease_ttl_s",
            "worker_rpc_timeout_s",
            "api_keys_reload_s",
        ):
            value = getattr(self, name)
            _check(_is_number(value) and value > 0, name, "must be a finite number of seconds > 0")
        _check(
            self.api_keys_file is None or (isinstance(self.api_keys_file, str) and bool(self.api_keys_file)),
            "api_keys_file",
            "must be None (no API keys) or the path of the key file",
        )
        _check(self.tls is None or isinstance(self.tls, ServerTLS), "tls", "must be None or a ServerTLS")
        _check(
            self.worker_tls is None or isinstance(self.worker_tls, TLSFiles),
            "worker_tls",
            "must be None or TLSFiles",
        )
        _check(self.lease_ttl_s * 1000 < 2**32, "lease_ttl_s", "must fit in uint32 milliseconds")
        known = sorted(TRANSPORT_NAMES.values())
        _check(
            isinstance(self.transfer_kinds, tuple)
            and all(kind in known for kind in self.transfer_kinds)
            and len(set(self.transfer_kinds)) == len(self.transfer_kinds),
            "transfer_kinds",
            f"must be a tuple of distinct transports among {', '.join(known)}, got {self.transfer_kinds!r}",
        )

    @property
    def bind_address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def _check(ok: bool, field: str, problem: str) -> None:
    if not ok:
        raise RouterConfigError(f"{field}: {problem}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
