"""Rank 0 of a decode worker spanning devices: KVReceiver's interface over every rank's lease of the same blocks
(see worker_host.rank_agents)."""

from __future__ import annotations

import logging
import secrets
import ssl
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from kv_transfer import (
    FailureReason,
    KVReceiver,
    Lease,
    TransferResult,
)
from kv_transfer.config import TransferConfig
from kv_transfer.contracts import Allocate, BlockAllocator
from kv_transfer.stats import TransferStats
from model_runtime.kv_layout import KVLayout
from tandem_api.tandem.v1 import kv_pb2
from tandem_api.tandem.v1 import rank_agent_pb2 as pb
from worker_host.rank_agents.link import AgentHub, held_by_all, lost_outcome, outcome_failure

log = logging.getLogger(__name__)


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
    """KVReceiver's interface for a decode worker of several ranks (see worker_host.rank_agents)."""

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
        # Bytes the other ranks landed for requests that landed whole: rank 0's receiver counts only its own.
        self._other_bytes = 0
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
        """Rank 0's receiver's stats, with the bytes every rank landed for the requests that landed (the
        worker's bytes, as a one-rank worker would count them)."""
        own = self._own.stats()
        with self._lock:
            return replace(own, bytes_ok=own.bytes_ok + self._other_bytes)

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
                join.failure = outcome_failure(rank, outcome)
        if failed:
            self._own.abort(outcome.request_id, f"rank {rank}'s lease failed")
            self._cancel_others(outcome.request_id, f"rank {rank}'s lease failed")
        self._settle(join)

    def _rank_lost(self, rank: int) -> None:
        with self._lock:
            pending = list(self._joins.values())
        for join in pending:
            self._other_outcome(rank, lost_outcome(join.request_id))

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
            others = sum(outcome.num_bytes for outcome in join.others.values())
            with self._lock:
                self._other_bytes += others
            self._on_result(replace(own, num_bytes=own.num_bytes + others))
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
