"""kv_transfer: the lease-based KV block handoff between a prefill worker (sender) and a decode worker (receiver).

Decode side: `KVReceiver.reserve()` -> `Lease`, `KVReceiver.target(lease)` -> `KVTarget` (kv.proto) for the
router; results arrive through `poll()` or `on_result`. Prefill side: `KVSender.send(target, ...)` ->
`SendHandle` (non-blocking), blocks released through `on_release`. Transports: tcp, nccl, cuda_ipc
(`TransferConfig.kinds`: one per worker for now; `transport.device_transports`: what a cache could use).
Module map: config, contracts (leases, results, reasons), frames (wire), pairing, leases (ownership), receiver
+ receive_session, sender + send_handle + send_session, transport (seam), tcp, nccl, cuda_ipc, doorbell (cuda_ipc
copies queued at reservation and started by the sender's GPU) + ipc_bells (its pages per pair), cuda_events (GPU waits), stats.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kv_transfer.config import TRANSPORT_KINDS, TransferConfig
from kv_transfer.contracts import (
    BlockAllocator,
    FailureReason,
    FirstToken,
    HeadWindow,
    KVTransferError,
    Lease,
    NoRoom,
    SendResult,
    TransferFailed,
    TransferResult,
)
from kv_transfer.stats import TransferStats

if TYPE_CHECKING:
    from kv_transfer.receiver import KVReceiver
    from kv_transfer.send_handle import SendHandle
    from kv_transfer.sender import KVSender

# The ends of a handoff import torch: loaded on first use, so that a process reading the config (the `tandem
# serve` driver, the router) does not pay for torch it never touches.
_LAZY = {
    "KVReceiver": "kv_transfer.receiver",
    "KVSender": "kv_transfer.sender",
    "SendHandle": "kv_transfer.send_handle",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kv_transfer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "TRANSPORT_KINDS",
    "BlockAllocator",
    "FailureReason",
    "FirstToken",
    "HeadWindow",
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
