"""The KV agents of a worker that spans several devices: every rank moves the KV heads of its own cache.

A tensor-parallel worker's ranks each hold some of the model's KV heads (model_runtime.kv_layout.KVShard), so
a handoff between a prefill worker of a ranks and a decode worker of b ranks is a set of transfers, each from
the prefill rank that holds some heads to the decode rank that holds them, GPU to GPU (kv_transfer.sharded).
Rank 0 is the worker's face: the router talks only to it. The other ranks run the engine's steps
(model_runtime.parallel.follower) and, beside that loop, an agent with its own KV sender or receiver:

    rank 0 (AgentHub)  <--- Unix socket in the ranks' private rendezvous directory --->  rank r (FollowerAgent)
                       AgentHello  <-  (its receiver's port, format, transports)
    decode:            AgentLease  ->  hold a lease over rank 0's block ids     <- AgentReply
    prefill:           AgentSend   ->  send your pieces of this request          (after the step that ran it)
    both:              AgentCancel ->  stop this request now
                       AgentOutcome <- the request's lease or sends ended here: nothing writes or reads its
                                       blocks on this rank any more

Blocks belong to rank 0 (its engine allocates and frees them; every rank's cache is addressed by the same ids),
so rank 0 frees a request's blocks only after every rank reported its outcome:

- Decode (ShardedReceiver): rank 0 reserves, then every other rank leases the same ids under a handle of rank
  0's choosing; the KVTarget lists every rank's lease. A request is admitted once every rank's lease landed.
  If any rank's lease fails, the others are cancelled, and the blocks go back once all have ended. Rank 0's
  lease is the clock: the other ranks' leases live until rank 0 ends them.
- Prefill (ShardedSender): once the prompt's first token is known, rank 0 sends its own pieces and tells every
  other rank to send its own, after the step that computed them. The transfer is done (and the blocks released)
  when every rank has reported.

Nothing received is unpickled: the agents speak protobuf (tandem.v1.rank_agent), KV travels as in every handoff.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import secrets
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from google.protobuf.message import DecodeError

from kv_transfer import (
    FailureReason,
    FirstToken,
    KVReceiver,
    KVSender,
    Lease,
    SendResult,
    TransferFailed,
    TransferResult,
)
from kv_transfer.config import TransferConfig
from kv_transfer.contracts import Allocate, BlockAllocator
from kv_transfer.pairing import format_message
from kv_transfer.receive_session import first_token_from_message
from kv_transfer.send_handle import SendHandle
from kv_transfer.send_session import token_message
from kv_transfer.shard_plan import handoff_plan, pieces_from
from kv_transfer.sharded import decode_size, pieces
from kv_transfer.stats import StatsRecorder, TransferStats
from model_runtime.kv_layout import KVLayout
from tandem_api.tandem.v1 import kv_pb2
from tandem_api.tandem.v1 import rank_agent_pb2 as pb

log = logging.getLogger(__name__)

SOCKET_NAME = "kv-agents.sock"
READY_TIMEOUT_S = 600.0  # the other ranks load their weights meanwhile
REPLY_TIMEOUT_S = 10.0
FOLLOWER_LEASE_TTL_S = 3600.0  # a safety net: rank 0 ends every other rank's lease (see the module docstring)
_LENGTH = struct.Struct(">I")
MAX_MESSAGE = 4 << 20


class AgentLost(RuntimeError):
    """A rank's agent went away (the rank died): the worker is being replaced."""


