"""The data-plane seam: how a layer group of one request's blocks gets from the sender's cache into the
receiver's. The control conversation (kv.proto) is shared; transports differ only in how bytes move:

    tcp       bytes as chunks on the control socket (kv_transfer.tcp)
    nccl      one 2-rank NCCL communicator per (sender GPU, receiver GPU) pair (kv_transfer.nccl)
    cuda_ipc  the receiver copies from the sender's cache, mapped once per pair (kv_transfer.cuda_ipc)

Contract for every receiver transport: when receive_part returns or raises, nothing it started may still write
into the receiver's cache. The lease table relies on it to free blocks safely.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kv_transfer.config import TransferConfig
from kv_transfer.contracts import FailureReason, TransferFailed
from kv_transfer.frames import FrameConnection, Watch
from model_runtime.kv_layout import KVLayout
from tandem_api.tandem.v1 import kv_pb2


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


class ReceiverTransport(ABC):
    def pair_ready(self, peer_id: bytes) -> bool:
        """Whether per-pair state (communicator, mapped memory) with this sender is live."""
        return True

    def setup_pair(
        self, peer_id: bytes, setup: kv_pb2.KVPairSetup, conn: FrameConnection, watch: Watch
    ) -> None:
        """Build per-pair state from the sender's KVPairSetup and answer KVPairSetupAck."""
        raise TransferFailed(FailureReason.PROTOCOL_ERROR, "this transport takes no pair setup")

    @abstractmethod
    def receive_part(self, job: PartJob) -> None:
        """Write the part into job.block_ids; on return or raise no write may be pending."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release per-pair state; the receiver calls it once, after its sessions ended."""


class SenderTransport(ABC):
    def ensure_pair(  # noqa: B027 (optional hook)
        self, peer_id: bytes, peer_ready: bool, conn: FrameConnection, watch: Watch, since: float
    ) -> None:
        """Make per-pair state live before the first part, sending KVPairSetup when needed. peer_ready is the
        receiver's word in its KVHello; a pair this process set up after `since` (the monotonic time this
        transfer started) is fresher than that word, so concurrent first transfers set a pair up once."""

    @abstractmethod
    def send_part(self, job: PartJob) -> None:
        """Send the KVPart frame and ship the part's bytes; raise TransferFailed on any failure."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release per-pair state; the sender calls it once, after its transfers ended."""


def part_frame(job: PartJob) -> kv_pb2.KVFrame:
    """The KVPart frame that announces `job` to the receiver."""
    part = kv_pb2.KVPart(layer_begin=job.layer_begin, layer_end=job.layer_end, num_bytes=job.num_bytes)
    return kv_pb2.KVFrame(part=part)


def check_cache(layout: KVLayout, cache: torch.Tensor) -> None:
    """The cache tensor must be exactly the layout's: transports index and view it by KVLayout's shape."""
    if tuple(cache.shape) != layout.cache_shape:
        raise ValueError(f"cache: shape {tuple(cache.shape)} differs from the layout's {layout.cache_shape}")
    if cache.dtype != getattr(torch, layout.dtype):
        raise ValueError(f"cache: dtype {cache.dtype} differs from the layout's {layout.dtype}")
    if not cache.is_contiguous():
        raise ValueError("cache: must be contiguous")


def device_uuid(cache: torch.Tensor) -> str:
    """A stable name for the cache's GPU ("" on CPU): nccl refuses two ranks on one GPU."""
    if cache.device.type != "cuda":
        return ""
    return str(torch.cuda.get_device_properties(cache.device).uuid)


def make_receiver_transport(
    config: TransferConfig, layout: KVLayout, cache: torch.Tensor
) -> ReceiverTransport:
    check_cache(layout, cache)
    if config.kind == "tcp":
        from kv_transfer.tcp import TcpReceiverTransport

        return TcpReceiverTransport(layout, cache, config)
    if config.kind == "nccl":
        from kv_transfer.nccl import NcclReceiverTransport

        return NcclReceiverTransport(layout, cache, config)
    from kv_transfer.cuda_ipc import IpcReceiverTransport

    return IpcReceiverTransport(layout, cache, config)


def make_sender_transport(config: TransferConfig, layout: KVLayout, cache: torch.Tensor) -> SenderTransport:
    check_cache(layout, cache)
    if config.kind == "tcp":
        from kv_transfer.tcp import TcpSenderTransport

        return TcpSenderTransport(layout, cache, config)
    if config.kind == "nccl":
        from kv_transfer.nccl import NcclSenderTransport

        return NcclSenderTransport(layout, cache, config)
    from kv_transfer.cuda_ipc import IpcSenderTransport

    return IpcSenderTransport(layout, cache, config)
