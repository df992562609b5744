"""The data-plane seam: how a layer group of one request's blocks gets from the sender's cache into the
receiver's. The control conversation (kv.proto) is shared; transports differ only in how bytes move:

    tcp       bytes as chunks on the control socket (kv_transfer.tcp)
    nccl      one 2-rank NCCL communicator per (sender GPU, receiver GPU) pair (kv_transfer.nccl)
    cuda_ipc  the receiver copies from the sender's cache, mapped once per pair (kv_transfer.cuda_ipc)

Per transfer a transport hands out a PartSource (sender) or PartSink (receiver). Parts may be left in flight
(queued GPU work) so that the next part's frames are read and its work queued meanwhile; `finish` waits until
every part is complete, `abandon` ends whatever is in flight after a failure.

Contract for every receiver transport: when PartSink.finish or PartSink.abandon returns (or raises), nothing the
sink started may still write into the receiver's cache; a sender's PartSource likewise stops reading the
sender's blocks. The lease table and the prefill worker rely on it to free blocks safely.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from kv_transfer.config import TransferConfig
from kv_transfer.contracts import FailureReason, TransferFailed
from kv_transfer.frames import FrameConnection, Watch
from model_runtime.config import ConfigError
from model_runtime.kv_layout import KVLayout
from tandem_api.tandem.v1 import kv_pb2

_T = TypeVar("_T", "ReceiverTransport", "SenderTransport")


@dataclass(frozen=True)
class PartJob:
    """One layer group [layer_begin, layer_end) of one request, as a transport sees it."""

    conn: FrameConnection
    watch: Watch
    peer_id: bytes  # the other side's instance id: the key of per-pair state
    request_id: str
    block_ids: tuple[int, ...]  # ours: the sender's source blocks or the receiver's destination blocks
    layer_begin: int
    layer_end: int
    num_bytes: int
    remote_block_ids: tuple[int, ...] = ()  # receiver, cuda_ipc: the sender's blocks to copy from
    ready: Any = None  # sender: a torch.cuda.Event recorded after the KV writes, or None (already complete)
    progress: Callable[[int], None] | None = None  # sender, tcp: called with the bytes written so far
    # This side's heads (begin, count) that the transfer moves, in its own cache; None: every head. Set for a
    # piece of a handoff between tensor-parallel workers of different sizes (kv_transfer.shard_plan).
    heads: tuple[int, int] | None = None
    # sender, cuda_ipc: (slot, generation) of the receiver's doorbell this transfer rings (kv_transfer.doorbell)
    armed: tuple[int, int] | None = None

    def layout(self, whole: KVLayout) -> KVLayout:
        """The layout of what this job moves: `whole`, or the window of its heads."""
        return window_layout(whole, self.heads)


def window_layout(layout: KVLayout, heads: tuple[int, int] | None) -> KVLayout:
    """What a transfer of `heads` (begin, count) of a cache of `layout` moves; the cache itself for None."""
    return layout if heads is None else layout.head_window(*heads)


class PartSink(ABC):
    """One transfer's parts on the receiver, in wire order."""

    @abstractmethod
    def part(self, job: PartJob) -> None:
        """Start writing the part into job.block_ids (it may still be in flight on return)."""

    def finish(self, watch: Watch, conn: FrameConnection) -> None:  # noqa: B027 (optional hook)
        """Return once every part landed; raise on the deadline or a peer's abort (then call abandon)."""

    def abandon(self) -> None:  # noqa: B027 (optional hook)
        """After a failure: return only when no write of this transfer is pending."""

    def discard(
        self, layer_begin: int, layer_end: int, num_blocks: int, heads: tuple[int, int] | None = None
    ) -> None:
        """Take in a part of a refused transfer (of `heads`, as its KVBegin said) without writing the cache
        (a drain sink only)."""
        raise NotImplementedError


class PartSource(ABC):
    """One transfer's parts on the sender, in the order the caller queued them."""

    @abstractmethod
    def part(self, job: PartJob) -> None:
        """Send the KVPart frame and start shipping the part's bytes; raise TransferFailed on any failure."""

    def finish(self, watch: Watch) -> None:  # noqa: B027 (optional hook)
        """After the receiver's ack: return once no read of the sender's blocks is pending."""

    def abandon(self) -> None:  # noqa: B027 (optional hook)
        """After a failure: return only when no read of the sender's blocks is pending."""