class _Link:
    """One framed protobuf connection (4-byte big-endian length, one AgentMessage)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._lock = threading.Lock()

    def send(self, message: pb.AgentMessage) -> None:
        data = message.SerializeToString()
        with self._lock:
            self.sock.sendall(_LENGTH.pack(len(data)) + data)

    def receive(self) -> pb.AgentMessage | None:
        """The next message, or None once the peer closed."""
        header = self._exactly(_LENGTH.size)
        if header is None:
            return None
        (length,) = _LENGTH.unpack(header)
        if length > MAX_MESSAGE:
            raise ValueError(f"agent message of {length} bytes exceeds {MAX_MESSAGE}")
        body = self._exactly(length)
        if body is None:
            return None
        message = pb.AgentMessage()
        try:
            message.ParseFromString(body)
        except DecodeError as exc:
            raise ValueError(f"an agent message that does not parse: {exc}") from None
        return message

    def _exactly(self, n: int) -> bytes | None:
        chunks, got = [], 0
        while got < n:
            chunk = self.sock.recv(n - got)
            if not chunk:
                return None
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def outcome_message(
    request_id: str, ok: bool, failure: FailureReason | None, message: str, num_bytes: int
) -> pb.AgentMessage:
    outcome = pb.AgentOutcome(request_id=request_id, ok=ok, message=message, num_bytes=num_bytes)
    if failure is not None:
        outcome.failure = failure.value  # type: ignore[assignment]  # KVFailure mirrors FailureReason
    return pb.AgentMessage(outcome=outcome)


# --- rank 0 ---------------------------------------------------------------------------------------------
class AgentHub:
    """Rank 0's end: listens before the other ranks start (they connect whenever their agent is up)."""

    def __init__(self, directory: str, num_followers: int) -> None:
        self.path = os.path.join(directory, SOCKET_NAME)
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(self.path)
        os.chmod(self.path, 0o600)
        self._server.listen(max(1, num_followers))
        self._expected = num_followers
        self._cond = threading.Condition()
        self._links: dict[int, _Link] = {}
        self.hellos: dict[int, pb.AgentHello] = {}
        self.lost: set[int] = set()
        self._replies: dict[int, concurrent.futures.Future[str]] = {}
        self._seq = 0
        self._closed = False
        self.on_outcome: Callable[[int, pb.AgentOutcome], None] = lambda rank, outcome: None
        self.on_lost: Callable[[int], None] = lambda rank: None
        # Whether every other rank's process still runs (deploy.ranks.Ranks.alive): a rank that died before its
        # agent connected ends wait_ready at once rather than at its timeout.
        self.ranks_alive: Callable[[], bool] = lambda: True
        threading.Thread(target=self._accept, name="kv-agents-accept", daemon=True).start()

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> list[pb.AgentHello]:
        """Every other rank's hello, by rank (1, 2, ...); raises naming the ranks that never came."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(self.hellos) < self._expected:
                left = deadline - time.monotonic()
                dead = not self.ranks_alive()
                if left <= 0 or self.lost or dead:
                    missing = sorted(set(range(1, self._expected + 1)) - set(self.hellos))
                    why = f"did not report within {timeout_s:.0f} s"
                    if self.lost or dead:
                        gone = f"ranks {sorted(self.lost)}" if self.lost else "a rank's process"
                        why = f"did not report: {gone} went away"
                    raise RuntimeError(f"tensor-parallel ranks {missing}: their KV agents {why}")
                self._cond.wait(min(left, 0.5))
            return [self.hellos[rank] for rank in sorted(self.hellos)]

    def ask(self, requests: dict[int, pb.AgentLease], timeout_s: float = REPLY_TIMEOUT_S) -> dict[int, str]:
        """Send each rank its lease and wait for every reply: rank -> "" (held) or why not."""
        waits: dict[int, concurrent.futures.Future[str]] = {}
        for rank, lease in requests.items():
            with self._cond:
                self._seq += 1
                lease.seq = self._seq
                waits[rank] = self._replies[self._seq] = concurrent.futures.Future()
            try:
                self._link(rank).send(pb.AgentMessage(lease=lease))
            except (OSError, AgentLost) as exc:
                waits[rank].set_result(f"rank {rank}'s KV agent is unreachable: {exc}")
        out = {}
        deadline = time.monotonic() + timeout_s
        for rank, wait in waits.items():
            try:
                out[rank] = wait.result(max(0.0, deadline - time.monotonic()))
            except concurrent.futures.TimeoutError:
                out[rank] = f"rank {rank}'s KV agent did not answer within {timeout_s:.0f} s"
        with self._cond:
            for lease in requests.values():
                self._replies.pop(lease.seq, None)
        return out

    def tell(self, rank: int, message: pb.AgentMessage) -> bool:
        """Send without waiting; False when the rank's agent is gone."""
        try:
            self._link(rank).send(message)
            return True
        except (OSError, AgentLost):
            return False

    def close(self) -> None:
        with self._cond:
            self._closed = True
            links = list(self._links.values())
        for link in links:
            link.close()
        self._server.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    def _link(self, rank: int) -> _Link:
        with self._cond:
            link = self._links.get(rank)
            if link is None or rank in self.lost:
                raise AgentLost(f"rank {rank}'s KV agent is not connected")
            return link

    def _accept(self) -> None:
        for _ in range(self._expected):
            try:
                sock, _ = self._server.accept()
            except OSError:
                return  # closed
            threading.Thread(
                target=self._serve, args=(_Link(sock),), name="kv-agents-link", daemon=True
            ).start()

    def _serve(self, link: _Link) -> None:
        rank = -1
        try:
            first = link.receive()
            if first is None or first.WhichOneof("body") != "hello":
                raise ValueError("a rank's first agent message must be its hello")
            rank = first.hello.rank
            if not 1 <= rank <= self._expected or rank in self.hellos:
                raise ValueError(f"agent hello from rank {rank}: expected one of 1..{self._expected}, once")
            with self._cond:
                self._links[rank] = link
                self.hellos[rank] = first.hello
                self._cond.notify_all()
            while (message := link.receive()) is not None:
                kind = message.WhichOneof("body")
                if kind == "reply":
                    with self._cond:
                        wait = self._replies.get(message.reply.seq)
                    if wait is not None and not wait.done():
                        wait.set_result(message.reply.error)
                elif kind == "outcome":
                    self.on_outcome(rank, message.outcome)
                else:
                    log.warning("rank %d's KV agent sent an unexpected %s message", rank, kind)
        except (OSError, ValueError) as exc:
            if not self._closed:
                log.warning("KV agent link of rank %d failed: %s", rank, exc)
        finally:
            link.close()
            if rank > 0:
                with self._cond:
                    self.lost.add(rank)
                    self._cond.notify_all()
                if not self._closed:
                    log.error("rank %d's KV agent went away: its requests fail", rank)
                    self.on_lost(rank)


