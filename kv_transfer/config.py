"""TransferConfig: which transport moves KV and how long every step may take.

One frozen dataclass, validated once; errors name the field (`transfer.<field>`) and the allowed range so a bad
YAML key or CLI flag fails at start-up. `model_runtime.config.dataclass_from_dict(TransferConfig, data,
"transfer")` builds it from a parsed YAML mapping.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

from model_runtime.config import ConfigError

MAX_LANES = 16  # transfer.nccl_lanes' upper bound; a hello naming a higher lane is refused

TRANSPORT_KINDS = ("tcp", "nccl", "cuda_ipc")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def _fail(name: str, msg: str) -> NoReturn:
    raise ConfigError(f"transfer.{name}: {msg}")


def _check_seconds(name: str, value: object, upper: float = 24 * 3600.0) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not 0 < value <= upper
    ):
        _fail(name, f"must be a number of seconds in (0, {upper:g}], got {value!r}")


def _check_kinds(value: object) -> tuple[str, ...]:
    """transfer.kinds as a tuple: a non-empty list of known transports, each named once, in order of preference."""
    if isinstance(value, str) or not isinstance(value, Sequence) or not value:
        _fail("kinds", f"must be a non-empty list of {', '.join(TRANSPORT_KINDS)}, got {value!r}")
    kinds: list[str] = []
    for kind in value:
        if not isinstance(kind, str) or kind not in TRANSPORT_KINDS:
            _fail("kinds", f"each entry must be one of {', '.join(TRANSPORT_KINDS)}, got {kind!r}")
        kinds.append(kind)
    if len(set(kinds)) != len(kinds):
        _fail("kinds", f"names a transport twice: {kinds}")
    return tuple(kinds)


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        _fail(name, f"must be an integer in [{low}, {high}], got {value!r}")


@dataclass(frozen=True)
class TransferConfig:
    """How a KVSender / KVReceiver moves blocks.

    kinds: the transports allowed, in order of preference: "tcp" (CPU or GPU caches, bytes over the control
        socket), "nccl" (GPU to GPU, two different GPUs), "cuda_ipc" (same node: the receiver copies from the
        sender's mapped cache; the GPUs may be the same). A worker holds each of them its device can use
        (kv_transfer.transport.held_kinds); the router picks one per pair and the request names it.
    kind: the older spelling of a one-element `kinds` (`kind: nccl` is `kinds: [nccl]`); after validation it
        is always `kinds[0]`, the first preference. Set one of the two.
    host, port: where a receiver listens (port 0 picks a free port). advertise_host: the address put in
        KVTargets; needed when host is a wildcard such as 0.0.0.0.
    connect_timeout_s: connecting plus the handshake; also how long an unclaimed connection may idle.
    transfer_timeout_s: a sender's default deadline for one handoff, from send() to the receiver's ack.
    lease_ttl_s: a receiver's default lease term: how long a reservation outlives its last renew() (the decode
        call renews it while it waits for the KV); once a sender claims it, what is left of the term bounds
        the transfer.
    pair_setup_timeout_s: NCCL communicator init / IPC handle exchange, once per (sender, receiver) pair.
    poll_interval_s: how often blocked reads, writes and GPU waits wake to check deadlines and aborts.
    chunk_bytes: tcp data is written in chunks of at most this size; aborts are seen between chunks.
    max_connections: open control connections a receiver serves at once; more are refused (RECEIVER_BUSY).
    max_inflight_sends: transfers a sender runs at once; more wait in its queue (their deadlines still run).
    idle_timeout_s: a receiver closes a control connection that carried no transfer this long; a sender stops
        reusing one after half of it (connections are kept open between transfers: a warm handoff is one
        round trip).
    layer_groups: the prefill worker ships a prompt's KV in this many layer groups, each as soon as the
        prompt's last step has written it, so the transfer overlaps the rest of the forward pass (the last
        group is the last layer alone: model_runtime.layer_stream.group_ends); 0 ships it all after the first
        token is sampled.
    nccl_lanes: how many nccl transfers a sender runs to one receiver at once, each on its own control
        connection, NCCL communicator and staging ring (192 MiB of GPU memory per lane and side, made when
        first needed). With one lane, a prompt whose KV is ready waits for the previous prompt's transfer
        to the same decode worker, which with layer groups holds the lane for the whole last prefill step.
    doorbell_slots: cuda_ipc: leases a receiver may hold armed at once per sender (kv_transfer.doorbell: the
        copies queued on the receiver's GPU at reservation, started by the sender's GPU); 0 turns doorbells off.
        Only a reservation that names its sender is armed.
    doorbell_capacity: the most blocks an armed lease may have (longer prompts go unarmed); the page of a pair
        takes doorbell_slots * doorbell_capacity * 8 bytes of pinned host memory on each side.
    """

    kinds: tuple[str, ...] = ()
    kind: str = ""
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str = ""
    connect_timeout_s: float = 5.0
    transfer_timeout_s: float = 30.0
    lease_ttl_s: float = 60.0
    pair_setup_timeout_s: float = 60.0
    poll_interval_s: float = 0.02
    chunk_bytes: int = 4 * 2**20
    max_connections: int = 64
    max_inflight_sends: int = 16
    idle_timeout_s: float = 300.0
    layer_groups: int = 4
    nccl_lanes: int = 2
    doorbell_slots: int = 16
    doorbell_capacity: int = 2048

    def __post_init__(self) -> None:
        self._resolve_kinds()
        if not isinstance(self.host, str) or (not self.host and not self.advertise_host):
            _fail("host", f"must be a host name or address, got {self.host!r}")
        if not isinstance(self.advertise_host, str):
            _fail("advertise_host", f"must be a string, got {self.advertise_host!r}")
        if self.host in WILDCARD_HOSTS and not self.advertise_host:
            _fail("advertise_host", f"required when host is the wildcard {self.host!r}: peers cannot dial it")
        _check_int("port", self.port, 0, 65535)
        for name in (
            "connect_timeout_s",
            "transfer_timeout_s",
            "lease_ttl_s",
            "pair_setup_timeout_s",
            "idle_timeout_s",
        ):
            _check_seconds(name, getattr(self, name))
        _check_seconds("poll_interval_s", self.poll_interval_s, upper=1.0)
        _check_int("chunk_bytes", self.chunk_bytes, 256, 2**30)
        _check_int("max_connections", self.max_connections, 1, 65536)
        _check_int("max_inflight_sends", self.max_inflight_sends, 1, 4096)
        _check_int("layer_groups", self.layer_groups, 0, 1024)
        _check_int("doorbell_slots", self.doorbell_slots, 0, 1024)
        _check_int("doorbell_capacity", self.doorbell_capacity, 1, 2**20)
        _check_int("nccl_lanes", self.nccl_lanes, 1, MAX_LANES)

    def _resolve_kinds(self) -> None:
        """Fill `kinds` from `kind` (or the default, tcp) and `kind` from `kinds`; frozen, so set once here."""
        if self.kind and self.kind not in TRANSPORT_KINDS:
            _fail("kind", f"must be one of {', '.join(TRANSPORT_KINDS)}, got {self.kind!r}")
        kinds = _check_kinds(self.kinds) if self.kinds != () else (self.kind or "tcp",)
        if self.kind and self.kind != kinds[0]:
            _fail("kind", f"{self.kind!r} disagrees with transfer.kinds {list(kinds)}: set one of the two")
        object.__setattr__(self, "kinds", kinds)
        object.__setattr__(self, "kind", kinds[0])

    @property
    def public_host(self) -> str:
        """The address peers dial: advertise_host when set, else host."""
        return self.advertise_host or self.host
