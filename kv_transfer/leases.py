"""LeaseTable: the receiver's reserved blocks, their handles, and who owns the blocks at each moment.

    reserve() ---> RESERVED --claim()--> RECEIVING --land()--> (caller owns the blocks)
                   |  ^ renew()             |
                   |  '---'                 |
           cancel/expire: freed now    cancel/expire: only flagged; the receiving threads see the flag,
                                       stop writing, then the last fail_claimed() frees

A claim names the heads it fills (a window of the cache's heads; the whole cache unless the sender is one rank
of a tensor-parallel prefill worker of another size). Several claims may fill one lease if their windows do
not overlap: the lease lands when its windows cover every head and each claimant's writes completed; one
claimant's failure fails the lease, and its blocks are freed once the last claimant has stopped writing.

A lease lives `ttl_s` past its reservation or its last renew(). Its holder (the decode call waiting for the
KV) renews it while it waits, so a prompt queued for a long time on the prefill side keeps its room; once a
sender claims it, renewals stop and the transfer has what is left of the last term, so a stalled transfer or
a holder that vanished still ends within one TTL.

Invariant: a block is returned to the allocator only by the thread that last could write into it. A lease
with no claimant writing has no writer, so cancel() and expire() free it at once; otherwise it is freed by
its last receiving thread in fail_claimed() after that thread's last write, never by the reaper. A handle is 16 random bytes, bound to one
request id, usable for one claim; retired handles are remembered (bounded) so a reused or expired handle fails
with the precise reason, and an unknown one with UNKNOWN_HANDLE.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kv_transfer.contracts import Allocate, BlockAllocator, FailureReason, Lease, NoRoom, TransferFailed
from model_runtime.kv_layout import KVLayout

log = logging.getLogger(__name__)

HANDLE_BYTES = 16
RETIRED_CAPACITY = 16384

# (lease, why it failed, monotonic time of the claim or 0.0): called after the blocks went back to the allocator.
FailedCallback = Callable[[Lease, TransferFailed, float], None]


class LeaseState(enum.Enum):
    RESERVED = 1
    RECEIVING = 2


@dataclass
class _Entry:
    lease: Lease
    state: LeaseState = LeaseState.RESERVED
    ttl_s: float = 0.0
    cancel: TransferFailed | None = None
    claimed_at: float = 0.0  # the first claim's
    windows: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # claimed (begin, count)
    writing: int = 0  # claimants that may still write
    heads_landed: int = 0


class LeaseTable:
    def __init__(
        self,
        layout: KVLayout,
        allocator: BlockAllocator,
        on_failed: FailedCallback,
        clock: Callable[[], float] = time.monotonic,
        before_free: Callable[[Lease], bool] | None = None,
    ) -> None:
        """before_free(lease): called before a failed lease's blocks go back to the allocator, once nothing
        may write into them any more but what the receiver itself queued (an armed doorbell chain); False
        keeps the blocks out of the allocator for good (a write could not be ruled out)."""
        self._layout = layout
        self._allocator = allocator
        self._on_failed = on_failed
        self._before_free = before_free
        self._clock = clock
        self._lock = threading.Lock()
        self._by_handle: dict[bytes, _Entry] = {}
        self._by_request: dict[str, bytes] = {}
        self._retired: OrderedDict[bytes, FailureReason | None] = OrderedDict()  # None: landed

    def __len__(self) -> int:
        return len(self._by_handle)

    # --- reserve ---------------------------------------------------------------------------------------
    def reserve(
        self,
        request_id: str,
        num_tokens: int,
        ttl_s: float,
        allocate: Allocate | None = None,
        transport: str = "tcp",
        handle: bytes | None = None,
    ) -> Lease:
        """`allocate` takes the blocks instead of the allocator's allocate() (its errors propagate); they go
        back through the allocator's free() either way. `transport`: the only one the lease may arrive over.
        `handle`: the lease's credential when another rank of the same worker chose it (random otherwise)."""
        if handle is not None and len(handle) != HANDLE_BYTES:
            raise ValueError(f"handle: must be {HANDLE_BYTES} bytes, got {len(handle)}")
        num_blocks = self._check_request(request_id, num_tokens, ttl_s)
        with self._lock:
            if request_id in self._by_request:
                raise ValueError(f"request_id {request_id!r} already holds a lease")
        block_ids = (allocate or self._allocator.allocate)(num_blocks)
        if block_ids is None:
            raise NoRoom(request_id, num_blocks)
        self._check_allocation(block_ids, num_blocks)
        now = self._clock()
        lease = Lease(
            request_id,
            handle if handle is not None else secrets.token_bytes(HANDLE_BYTES),
            tuple(block_ids),
            num_tokens,
            now,
            now + ttl_s,
            transport,
        )
        with self._lock:
            duplicate = request_id in self._by_request or lease.handle in self._by_handle
            if not duplicate:
                self._by_handle[lease.handle] = _Entry(lease, ttl_s=ttl_s)
                self._by_request[request_id] = lease.handle
        if duplicate:  # a concurrent reserve() for the same request won the race
            self._allocator.free(block_ids)
            raise ValueError(f"request_id {request_id!r} already holds a lease")
        return lease

    def _check_request(self, request_id: str, num_tokens: int, ttl_s: float) -> int:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id: must be a non-empty string, got {request_id!r}")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
            raise ValueError(f"num_tokens: must be an integer >= 1, got {num_tokens!r}")
        if not ttl_s > 0:
            raise ValueError(f"ttl_s: must be > 0, got {ttl_s!r}")
        num_blocks = self._layout.blocks_for_tokens(num_tokens)
        if num_blocks > self._layout.usable_blocks:
            raise ValueError(
                f"num_tokens: {num_tokens} tokens need {num_blocks} blocks, more than the cache's "
                f"{self._layout.usable_blocks}"
            )
        return num_blocks

    def _check_allocation(self, block_ids: list[int], num_blocks: int) -> None:
        """The allocator is trusted but verified: a wrong id here would let a peer overwrite someone's KV."""
        problem = None
        if len(block_ids) != num_blocks or len(set(block_ids)) != num_blocks:
            problem = f"allocator returned {block_ids!r} for {num_blocks} distinct blocks"
        else:
            try:
                self._layout.check_block_ids(block_ids, "allocator block id")
            except ValueError as exc:
                problem = str(exc)
        if problem is not None:
            self._allocator.free(block_ids)
            raise RuntimeError(problem)

    def renew(self, request_id: str) -> bool:
        """Push an unclaimed lease's expiry to now + its TTL. False (and nothing changes) when the request has
        no lease, a sender already claimed it, or it expired or was cancelled: an expired lease stays ended."""
        with self._lock:
            handle = self._by_request.get(request_id)
            entry = self._by_handle.get(handle) if handle is not None else None
            if entry is None or entry.state is not LeaseState.RESERVED or entry.cancel is not None:
                return False
            now = self._clock()
            if now > entry.lease.expires_at:
                return False
            entry.lease = dataclasses.replace(entry.lease, expires_at=now + entry.ttl_s)
            return True

    # --- the receiving thread --------------------------------------------------------------------------
    def claim(self, handle: bytes, request_id: str, window: tuple[int, int] | None = None) -> Lease:
        """Bind heads [begin, begin + count) of the lease (`window`; None: every head) to the calling thread,
        their only writer from now on, or raise why not."""
        begin, count = window if window is not None else (0, self._layout.num_kv_heads)
        expired = None
        with self._lock:
            entry = self._by_handle.get(handle)
            if entry is None:
                raise self._retired_failure(handle)
            if entry.lease.request_id != request_id:
                raise TransferFailed(
                    FailureReason.HANDLE_MISMATCH,
                    f"the handle belongs to another request than {request_id!r}",
                )
            if entry.cancel is not None:
                raise entry.cancel
            if any(begin < b + c and b < begin + count for b, c in entry.windows):
                raise TransferFailed(
                    FailureReason.HANDLE_BUSY,
                    f"request {request_id!r}: another connection is filling heads "
                    f"[{begin}, {begin + count}) of this lease",
                )
            if self._clock() > entry.lease.expires_at:
                if entry.writing == 0:
                    expired = self._remove(entry, FailureReason.LEASE_EXPIRED)
                else:
                    raise TransferFailed(
                        FailureReason.LEASE_EXPIRED, f"request {request_id!r}: the lease expired"
                    )
            else:
                if entry.state is LeaseState.RESERVED:
                    entry.state = LeaseState.RECEIVING
                    entry.claimed_at = self._clock()
                entry.windows.append((begin, count))
                entry.writing += 1
                return entry.lease
        failure = TransferFailed(FailureReason.LEASE_EXPIRED, f"request {request_id!r}: the lease expired")
        self._release(expired, failure, 0.0)
        raise failure

    def cancellation(self, handle: bytes) -> TransferFailed | None:
        """Why the claimed lease must stop (abort, expiry, shutdown), or None. Polled by the receiving
        thread; reads one attribute, so it takes no lock."""
        entry = self._by_handle.get(handle)
        if entry is None:
            return TransferFailed(FailureReason.INTERNAL, "a claimed lease left the table")
        return entry.cancel

    def land(self, handle: bytes, count: int | None = None) -> Lease | None:
        """The claimant's `count` heads (None: every head) arrived and its writes completed. Returns the lease
        once every head has landed (the blocks now belong to the caller), None while other heads are still to
        come. Raises the cancellation if one came first (the claimant then calls fail_claimed)."""
        with self._lock:
            entry = self._by_handle[handle]
            if entry.cancel is not None:
                raise entry.cancel
            entry.writing -= 1
            entry.heads_landed += self._layout.num_kv_heads if count is None else count
            if entry.heads_landed < self._layout.num_kv_heads:
                return None
            self._remove(entry, None)
            return entry.lease

    def fail_claimed(self, handle: bytes, failure: TransferFailed) -> None:
        """A receiving thread gave up and will not write again: the lease fails; its blocks are freed and the
        failure reported once no other claimant may still write."""
        with self._lock:
            entry = self._by_handle.get(handle)
            if entry is None:
                return
            entry.writing -= 1
            if entry.cancel is None:
                entry.cancel = failure  # the other claimants stop at their next check
            if entry.writing > 0:
                return
            self._remove(entry, failure.reason)
        self._release(entry, failure, entry.claimed_at)

    # --- other threads ---------------------------------------------------------------------------------
    def cancel(self, key: str | bytes, failure: TransferFailed) -> bool:
        """Abort the lease of a request id or handle. False when there is none (landed, failed, unknown)."""
        with self._lock:
            handle = key if isinstance(key, bytes) else self._by_request.get(key)
            entry = self._by_handle.get(handle) if handle is not None else None
            if entry is None:
                return False
            freed = self._cancel_locked(entry, failure)
        if freed is not None:
            self._release(freed, failure, 0.0)
        return True

    def expire(self) -> None:
        """Run by the reaper: end every lease past its expiry, whether or not any traffic comes."""
        now = self._clock()
        freed = []
        with self._lock:
            for entry in list(self._by_handle.values()):
                if now > entry.lease.expires_at and entry.cancel is None:
                    failure = TransferFailed(
                        FailureReason.LEASE_EXPIRED, f"request {entry.lease.request_id!r}: the lease expired"
                    )
                    done = self._cancel_locked(entry, failure)
                    if done is not None:
                        freed.append((done, failure))
        for entry, failure in freed:
            self._release(entry, failure, 0.0)

    def cancel_all(self, failure: TransferFailed) -> None:
        with self._lock:
            handles = list(self._by_handle)
        for handle in handles:
            self.cancel(handle, failure)

    # --- internals -------------------------------------------------------------------------------------
    def _cancel_locked(self, entry: _Entry, failure: TransferFailed) -> _Entry | None:
        if entry.writing == 0:  # reserved, or every claimant so far landed its heads: nobody writes
            return self._remove(entry, failure.reason)
        if entry.cancel is None:
            entry.cancel = failure  # the last receiving thread frees after its last write
        return None

    def _remove(self, entry: _Entry, reason: FailureReason | None) -> _Entry:
        handle = entry.lease.handle
        del self._by_handle[handle]
        del self._by_request[entry.lease.request_id]
        self._retired[handle] = reason
        while len(self._retired) > RETIRED_CAPACITY:
            self._retired.popitem(last=False)
        return entry

    def _release(self, entry: _Entry, failure: TransferFailed, claimed_at: float) -> None:
        if self._before_free is None or self._before_free(entry.lease):
            self._allocator.free(entry.lease.block_ids)
        else:
            log.error(
                "request %r: %d KV blocks kept out of the allocator (a write into them could not be ruled out)",
                entry.lease.request_id,
                len(entry.lease.block_ids),
            )
        self._on_failed(entry.lease, failure, claimed_at)

    def active(self, handle: bytes) -> bool:
        """Whether the lease of this handle is still in the table (reserved or receiving)."""
        with self._lock:
            return handle in self._by_handle

    def _retired_failure(self, handle: bytes) -> TransferFailed:
        if handle not in self._retired:
            return TransferFailed(FailureReason.UNKNOWN_HANDLE, "no lease was issued with this handle")
        reason = self._retired[handle]
        if reason is None:
            return TransferFailed(FailureReason.HANDLE_REUSED, "the lease of this handle already landed")
        if reason in (FailureReason.LEASE_EXPIRED, FailureReason.RECEIVER_ABORTED, FailureReason.SHUTDOWN):
            return TransferFailed(reason, f"the lease of this handle already ended ({reason.name})")
        return TransferFailed(
            FailureReason.HANDLE_REUSED, f"the lease of this handle already failed ({reason.name})"
        )
