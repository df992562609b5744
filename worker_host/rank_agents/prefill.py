"""Rank 0 of a prefill worker spanning devices, or of one rank sending to a decode worker of several: KVSender's
send() over every rank's pieces of a request (see worker_host.rank_agents)."""

from __future__ import annotations

import concurrent.futures
import logging
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kv_transfer import (
    FailureReason,
    FirstToken,
    KVSender,
    SendResult,
    TransferFailed,
)
from kv_transfer.config import TransferConfig
from kv_transfer.send_handle import SendHandle
from kv_transfer.send_session import token_message
from kv_transfer.shard_plan import handoff_plan, pieces_from
from kv_transfer.sharded import decode_size, pieces
from kv_transfer.stats import StatsRecorder, TransferStats
from model_runtime.kv_layout import KVLayout
from tandem_api.tandem.v1 import kv_pb2
from tandem_api.tandem.v1 import rank_agent_pb2 as pb
from worker_host.rank_agents.link import AgentHub, held_by_all, lost_outcome, outcome_failure

log = logging.getLogger(__name__)


class ShardedSendHandle:
    """SendHandle's interface (done, result, abort, future) over one request's sends on every rank."""

    def __init__(self, request_id: str, src_block_ids: tuple[int, ...], others: set[int]) -> None:
        self.request_id = request_id
        self.src_block_ids = src_block_ids
        self.started_at = time.monotonic()
        self.future: concurrent.futures.Future[SendResult] = concurrent.futures.Future()
        self.own: list[SendHandle] = []
        self.waiting = set(others)  # ranks that have not reported
        self.sealed = False  # every one of rank 0's own sends was started
        self.failure: tuple[FailureReason, str] | None = None
        self.num_bytes = 0
        self.cancel: Callable[[str], None] = lambda message: None

    def done(self) -> bool:
        return self.future.done()

    def result(self, timeout: float | None = None) -> SendResult:
        return self.future.result(timeout)

    def abort(self, message: str = "") -> None:
        for handle in self.own:
            handle.abort(message)
        self.cancel(message or "aborted by the prefill worker")