def splits(target: kv_pb2.KVTarget, layout: KVLayout) -> bool:
    """Whether a handoff to `target` from a cache of `layout` is several transfers (kv_transfer.sharded): the
    decode worker spans several ranks, or its cache holds other heads than ours."""
    return bool(target.rank_targets) or target.format.num_kv_heads != layout.num_kv_heads


def held_by_all(own: Sequence[str], hellos: Sequence[pb.AgentHello]) -> tuple[str, ...]:
    """The transports every rank holds, in rank 0's order of preference."""
    kinds = tuple(k for k in own if all(k in hello.transports for hello in hellos))
    if not kinds:
        raise RuntimeError(f"the ranks hold no KV transport in common (rank 0: {', '.join(own)})")
    return kinds


# --- rank 0 of a decode worker ---------------------------------------------------------------------------
@dataclass
class _Join:
    """One request's leases on every rank, until all have ended."""

    request_id: str
    block_ids: tuple[int, ...] = ()
    handles: dict[int, bytes] = field(default_factory=dict)
    lease_made: bool = False
    own: TransferResult | None = None
    others: dict[int, pb.AgentOutcome] = field(default_factory=dict)
    failure: tuple[FailureReason, str] | None = None


class _HeldByJoins:
    """Rank 0's receiver's allocator: blocks of a lease that the join owns are freed by the join (after every
    rank stopped writing), not by the receiver when its own lease fails."""

    def __init__(self, real: BlockAllocator, owned: Callable[[tuple[int, ...]], bool]) -> None:
        self._real = real
        self._owned = owned

    def allocate(self, num_blocks: int) -> list[int] | None:
        return self._real.allocate(num_blocks)

    def free(self, block_ids: Sequence[int]) -> None:
        if not self._owned(tuple(block_ids)):
            self._real.free(block_ids)


