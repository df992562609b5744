"""The handoff's in-process contracts: leases, results, failure reasons, errors and the allocator seam."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol


class FailureReason(enum.Enum):
    """Why a transfer failed. Values and names mirror the KVFailure enum of kv.proto (a unit test checks)."""

    LAYOUT_MISMATCH = 1
    TRANSPORT_MISMATCH = 2
    PROTOCOL_ERROR = 3
    UNKNOWN_HANDLE = 4
    HANDLE_REUSED = 5
    HANDLE_MISMATCH = 6
    HANDLE_BUSY = 7
    DESCRIPTOR_MISMATCH = 8
    LEASE_EXPIRED = 9
    SENDER_ABORTED = 10
    RECEIVER_ABORTED = 11
    DEADLINE_EXCEEDED = 12
    CONNECT_FAILED = 13
    CONNECTION_LOST = 14
    PAIR_SETUP_FAILED = 15
    TRANSPORT_ERROR = 16
    RECEIVER_BUSY = 17
    SHUTDOWN = 18
    INTERNAL = 19


class KVTransferError(Exception):
    """Base class of the errors kv_transfer raises to its callers."""


class NoRoom(KVTransferError):
    """reserve() found fewer free blocks than the request needs; the router may wait or pick another worker."""

    def __init__(self, request_id: str, num_blocks: int) -> None:
        super().__init__(f"request {request_id!r}: no room for {num_blocks} KV blocks")
        self.request_id = request_id
        self.num_blocks = num_blocks


class TransferFailed(KVTransferError):
    """A transfer step failed for `reason`; raised inside sessions and transports, reported in results."""

    def __init__(self, reason: FailureReason, message: str, drained: bool = False) -> None:
        super().__init__(f"{reason.name}: {message}")
        self.reason = reason
        self.message = message
        self.drained = (
            drained  # the receiver's refusal consumed the transfer: connection and pair stay usable
        )


class BlockAllocator(Protocol):
    """The decode worker's block pool, as the receiver sees it.

    Both methods are called from kv_transfer's threads (the caller's thread for allocate, the reaper or a
    connection thread for free), so the implementation must be thread-safe.
    """

    def allocate(self, num_blocks: int) -> list[int] | None:
        """`num_blocks` distinct block ids now owned by the caller, or None when there is no room."""
        ...

    def free(self, block_ids: Sequence[int]) -> None:
        """Return blocks that allocate() handed out."""
        ...


# One reservation's own allocate (KVReceiver.reserve's `allocate`): BlockAllocator.allocate's contract.
Allocate = Callable[[int], list[int] | None]


@dataclass(frozen=True)
class FirstToken:
    """The token prefill sampled after the prompt; decode feeds it at position num_tokens."""

    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.token_id, bool) or not isinstance(self.token_id, int) or self.token_id < 0:
            raise ValueError(f"first_token.token_id: must be an integer >= 0, got {self.token_id!r}")


@dataclass(frozen=True)
class HeadWindow:
    """The heads one transfer moves when the two caches hold different heads of the model (tensor-parallel
    workers of different sizes, kv_transfer.shard_plan): heads [source_begin, source_begin + count) of the
    sender's cache into [target_begin, target_begin + count) of the receiver's."""

    source_begin: int
    target_begin: int
    count: int

    def __post_init__(self) -> None:
        if self.source_begin < 0 or self.target_begin < 0 or self.count < 1:
            raise ValueError(f"HeadWindow: begins must be >= 0 and count >= 1, got {self}")


@dataclass(frozen=True)
class Lease:
    """Blocks a receiver reserved for one request. `handle` is the credential; it stays out of repr and logs."""

    request_id: str
    handle: bytes = field(repr=False)
    block_ids: tuple[int, ...]
    num_tokens: int
    reserved_at: float  # time.monotonic()
    expires_at: float  # time.monotonic()
    transport: str = "tcp"  # the one transport a sender may deliver it over (the receiver holds it)


@dataclass(frozen=True)
class TransferResult:
    """The end of one lease on the receiver. ok: the blocks landed and now belong to the caller (the decode
    worker); otherwise the receiver already returned them to the allocator."""

    lease: Lease
    ok: bool
    failure: FailureReason | None = None
    message: str = ""
    first_token: FirstToken | None = None
    num_bytes: int = 0
    seconds: float = 0.0  # from the sender's claim (KVBegin) to landing; 0 when never claimed
    landed_at: float = 0.0  # time.monotonic() when the blocks became the caller's (0 unless ok)
    # seconds by phase: "claim" (KVBegin read -> lease claimed), "stream" (claimed -> KVDone read), "land"
    # (KVDone -> every write complete); and, within stream, this thread's "read" (blocked reading frames),
    # "post" (queueing the parts' GPU work) and "stream_cpu" (its CPU time)
    phases: dict[str, float] = field(default_factory=dict)
    armed: bool = False  # landed through a doorbell (kv_transfer.doorbell): copies queued at reservation

    @property
    def request_id(self) -> str:
        return self.lease.request_id


@dataclass(frozen=True)
class SendResult:
    """The end of one send on the prefill side. Its blocks were released (on_release) before this resolved."""

    request_id: str
    src_block_ids: tuple[int, ...]
    ok: bool
    failure: FailureReason | None = None
    message: str = ""
    num_bytes: int = 0
    seconds: float = 0.0  # from send()/open() to the receiver's ack (or the failure)
    # seconds by phase, summing to `seconds`: "queue" (waiting for a transfer thread), "connect" (a new
    # channel: connect, handshake, pair setup) or "channel" (a warm one, or the turn on it), "layers" (waiting
    # for the caller's layer groups), "stream" (frames and data out, KVDone included), "ack" (KVDone -> KVAck);
    # besides these, "tail": from the caller's finish() (the first token known) to the ack, what a transfer
    # overlapped with the prefill still adds after it
    phases: dict[str, float] = field(default_factory=dict)
