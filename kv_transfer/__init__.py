"""kv_transfer: the lease-based KV block handoff between a prefill worker (sender) and a decode worker (receiver).

Decode side: `KVReceiver.reserve()` -> `Lease`, `KVReceiver.target(lease)` -> `KVTarget` (kv.proto) for the
router; results arrive through `poll()` or `on_result`. Prefill side: `KVSender.send(target, ...)` ->
`SendHandle` (non-blocking), blocks released through `on_release`. Transports: tcp, nccl, cuda_ipc
(`TransferConfig.kinds`: one per worker for now; `transport.device_transports`: what a cache could use).
Module map: config, contracts (leases, results, reasons), frames (wire), pairing, leases (ownership), receiver
+ receive_session, sender + send_handle + send_session, transport (seam), tcp, nccl, cuda_ipc, cuda_events (GPU
waits), stats.
"""

from kv_transfer.config import TRANSPORT_KINDS, TransferConfig
from kv_transfer.contracts import (
    BlockAllocator,
    FailureReason,
    FirstToken,
    KVTransferError,
    Lease,
    NoRoom,
    SendResult,
    TransferFailed,
    TransferResult,
)
from kv_transfer.receiver import KVReceiver
from kv_transfer.send_handle import SendHandle
from kv_transfer.sender import KVSender
from kv_transfer.stats import TransferStats

__all__ = [
    "TRANSPORT_KINDS",
    "BlockAllocator",
    "FailureReason",
    "FirstToken",
    "KVReceiver",
    "KVSender",
    "KVTransferError",
    "Lease",
    "NoRoom",
    "SendHandle",
    "SendResult",
    "TransferConfig",
    "TransferFailed",
    "TransferResult",
    "TransferStats",
]