class ShardedReceiver:
    """KVReceiver's interface for a decode worker of several ranks (see the module docstring)."""

    def __init__(
        self,
        layout: KVLayout,
        cache: torch.Tensor,
        allocator: BlockAllocator,
        config: TransferConfig,
        hub: AgentHub,
        *,
        on_result: Callable[[TransferResult], None],
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self._real = allocator
        self._hub = hub
        self._on_result = on_result
        self._lock = threading.Lock()
        self._joins: dict[str, _Join] = {}
        self._by_blocks: dict[tuple[int, ...], _Join] = {}
        self._ranks = hub.wait_ready()
        self._own = KVReceiver(
            layout, cache, _HeldByJoins(allocator, self._owned), config, on_result=self._own_result, tls=tls
        )
        self.layout = layout
        self.receiver_id = self._own.receiver_id
        self.transports = held_by_all(self._own.transports, self._ranks)
        hub.on_outcome = self._other_outcome
        hub.on_lost = self._rank_lost

    @property
    def endpoint(self) -> tuple[str, int]:
        return self._own.endpoint

    def reserve(
        self,
        request_id: str,
        num_tokens: int,
        ttl_s: float | None = None,
        allocate: Allocate | None = None,
        transport: str | None = None,
    ) -> Lease:
        """Rank 0's lease, then the same blocks leased on every other rank; raises RuntimeError (the blocks
        back) when a rank cannot hold its lease."""
        kind = self.transports[0] if transport is None else transport
        if kind not in self.transports:
            raise ValueError(
                f"transport: this worker's ranks hold {', '.join(self.transports)}, not {kind!r}"
            )
        take = allocate or self._real.allocate
        join = _Join(request_id)

        def allocate_and_join(num_blocks: int) -> list[int] | None:
            ids = take(num_blocks)
            if ids is not None:
                join.block_ids = tuple(ids)
                with self._lock:
                    self._by_blocks[join.block_ids] = join
            return ids

        with self._lock:
            if request_id in self._joins:
                raise ValueError(f"request_id {request_id!r} already holds a lease")
            self._joins[request_id] = join
        try:
            lease = self._own.reserve(request_id, num_tokens, ttl_s, allocate_and_join, kind)
        except BaseException:
            self._forget(join)
            raise
        join.lease_made = True
        requests = {}
        for rank in range(1, len(self._ranks) + 1):
            join.handles[rank] = secrets.token_bytes(16)
            requests[rank] = pb.AgentLease(
                request_id=request_id,
                handle=join.handles[rank],
                block_ids=lease.block_ids,
                num_tokens=num_tokens,
                transport=kind,
            )
        errors = {rank: error for rank, error in self._hub.ask(requests).items() if error}
        if errors:
            rank, error = min(errors.items())
            for other in errors:  # no lease there: nothing to wait for
                self._other_outcome(other, pb.AgentOutcome(request_id=request_id, ok=False, message=error))
            self.abort(request_id, f"rank {rank} could not hold its lease: {error}")
            raise RuntimeError(f"tensor-parallel rank {rank} could not hold the KV lease: {error}")
        return lease

    def target(self, lease: Lease) -> kv_pb2.KVTarget:
        target = self._own.target(lease)
        with self._lock:
            join = self._joins.get(lease.request_id)
        if join is None:
            raise ValueError(f"request {lease.request_id!r} holds no lease")
        for rank, hello in enumerate(self._ranks, start=1):
            target.rank_targets.add(
                port=hello.port,
                handle=join.handles[rank],
                receiver_id=hello.receiver_id,
                layout_fingerprint=hello.layout_fingerprint,
                format=hello.format,
            )
        return target

    def renew(self, request_id: str) -> bool:
        return self._own.renew(request_id)  # the other ranks' leases follow rank 0's

    def abort(self, key: str | bytes, message: str = "") -> bool:
        aborted = self._own.abort(key, message)
        if isinstance(key, str):
            self._cancel_others(key, message or "aborted by the decode worker")
        return aborted

    def record_phase(self, name: str, seconds: float) -> None:
        self._own.record_phase(name, seconds)

    def stats(self) -> TransferStats:
        return self._own.stats()

    def poll(self) -> list[TransferResult]:
        return self._own.poll()

    def close(self) -> None:
        self._own.close()

    # --- joins -------------------------------------------------------------------------------------------
    def _owned(self, block_ids: tuple[int, ...]) -> bool:
        with self._lock:
            join = self._by_blocks.get(block_ids)
            return join is not None and join.lease_made

    def _own_result(self, result: TransferResult) -> None:
        with self._lock:
            join = self._joins.get(result.request_id)
            if join is None:
                return
            join.own = result
            failed = not result.ok and join.failure is None
            if failed:
                join.failure = (result.failure or FailureReason.INTERNAL, result.message)
        if failed:
            self._cancel_others(result.request_id, f"rank 0's lease failed: {result.message}")
        self._settle(join)

    def _other_outcome(self, rank: int, outcome: pb.AgentOutcome) -> None:
        with self._lock:
            join = self._joins.get(outcome.request_id)
            if join is None or rank in join.others:
                return
            join.others[rank] = outcome
            failed = not outcome.ok and join.failure is None
            if failed:
                reason = FailureReason(outcome.failure) if outcome.failure else FailureReason.INTERNAL
                join.failure = (reason, f"rank {rank}: {outcome.message}")
        if failed:
            self._own.abort(outcome.request_id, f"rank {rank}'s lease failed")
            self._cancel_others(outcome.request_id, f"rank {rank}'s lease failed")
        self._settle(join)

    def _rank_lost(self, rank: int) -> None:
        with self._lock:
            pending = list(self._joins.values())
        for join in pending:
            self._other_outcome(
                rank, pb.AgentOutcome(request_id=join.request_id, ok=False, message="rank lost")
            )

    def _cancel_others(self, request_id: str, message: str) -> None:
        cancel = pb.AgentMessage(cancel=pb.AgentCancel(request_id=request_id, message=message))
        for rank in range(1, len(self._ranks) + 1):
            self._hub.tell(rank, cancel)

    def _settle(self, join: _Join) -> None:
        """Once every rank's lease ended: admit (all landed) or free the blocks and report the failure."""
        with self._lock:
            if join.own is None or len(join.others) < len(self._ranks):
                return
            if self._joins.get(join.request_id) is not join:
                return
            self._forget_locked(join)
        own = join.own
        if join.failure is None:
            self._on_result(own)
            return
        self._real.free(join.block_ids)
        reason, message = join.failure
        self._on_result(TransferResult(own.lease, False, reason, message))

    def _forget(self, join: _Join) -> None:
        with self._lock:
            self._forget_locked(join)

    def _forget_locked(self, join: _Join) -> None:
        if self._joins.get(join.request_id) is join:
            del self._joins[join.request_id]
        if self._by_blocks.get(join.block_ids) is join:
            del self._by_blocks[join.block_ids]


# --- rank 0 of a prefill worker --------------------------------------------------------------------------
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
    """KVSender's send() for a prefill worker of several ranks (see the module docstring), or for a worker of
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
                reason = FailureReason(outcome.failure) if outcome.failure else FailureReason.INTERNAL
                handle.failure = (reason, f"rank {rank}: {outcome.message}")
        if not outcome.ok:
            handle.abort(f"rank {rank}'s sends failed")
        self._settle(handle)

    def _rank_lost(self, rank: int) -> None:
        with self._lock:
            pending = list(self._sends.values())
        for handle in pending:
            self._other_outcome(
                rank, pb.AgentOutcome(request_id=handle.request_id, ok=False, message="rank lost")
            )

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


# --- the other ranks -------------------------------------------------------------------------------------
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
        self._link: _Link | None = None
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
        self._link = _Link(sock)
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


__all__ = [
    "AgentHub",
    "FollowerAgent",
    "ShardedReceiver",
    "ShardedSendHandle",
    "ShardedSender",
    "StepClock",
]
