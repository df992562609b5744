"""Connection settings shared by Client and AsyncClient: address, API key, deadlines, message sizes, retries."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from tandem_client.tls import TLSFiles

DEFAULT_ADDRESS = "127.0.0.1:50051"
ADDRESS_ENV = "TANDEM_SERVER"
API_KEY_ENV = "TANDEM_API_KEY"
# gRPC's default receive limit is 4 MiB; a long prompt's token ids plus logprobs can pass that.
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_RETRIED_SERVICES = ("tandem.v1.Generation", "tandem.v1.Admin")

ChannelOption = tuple[str, int | str]


def resolve_address(address: str | None) -> str:
    """An explicit address, else $TANDEM_SERVER, else 127.0.0.1:50051."""
    return address or os.environ.get(ADDRESS_ENV) or DEFAULT_ADDRESS


def resolve_api_key(api_key: str | None) -> str | None:
    """An explicit key, else $TANDEM_API_KEY, else None (the router asks for none)."""
    return api_key or os.environ.get(API_KEY_ENV) or None


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries `api_key` (resolved as resolve_api_key does); () without one."""
    key = resolve_api_key(api_key)
    if key is None:
        return ()
    if key != key.strip() or not key.isprintable():
        raise ValueError("api_key: must be printable, without surrounding spaces")
    return (("authorization", f"Bearer {key}"),)


@dataclass(frozen=True)
class ChannelConfig:
    address: str
    timeout: float | None = None
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    retries: int = 2
    credentials: grpc.ChannelCredentials | None = None
    metadata: tuple[tuple[str, str], ...] = ()
    options: tuple[ChannelOption, ...] = ()

    def __post_init__(self) -> None:
        if self.timeout is not None and not self.timeout > 0:
            raise ValueError(f"timeout: must be > 0 seconds or None, got {self.timeout!r}")
        if self.max_message_bytes < 1:
            raise ValueError(f"max_message_bytes: must be >= 1, got {self.max_message_bytes!r}")
        if not 0 <= self.retries <= 4:
            raise ValueError(f"retries: must be in [0, 4], got {self.retries!r}")

    def deadline(self, timeout: float | None) -> float | None:
        """The gRPC timeout for one call: the call's own, else the client's default (None = no deadline)."""
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout: must be > 0 seconds, got {timeout!r}")
        return timeout if timeout is not None else self.timeout

    def grpc_options(self) -> list[ChannelOption]:
        options: list[ChannelOption] = [
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
        ]
        if self.retries:
            # gRPC retries transparently only until the server sends response headers, so a stream that has
            # produced tokens is never replayed; only UNAVAILABLE (nothing was done) is retried.
            options += [("grpc.enable_retries", 1), ("grpc.service_config", self._retry_service_config())]
        return options + list(self.options)

    def _retry_service_config(self) -> str:
        policy = {
            "maxAttempts": self.retries + 1,
            "initialBackoff": "0.1s",
            "maxBackoff": "2s",
            "backoffMultiplier": 2,
            "retryableStatusCodes": ["UNAVAILABLE"],
        }
        names = [{"service": s} for s in _RETRIED_SERVICES]
        return json.dumps({"methodConfig": [{"name": names, "retryPolicy": policy}]})


def make_config(
    address: str | None,
    timeout: float | None,
    max_message_bytes: int,
    retries: int,
    credentials: grpc.ChannelCredentials | None,
    metadata: Sequence[tuple[str, str]],
    options: Sequence[ChannelOption],
    api_key: str | None = None,
    tls: TLSFiles | None = None,
) -> ChannelConfig:
    """`api_key` (else $TANDEM_API_KEY) goes as `authorization: Bearer <key>` on every call, unless `metadata`
    already carries an authorization of its own. `tls` (else $TANDEM_TLS_CA / _CERT / _KEY / _SERVER_NAME,
    unless `credentials` are given) makes the channel TLS: its files are read here."""
    own = any(name.lower() == "authorization" for name, _ in metadata)
    if tls is not None and credentials is not None:
        raise ValueError("tls, credentials: give one of them (tls builds the credentials from PEM files)")
    if tls is None and credentials is None:
        tls = TLSFiles.from_env()
    extra: tuple[ChannelOption, ...] = ()
    if tls is not None:
        credentials = tls.channel_credentials()
        extra = tuple(tls.channel_options())
    return ChannelConfig(
        address=resolve_address(address),
        timeout=timeout,
        max_message_bytes=max_message_bytes,
        retries=retries,
        credentials=credentials,
        metadata=tuple(metadata) + (() if own else auth_metadata(api_key)),
        options=extra + tuple(options),
    )