class _SyncSink(PartSink):
    """A sink over a transport whose receive_part completes each part before returning (tcp)."""

    def __init__(self, transport: ReceiverTransport) -> None:
        self._transport = transport

    def part(self, job: PartJob) -> None:
        self._transport.receive_part(job)


class _SyncSource(PartSource):
    def __init__(self, transport: SenderTransport) -> None:
        self._transport = transport

    def part(self, job: PartJob) -> None:
        self._transport.send_part(job)


class ReceiverTransport:  # hooks with defaults: a transport overrides what it needs
    exclusive = False  # one transfer at a time per pair: a sender drives several pairs with it (lanes)

    def pair_ready(self, peer_id: bytes) -> bool:
        """Whether per-pair state (communicator, mapped memory) with this sender is live."""
        return True

    def setup_pair(
        self, peer_id: bytes, setup: kv_pb2.KVPairSetup, conn: FrameConnection, watch: Watch
    ) -> None:
        """Build per-pair state from the sender's KVPairSetup and answer KVPairSetupAck."""
        raise TransferFailed(FailureReason.PROTOCOL_ERROR, "this transport takes no pair setup")

    def sink(self, peer_id: bytes) -> PartSink:
        """The parts of one transfer from this peer (default: each completes inside receive_part)."""
        return _SyncSink(self)

    def receive_part(self, job: PartJob) -> None:
        """Write the part into job.block_ids; on return or raise no write may be pending (for _SyncSink)."""
        raise NotImplementedError

    def drain_sink(self, peer_id: bytes) -> PartSink | None:
        """A sink that takes in a refused transfer (discard, then finish) so that the connection and the pair
        stay in step, or None when this transport cannot (the connection is closed instead)."""
        return None

    def close(self) -> None:
        """Release per-pair state; the receiver calls it once, after its sessions ended."""


class SenderTransport:  # hooks with defaults: a transport overrides what it needs
    # True when a pair carries one transfer at a time (nccl: the receives must be posted in the order of the
    # sends, and one connection's frame order is that order). The channel pool then opens at most
    # transfer.nccl_lanes connections to one receiver, each with a pair of its own (pairing.pair_key).
    exclusive: bool = False

    def ensure_pair(
        self, peer_id: bytes, peer_ready: bool, conn: FrameConnection, watch: Watch, since: float
    ) -> None:
        """Make per-pair state live before the first part, sending KVPairSetup when needed. peer_ready is the
        receiver's word in its KVHello; a pair this process set up after `since` (the monotonic time this
        transfer started) is fresher than that word, so concurrent first transfers set a pair up once."""

    def source(self, peer_id: bytes) -> PartSource:
        """The parts of one transfer to this peer (default: each completes inside send_part)."""
        return _SyncSource(self)

    def send_part(self, job: PartJob) -> None:
        """Send the KVPart frame and ship the part's bytes; raise TransferFailed on any failure."""
        raise NotImplementedError

    def close(self) -> None:
        """Release per-pair state; the sender calls it once, after its transfers ended."""


def part_frame(job: PartJob) -> kv_pb2.KVFrame:
    """The KVPart frame that announces `job` to the receiver."""
    part = kv_pb2.KVPart(layer_begin=job.layer_begin, layer_end=job.layer_end, num_bytes=job.num_bytes)
    return kv_pb2.KVFrame(part=part)


def check_cache(layout: KVLayout, cache: torch.Tensor) -> None:
    """The cache tensor must be exactly the layout's: transports index and view it by KVLayout's shape."""
    if tuple(cache.shape) != layout.cache_shape:
        raise ValueError(f"cache: shape {tuple(cache.shape)} differs from the layout's {layout.cache_shape}")
    if cache.dtype != getattr(torch, layout.dtype):  # float8_e4m3fn is torch's name too
        raise ValueError(f"cache: dtype {cache.dtype} differs from the layout's {layout.dtype}")
    if not cache.is_contiguous():
        raise ValueError("cache: must be contiguous")


