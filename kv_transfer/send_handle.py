"""SendHandle: the prefill worker's grip on one transfer that runs on a sender thread.

The caller queues layer groups as their KV is written (send_layers) and then the first token (finish); the
transfer thread ships them in that order. Every method returns at once, so the prefill step loop never waits on
the network. Parts must cover every layer exactly once before finish().
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kv_transfer.contracts import FailureReason, FirstToken, HeadWindow, SendResult, TransferFailed
from tandem_api.tandem.v1 import kv_pb2


@dataclass(frozen=True)
class PartRequest:
    layer_begin: int
    layer_end: int
    ready: Any = None  # torch.cuda.Event recorded after these layers' KV writes, or None

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_begin


@dataclass(frozen=True)
class DoneRequest:
    first_token: FirstToken
    queued_at: float = (
        0.0  # time.monotonic() of finish(): the session's `tail` phase runs from here to the ack
    )


class SendHandle:
    """One transfer in flight. Thread-safe. `future` resolves to a SendResult after the blocks were released."""

    def __init__(
        self,
        target: kv_pb2.KVTarget,
        src_block_ids: tuple[int, ...],
        num_tokens: int,
        num_layers: int,
        timeout_s: float,
        heads: HeadWindow | None = None,
    ) -> None:
        self.target = target
        self.heads = heads  # None: every head of our cache into every head of the receiver's
        self.request_id = target.request_id
        self.src_block_ids = src_block_ids
        self.num_tokens = num_tokens
        self.started_at = time.monotonic()
        self.deadline = self.started_at + timeout_s
        self.future: concurrent.futures.Future[SendResult] = concurrent.futures.Future()
        self._num_layers = num_layers
        self._queue: queue.Queue[PartRequest | DoneRequest] = queue.Queue()
        self._lock = threading.Lock()
        self._layers_queued: set[int] = set()
        self._finished = False
        self._abort: TransferFailed | None = None
        # cuda_ipc with the receiver's doorbell (kv_transfer.doorbell): (slot, generation), and ring(layer_end,
        # ready), which send_layers calls on the caller's thread
        self.armed: tuple[int, int] | None = None
        self._ring: Callable[[int, Any], None] | None = None

    def arm(self, armed: tuple[int, int], ring: Callable[[int, Any], None]) -> None:
        self.armed, self._ring = armed, ring

    # --- the caller's side -----------------------------------------------------------------------------
    def send_layers(self, layer_begin: int, layer_end: int, ready: Any = None) -> None:
        """Queue layers [layer_begin, layer_end) for shipping; `ready` (a torch.cuda.Event recorded after
        their KV writes) orders the copy after those writes; None means they are already complete."""
        with self._lock:
            if self._finished:
                raise ValueError(f"request {self.request_id!r}: send_layers after finish()")
            if not (
                isinstance(layer_begin, int)
                and isinstance(layer_end, int)
                and 0 <= layer_begin < layer_end <= self._num_layers
            ):
                raise ValueError(
                    f"layers: [{layer_begin}, {layer_end}) is not a non-empty range in "
                    f"[0, {self._num_layers})"
                )
            layers = set(range(layer_begin, layer_end))
            if layers & self._layers_queued:
                raise ValueError(f"layers: [{layer_begin}, {layer_end}) overlaps layers already queued")
            self._layers_queued |= layers
        if self._ring is not None:
            try:  # from the GPU, behind `ready`: the receiver's copies start when these layers are written
                self._ring(layer_end, ready)
            except (
                Exception
            ) as exc:  # never into the caller (an engine step); KVAbort ends the receiver's chain
                self.abort(f"ringing the receiver's doorbell failed: {type(exc).__name__}: {exc}")
        self._queue.put(PartRequest(layer_begin, layer_end, ready))

    def finish(self, first_token: FirstToken) -> None:
        """All layers are queued: ship the first token and complete the handoff."""
        if not isinstance(first_token, FirstToken):
            raise TypeError(f"first_token: expected FirstToken, got {type(first_token).__name__}")
        with self._lock:
            missing = self._num_layers - len(self._layers_queued)
            if missing:
                raise ValueError(f"request {self.request_id!r}: finish() with {missing} layers never queued")
            if self._finished:
                raise ValueError(f"request {self.request_id!r}: finish() called twice")
            self._finished = True
        self._queue.put(DoneRequest(first_token, time.monotonic()))

    def abort(self, message: str = "") -> None:
        """Stop the transfer (the prefill side cancelled); the receiver is told when the stream allows."""
        with self._lock:
            if self._abort is None:
                self._abort = TransferFailed(
                    FailureReason.SENDER_ABORTED, message or "aborted by the prefill worker"
                )

    def done(self) -> bool:
        return self.future.done()

    def result(self, timeout: float | None = None) -> SendResult:
        return self.future.result(timeout)

    # --- the transfer thread's side --------------------------------------------------------------------
    def cancellation(self) -> TransferFailed | None:
        return self._abort

    def next_request(self, timeout: float) -> PartRequest | DoneRequest | None:
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None
