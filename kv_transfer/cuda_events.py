"""Waiting on GPU work without ever blocking on it: the GPU transports' shared helpers.

A transfer thread never calls stream.synchronize() on communication work: a send whose peer died would block
it forever. It polls an event instead, checking its deadline and the control connection between polls.
Only purely local work (a gather or scatter kernel, a local copy) is ever waited on without a deadline.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from kv_transfer.contracts import FailureReason, TransferFailed
from kv_transfer.frames import FrameConnection, Watch, frame_failure

SPIN_S = 50e-6  # poll without sleeping this long first: a spinning thread holds the GIL the engine needs
MAX_SLEEP_S = 250e-6  # then sleep (GIL released) at most this long between polls: the overshoot of a wait


_bound = threading.local()


def bind_device(device: torch.device) -> None:
    """Make `device` current on this thread for torch and, when loaded, CuPy (CUDA's current device is per
    thread, and transfer threads are not the thread that created the cache). Once per thread and device: the
    calls release the interpreter lock, and a transfer thread pays for each release behind a busy engine loop."""
    if getattr(_bound, "device", None) == device:
        return
    torch.cuda.set_device(device)
    try:
        import cupy  # type: ignore[import-not-found]
    except ImportError:
        _bound.device = device
        return
    cupy.cuda.Device(device.index).use()
    _bound.device = device


def wait_event(event: Any, watch: Watch, conn: FrameConnection | None, peer_stop: FailureReason) -> None:
    """Return once `event` completed. Raise on our deadline or cancellation (watch), or when the peer speaks on
    `conn` (it only does to abort or refuse: reported as its reason, `peer_stop` by default)."""
    start = time.monotonic()
    sleep = 20e-6
    while not event.query():
        if time.monotonic() - start < SPIN_S:
            continue
        watch.check()
        if conn is not None and conn.frame_waiting():
            frame = conn.read_frame(watch)
            raise frame_failure(frame, peer_stop) or TransferFailed(
                FailureReason.PROTOCOL_ERROR,
                f"unexpected {frame.WhichOneof('body')} frame during a GPU transfer",
            )
        time.sleep(sleep)
        sleep = min(sleep * 2, MAX_SLEEP_S)


def require_cuda(cache: torch.Tensor, kind: str) -> torch.device:
    if cache.device.type != "cuda":
        raise ValueError(f"transfer.kind={kind} needs the KV cache on a CUDA device, got {cache.device}")
    return cache.device