def byte_cache(cache: torch.Tensor) -> torch.Tensor:
    """The cache as transports handle it. An FP8 cache travels as its bytes (a uint8 view of the same memory):
    the handoff copies codes, never values, and CPU torch has no FP8 index_copy_."""
    return cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache


def device_uuid(cache: torch.Tensor) -> str:
    """A stable name for the cache's GPU ("" on CPU): nccl refuses two ranks on one GPU."""
    if cache.device.type != "cuda":
        return ""
    return str(torch.cuda.get_device_properties(cache.device).uuid)


def device_transports(cache: torch.Tensor) -> tuple[str, ...]:
    """The transports a cache on this device can use, whatever the config allows: tcp anywhere; cuda_ipc with a
    CUDA GPU; nccl with a CUDA GPU where torch was built with NCCL. Whether a pair can use them also depends on
    the peer (same node for cuda_ipc, another GPU for nccl): router.transport_choice decides that."""
    if cache.device.type != "cuda":
        return ("tcp",)
    nccl = torch.distributed.is_available() and torch.distributed.is_nccl_available()
    return ("tcp", "nccl", "cuda_ipc") if nccl else ("tcp", "cuda_ipc")


def held_kinds(config: TransferConfig, cache: torch.Tensor) -> tuple[str, ...]:
    """The transports a worker holds: those of config.kinds that its cache's device can use, in the config's order
    (the first is its default). One config may serve CPU and GPU workers alike: each holds what it can. None at
    all is a ConfigError naming transfer.kinds."""
    usable = device_transports(cache)
    kinds = tuple(kind for kind in config.kinds if kind in usable)
    if not kinds:
        raise ConfigError(
            f"transfer.kinds: none of {list(config.kinds)} works with a KV cache on {cache.device} "
            f"(it can use {', '.join(usable)})"
        )
    return kinds


def make_receiver_transports(
    config: TransferConfig, layout: KVLayout, cache: torch.Tensor
) -> dict[str, ReceiverTransport]:
    """One receiver transport per held kind (held_kinds), in order of preference."""
    check_cache(layout, cache)
    return _each_kind(
        config, cache, lambda kind: _receiver_transport(kind, config, layout, byte_cache(cache))
    )


def make_sender_transports(
    config: TransferConfig, layout: KVLayout, cache: torch.Tensor
) -> dict[str, SenderTransport]:
    """One sender transport per held kind (held_kinds), in order of preference."""
    check_cache(layout, cache)
    return _each_kind(config, cache, lambda kind: _sender_transport(kind, config, layout, byte_cache(cache)))


def _each_kind(config: TransferConfig, cache: torch.Tensor, make: Callable[[str], _T]) -> dict[str, _T]:
    made: dict[str, _T] = {}
    try:
        for kind in held_kinds(config, cache):
            made[kind] = make(kind)
    except BaseException:
        for transport in made.values():
            transport.close()
        raise
    return made


def _receiver_transport(
    kind: str, config: TransferConfig, layout: KVLayout, cache: torch.Tensor
) -> ReceiverTransport:
    if kind == "tcp":
        from kv_transfer.tcp import TcpReceiverTransport

        return TcpReceiverTransport(layout, cache, config)
    if kind == "nccl":
        from kv_transfer.nccl import NcclReceiverTransport

        return NcclReceiverTransport(layout, cache, config)
    from kv_transfer.cuda_ipc import IpcReceiverTransport

    return IpcReceiverTransport(layout, cache, config)


def _sender_transport(
    kind: str, config: TransferConfig, layout: KVLayout, cache: torch.Tensor
) -> SenderTransport:
    if kind == "tcp":
        from kv_transfer.tcp import TcpSenderTransport

        return TcpSenderTransport(layout, cache, config)
    if kind == "nccl":
        from kv_transfer.nccl import NcclSenderTransport

        return NcclSenderTransport(layout, cache, config)
    from kv_transfer.cuda_ipc import IpcSenderTransport

    return IpcSenderTransport(layout, cache, config)
