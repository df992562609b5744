"""KVSender: the prefill worker's side of the handoff.

    handle = sender.send(target, src_block_ids, num_tokens, FirstToken(tok, logprob))   # returns at once
    ... later, in the step loop: if handle.done(): handle.result() ...

or, to overlap shipping with the forward pass, layer group by layer group:

    handle = sender.open(target, src_block_ids, num_tokens)   # connects and claims the lease meanwhile
    handle.send_layers(0, 8, ready=event_after_layer_7) ... handle.send_layers(24, 32, ready=...)
    handle.finish(FirstToken(tok, logprob))

Ownership: after send()/open() returns, the sender owns src_block_ids (it only reads them) until the transfer
ends; then it calls on_release(result) exactly once, on the transfer thread, before `handle.future` resolves.
If send()/open() raises (bad arguments, closed sender), the caller still owns its blocks.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import secrets
import ssl
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kv_transfer.channels import ChannelPool
from kv_transfer.config import TransferConfig
from kv_transfer.contracts import FailureReason, FirstToken, HeadWindow, SendResult, TransferFailed
from kv_transfer.cuda_ipc import IpcSenderTransport
from kv_transfer.pairing import TRANSPORT_TO_PROTO
from kv_transfer.send_handle import SendHandle
from kv_transfer.send_session import SenderCore, SendSession
from kv_transfer.stats import StatsRecorder, TransferStats
from kv_transfer.transport import device_uuid, make_sender_transports
from model_runtime.kv_layout import KVLayout
from model_runtime.request_rules import ints_within
from tandem_api.tandem.v1 import kv_pb2

log = logging.getLogger(__name__)

ReleaseCallback = Callable[[SendResult], None]
ChunkHook = Callable[[str, int], None]


class KVSender:
    """Runs transfers on up to config.max_inflight_sends threads; safe to close twice."""

    def __init__(
        self,
        layout: KVLayout,
        cache: torch.Tensor,
        config: TransferConfig | None = None,
        *,
        on_release: ReleaseCallback | None = None,
        chunk_hook: ChunkHook | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """on_release(result): the transfer ended and no longer reads result.src_block_ids; the prefill worker
        frees them (called on a transfer thread). chunk_hook(request_id, bytes_sent): called after each tcp
        data chunk of a part; tests use it to throttle or stall a stream. tls: a client context (the prefill
        worker's cluster certificate, the cluster CA): every control connection is TLS."""
        self.layout = layout
        self.config = config or TransferConfig()
        self.instance_id = secrets.token_bytes(16)
        self._on_release = on_release
        self._stats = StatsRecorder()
        self.recorder = (
            self._stats
        )  # where its transfers are counted (a sender beside it may count there too)
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._closed = False
        self._active = 0
        self._transports = make_sender_transports(self.config, layout, cache)
        # The transports held, in order of preference: a target names the one its transfer takes.
        self.transports: tuple[str, ...] = tuple(self._transports)
        self._channels = ChannelPool(
            layout, self.config, self._transports, self.instance_id, device_uuid(cache), tls
        )
        self._core = SenderCore(
            layout,
            self.config,
            self._transports,
            self._channels,
            self._shutdown_failure,
            chunk_hook,
        )
        self._executor = concurrent.futures.ThreadPoolExecutor(self.config.max_inflight_sends, "kv-send")

    def open(
        self,
        target: kv_pb2.KVTarget,
        src_block_ids: Sequence[int],
        num_tokens: int,
        timeout_s: float | None = None,
        heads: HeadWindow | None = None,
    ) -> SendHandle:
        """Start a transfer whose layers the caller queues with send_layers() and completes with finish().
        timeout_s (default config.transfer_timeout_s) bounds everything from now to the receiver's ack.
        `heads`: only these heads move (one piece of a handoff between tensor-parallel workers of different
        sizes); None: the whole cache into the whole of the receiver's."""
        handle = self._handle(target, src_block_ids, num_tokens, timeout_s, heads)
        self._submit(handle)
        return handle

    def _handle(
        self,
        target: kv_pb2.KVTarget,
        src_block_ids: Sequence[int],
        num_tokens: int,
        timeout_s: float | None,
        heads: HeadWindow | None,
    ) -> SendHandle:
        """A checked SendHandle, armed when the target's doorbell is ours; not yet running."""
        ids = self._check_blocks(src_block_ids, num_tokens)
        if heads is not None:
            if not isinstance(heads, HeadWindow):
                raise TypeError(f"heads: expected a HeadWindow, got {type(heads).__name__}")
            self.layout.head_window(heads.source_begin, heads.count)  # ValueError names what is wrong
        timeout = self.config.transfer_timeout_s if timeout_s is None else timeout_s
        if not timeout > 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s!r}")
        if not isinstance(target, kv_pb2.KVTarget):
            raise TypeError(f"target: expected a KVTarget protobuf, got {type(target).__name__}")
        handle = SendHandle(target, ids, num_tokens, self.layout.num_layers, timeout, heads)
        self._take_doorbell(handle)
        return handle

    def _submit(self, handle: SendHandle) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("KVSender is closed")
            self._active += 1
            self._executor.submit(self._run, handle)

    def _take_doorbell(self, handle: SendHandle) -> None:
        """A cuda_ipc target armed for us by a receiver we are paired with: write our ids into its slot now, and
        let send_layers() ring it from the caller's thread (kv_transfer.doorbell); otherwise nothing."""
        target, ipc = handle.target, self._transports.get("cuda_ipc")
        if (
            not isinstance(ipc, IpcSenderTransport)
            or not target.HasField("armed")
            or target.armed.sender_id != self.instance_id
            or target.transport != TRANSPORT_TO_PROTO["cuda_ipc"]
            or handle.heads is not None
        ):
            return
        generation = ipc.bells.honor(target.receiver_id, target.armed, handle.src_block_ids)
        if generation:
            handle.arm(
                (target.armed.slot, generation),
                functools.partial(ipc.bells.ring, target.receiver_id, target.armed.slot, generation),
            )

    def send(
        self,
        target: kv_pb2.KVTarget,
        src_block_ids: Sequence[int],
        num_tokens: int,
        first_token: FirstToken,
        timeout_s: float | None = None,
        ready: Any = None,
        heads: HeadWindow | None = None,
    ) -> SendHandle:
        """Ship all layers and the first token. `ready`: a torch.cuda.Event recorded after the KV writes, or
        None when they are complete (e.g. the first token was already copied to the host). `heads`: as open()."""
        if not isinstance(first_token, FirstToken):
            raise TypeError(f"first_token: expected FirstToken, got {type(first_token).__name__}")
        handle = self._handle(target, src_block_ids, num_tokens, timeout_s, heads)
        # Queued before the transfer thread starts: an armed transfer's doorbell rings first, without waiting for
        # that thread to let go of the interpreter lock.
        handle.send_layers(0, self.layout.num_layers, ready)
        handle.finish(first_token)
        self._submit(handle)
        return handle

    def stats(self) -> TransferStats:
        with self._lock:
            active = self._active
        return self._stats.snapshot(active_transfers=active)

    def close(self) -> None:
        """Fail transfers still running (SHUTDOWN; their blocks are released), then release the pairs."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._closing.set()
        self._executor.shutdown(wait=True)
        self._channels.close()
        for transport in self._transports.values():
            transport.close()

    def __enter__(self) -> KVSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals -------------------------------------------------------------------------------------
    def _check_blocks(self, src_block_ids: Sequence[int], num_tokens: int) -> tuple[int, ...]:
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
            raise ValueError(f"num_tokens: must be an integer >= 1, got {num_tokens!r}")
        ids = tuple(src_block_ids)
        expected = self.layout.blocks_for_tokens(num_tokens)
        if len(ids) != expected:
            raise ValueError(f"src_block_ids: {num_tokens} tokens fill {expected} blocks, got {len(ids)} ids")
        if not ints_within(ids):  # exactly int, no bool
            raise ValueError(f"src_block_ids: must be integers, got {ids!r}")
        if len(set(ids)) != len(ids):
            raise ValueError("src_block_ids: contains duplicates")
        self.layout.check_block_ids(ids, "src_block_ids:")
        return ids

    def _run(self, handle: SendHandle) -> None:
        result = SendSession(self._core, handle).run()
        if self._on_release is not None:
            try:
                self._on_release(result)
            except Exception:  # the prefill worker's callback: log it, the transfer itself is over
                log.exception("on_release callback failed for request %r", result.request_id)
        if result.ok:
            self._stats.record_ok(result.num_bytes, result.seconds, result.phases)
        else:
            assert result.failure is not None
            self._stats.record_failure(result.failure)
        with self._lock:
            self._active -= 1
        handle.future.set_result(result)

    def _shutdown_failure(self) -> TransferFailed | None:
        if self._closing.is_set():
            return TransferFailed(FailureReason.SHUTDOWN, "the sender is closing")
        return None