class ShardedSender:
    """KVSender's send() for a prefill worker of several ranks (see worker_host.rank_agents), or for a worker of
    one rank whose target is a decode worker of several (`hub` None: only rank 0's own pieces). Layer-by-layer
    streaming (open) is not offered: every rank sends after the prompt's step."""

    def __init__(
        self,
        layout: KVLayout,
        cache: torch.Tensor,
        config: TransferConfig,
        hub: AgentHub | None,
        steps: Callable[[], int],
        *,
        on_release: Callable[[SendResult], None],
        tls: ssl.SSLContext | None = None,
        recorder: StatsRecorder | None = None,
    ) -> None:
        """`recorder`: where each request's send is counted (default its own; a one-rank worker passes its
        KVSender's, so that its metrics count the requests of both)."""
        self.layout = layout
        self.config = config
        self._hub = hub
        self._steps = steps
        self._on_release = on_release
        self._lock = threading.Lock()
        self._sends: dict[str, ShardedSendHandle] = {}
        self._stats = recorder or StatsRecorder()  # one record per request (all its ranks' pieces)
        self._ranks = hub.wait_ready() if hub is not None else []
        self._own = KVSender(layout, cache, config, tls=tls)
        self.transports = held_by_all(self._own.transports, self._ranks)
        if hub is not None:
            hub.on_outcome = self._other_outcome
            hub.on_lost = self._rank_lost

    def open(self, *args: Any, **kwargs: Any) -> SendHandle:
        raise NotImplementedError("a prefill worker of several ranks sends after the prompt's step (send())")

    def send(
        self,
        target: kv_pb2.KVTarget,
        src_block_ids: Sequence[int],
        num_tokens: int,
        first_token: FirstToken,
        timeout_s: float | None = None,
        ready: Any = None,
    ) -> ShardedSendHandle:
        ids = tuple(src_block_ids)
        timeout = self.config.transfer_timeout_s if timeout_s is None else timeout_s
        size = len(self._ranks) + 1
        rid = target.request_id
        try:
            mine = pieces(target, self.layout)
        except TransferFailed as failure:  # the workers cannot split the heads between them: fail the send
            return self._refused(rid, ids, failure)
        plan = handoff_plan(size, decode_size(target), self.layout.model_kv_heads)
        others = {rank for rank in range(1, size) if pieces_from(plan, rank)}
        handle = ShardedSendHandle(rid, ids, others)
        handle.cancel = lambda message: self._cancel(rid, message)
        with self._lock:
            if rid in self._sends:
                raise ValueError(f"request {rid!r}: a send of it is already running")
            self._sends[rid] = handle
        order = pb.AgentSend(
            request_id=rid,
            target=target,
            src_block_ids=ids,
            num_tokens=num_tokens,
            first_token=token_message(first_token),
            after_step=self._steps(),
            timeout_ms=int(timeout * 1000),
        )
        for rank in others:
            if self._hub is None or not self._hub.tell(rank, pb.AgentMessage(send=order)):
                self._other_outcome(rank, pb.AgentOutcome(request_id=rid, ok=False, message="rank lost"))
        for piece_target, window in mine:
            part = self._own.send(piece_target, ids, num_tokens, first_token, timeout, ready, window)
            handle.own.append(part)
            part.future.add_done_callback(self._settler(handle))
        with self._lock:
            handle.sealed = True
        self._settle(handle)
        return handle

    def stats(self) -> TransferStats:
        with self._lock:
            active = len(self._sends)
        return self._stats.snapshot(active_transfers=active)

    def close(self) -> None:
        self._own.close()

    def _refused(self, rid: str, ids: tuple[int, ...], failure: TransferFailed) -> ShardedSendHandle:
        handle = ShardedSendHandle(rid, ids, set())
        result = SendResult(rid, ids, False, failure.reason, failure.message)
        self._on_release(result)
        self._stats.record_failure(failure.reason)
        handle.future.set_result(result)
        return handle

    def _settler(self, handle: ShardedSendHandle) -> Callable[[Any], None]:
        return lambda _future: self._settle(handle)

    def _cancel(self, request_id: str, message: str) -> None:
        cancel = pb.AgentMessage(cancel=pb.AgentCancel(request_id=request_id, message=message))
        for rank in range(1, len(self._ranks) + 1):
            if self._hub is not None:
                self._hub.tell(rank, cancel)

    def _other_outcome(self, rank: int, outcome: pb.AgentOutcome) -> None:
        with self._lock:
            handle = self._sends.get(outcome.request_id)
            if handle is None or rank not in handle.waiting:
                return
            handle.waiting.discard(rank)
            handle.num_bytes += outcome.num_bytes
            if not outcome.ok and handle.failure is None:
                handle.failure = outcome_failure(rank, outcome)
        if not outcome.ok:
            handle.abort(f"rank {rank}'s sends failed")
        self._settle(handle)

    def _rank_lost(self, rank: int) -> None:
        with self._lock:
            pending = list(self._sends.values())
        for handle in pending:
            self._other_outcome(rank, lost_outcome(handle.request_id))

    def _settle(self, handle: ShardedSendHandle) -> None:
        """Once every rank's sends ended: release the blocks, then resolve the handle."""
        with self._lock:
            if not handle.sealed or handle.waiting or not all(part.done() for part in handle.own):
                return
            if self._sends.get(handle.request_id) is not handle:
                return
            del self._sends[handle.request_id]
        results = [part.result() for part in handle.own]
        failure = handle.failure
        for result in results:
            if not result.ok and failure is None:
                failure = (result.failure or FailureReason.INTERNAL, result.message)
        total = handle.num_bytes + sum(result.num_bytes for result in results)
        reason, message = failure if failure is not None else (None, "")
        result = SendResult(
            handle.request_id,
            handle.src_block_ids,
            failure is None,
            reason,
            message,
            total if failure is None else 0,
            time.monotonic() - handle.started_at,
        )
        try:
            self._on_release(result)
        except Exception:
            log.exception("on_release callback failed for request %r", handle.request_id)
        if result.ok:
            self._stats.record_ok(result.num_bytes, result.seconds)
        else:
            self._stats.record_failure(result.failure or FailureReason.INTERNAL)
        handle.future.set_result(result)
