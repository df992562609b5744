"""A rank other than 0: its KV agent beside the step loop, with its own KV sender or receiver, driven by rank 0
(see worker_host.rank_agents), and the clock its step loop ticks."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kv_transfer import (
    FailureReason,
    KVReceiver,
    KVSender,
    TransferFailed,
    TransferResult,
)
from kv_transfer.config import TransferConfig
from kv_transfer.descriptors import first_token_from_message
from kv_transfer.pairing import format_message
from kv_transfer.send_handle import SendHandle
from kv_transfer.sharded import pieces
from model_runtime.kv_layout import KVLayout
from tandem_api.tandem.v1 import rank_agent_pb2 as pb
from worker_host.rank_agents.link import (
    FOLLOWER_LEASE_TTL_S,
    READY_TIMEOUT_S,
    SOCKET_NAME,
    Link,
    outcome_message,
)

log = logging.getLogger(__name__)


class StepClock:
    """The steps a rank has run, and (on a GPU) an event after the last: a rank's KV of a step is complete
    once that event has passed. `tick` runs on the rank's step loop after every step."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._cond = threading.Condition()
        self.steps = 0
        self._event: Any = None

    def tick(self) -> None:
        event = None
        if self._cuda:
            event = torch.cuda.Event()
            event.record()
        with self._cond:
            self.steps += 1
            self._event = event
            self._cond.notify_all()

    def after(self, step: int, timeout_s: float) -> Any:
        """The event to wait for before reading the KV of step `step` (None on a CPU); raises TimeoutError."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.steps >= step, timeout_s):
                raise TimeoutError(f"step {step} did not run within {timeout_s:.0f} s (ran {self.steps})")
            return self._event


class _Borrowed:
    """A rank > 0's allocator: its leases name rank 0's blocks, which rank 0 frees."""

    def allocate(self, num_blocks: int) -> list[int] | None:
        raise RuntimeError("a tensor-parallel rank other than 0 never allocates KV blocks")

    def free(self, block_ids: Sequence[int]) -> None:
        pass


@dataclass
class _FollowerSend:
    handles: list[SendHandle] = field(default_factory=list)
    cancelled: str = ""  # why rank 0 cancelled it ("" while it runs)


class FollowerAgent:
    """A rank > 0's KV agent: its own receiver (decode) or sender (prefill) over its cache, driven by rank 0.
    Runs on its own threads beside the rank's step loop; start() returns at once."""

    def __init__(
        self,
        role: str,
        rank: int,
        layout: KVLayout,
        cache: torch.Tensor,
        config: TransferConfig,
        directory: str,
        clock: StepClock,
        *,
        server_tls: ssl.SSLContext | None = None,
        client_tls: ssl.SSLContext | None = None,
    ) -> None:
        if role not in ("prefill", "decode"):
            raise ValueError(f"role: a KV agent runs beside a prefill or decode rank, not {role!r}")
        self.role = role
        self.rank = rank
        self.layout = layout
        self._path = os.path.join(directory, SOCKET_NAME)
        self._clock = clock
        self._link: Link | None = None
        self._sends: dict[str, _FollowerSend] = {}
        self._lock = threading.Lock()
        self.receiver: KVReceiver | None = None
        self.sender: KVSender | None = None
        if role == "decode":
            self.receiver = KVReceiver(
                layout, cache, _Borrowed(), config, on_result=self._landed, tls=server_tls
            )
        else:
            self.sender = KVSender(layout, cache, config, tls=client_tls)
        self._pool = concurrent.futures.ThreadPoolExecutor(config.max_inflight_sends, "kv-agent-send")
        self._closed = False

    def start(self) -> None:
        threading.Thread(target=self._run, name=f"kv-agent-{self.rank}", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        if self._link is not None:
            self._link.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.receiver is not None:
            self.receiver.close()
        if self.sender is not None:
            self.sender.close()

    def _hello(self) -> pb.AgentMessage:

        held = self.receiver.transports if self.receiver is not None else self.sender.transports  # type: ignore[union-attr]
        hello = pb.AgentHello(
            rank=self.rank,
            layout_fingerprint=self.layout.fingerprint(),
            format=format_message(self.layout),
            transports=list(held),
        )
        if self.receiver is not None:
            hello.port = self.receiver.port
            hello.receiver_id = self.receiver.receiver_id
        return pb.AgentMessage(hello=hello)

    def _run(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self._path)
                break
            except OSError:
                sock.close()
                if time.monotonic() > deadline:
                    log.error("rank %d: no KV agent hub at %s", self.rank, self._path)
                    return
                time.sleep(0.05)
        self._link = Link(sock)
        try:
            self._link.send(self._hello())
            while (message := self._link.receive()) is not None:
                self._handle(message)
        except (OSError, ValueError) as exc:
            log.warning("rank %d's KV agent link ended: %s", self.rank, exc)

    def _handle(self, message: pb.AgentMessage) -> None:
        kind = message.WhichOneof("body")
        if kind == "lease" and self.receiver is not None:
            self._reply(message.lease)
        elif kind == "send" and self.sender is not None:
            order = pb.AgentSend()
            order.CopyFrom(message.send)
            try:
                self._pool.submit(self._send, order)
            except RuntimeError:  # closing: the rank is going away, and rank 0 learns it from the link
                return
        elif kind == "cancel":
            rid, why = message.cancel.request_id, message.cancel.message or "cancelled by rank 0"
            if self.receiver is not None:
                self.receiver.abort(rid, why)
            with self._lock:
                send = self._sends.get(rid)
                if send is not None:
                    send.cancelled = why
                handles = list(send.handles) if send is not None else []
            for handle in handles:
                handle.abort(why)
        else:
            log.warning("rank %d's KV agent got an unexpected %s message", self.rank, kind)

    def _reply(self, lease: pb.AgentLease) -> None:
        assert self.receiver is not None
        ids = list(lease.block_ids)
        error = ""
        try:
            if lease.transport not in self.receiver.transports:
                raise ValueError(f"transport {lease.transport!r} is not held here")
            self.receiver.reserve(
                lease.request_id,
                lease.num_tokens,
                FOLLOWER_LEASE_TTL_S,
                lambda n: ids if n == len(ids) else None,
                lease.transport,
                bytes(lease.handle),
            )
        except Exception as exc:  # the reply says why; rank 0 fails the request
            error = f"{type(exc).__name__}: {exc}"
        self._tell(pb.AgentMessage(reply=pb.AgentReply(seq=lease.seq, error=error)))

    def _landed(self, result: TransferResult) -> None:
        self._tell(
            outcome_message(result.request_id, result.ok, result.failure, result.message, result.num_bytes)
        )

    def _send(self, order: pb.AgentSend) -> None:
        assert self.sender is not None
        rid = order.request_id
        send = _FollowerSend()
        handles = send.handles
        with self._lock:
            self._sends[rid] = send
        try:
            timeout = order.timeout_ms / 1000 or self.sender.config.transfer_timeout_s
            ready = self._clock.after(order.after_step, timeout)
            first = first_token_from_message(order.first_token)
            for piece_target, window in pieces(order.target, self.layout):
                with self._lock:
                    if send.cancelled:
                        raise TransferFailed(FailureReason.SENDER_ABORTED, send.cancelled)
                    handles.append(
                        self.sender.send(
                            piece_target, list(order.src_block_ids), order.num_tokens, first, timeout, ready,
                            window,
                        )
                    )  # fmt: skip
            results = [handle.result() for handle in handles]
        except Exception as exc:
            for handle in handles:
                handle.abort(str(exc))
            results = [handle.result() for handle in handles]
            reason = getattr(exc, "reason", FailureReason.INTERNAL)
            self._tell(outcome_message(rid, False, reason, f"{type(exc).__name__}: {exc}", 0))
            return
        finally:
            with self._lock:
                self._sends.pop(rid, None)
        failed = next((r for r in results if not r.ok), None)
        if failed is not None:
            self._tell(outcome_message(rid, False, failed.failure, failed.message, 0))
        else:
            self._tell(outcome_message(rid, True, None, "", sum(r.num_bytes for r in results)))

    def _tell(self, message: pb.AgentMessage) -> None:
        if self._link is None or self._closed:
            return
        try:
            self._link.send(message)
        except OSError as exc:
            log.warning("rank %d could not report to rank 0: %s", self.rank, exc)
