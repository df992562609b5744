"""Continuous batching: which tokens of which requests run in each engine step.

Call order (the owner holds one lock around every call; nothing here is thread-safe):

    sched.add(request)                       # WAITING; rejected now if it could never fit
    loop:
        out = sched.schedule()               # chunks to run; may preempt (out.preempted)
        run the model on out.chunks          # chunk i covers positions [num_computed, num_computed + num_tokens)
        sched.advance(out)                   # those tokens are computed now; full blocks join the prefix cache
        for each chunk with chunk.sample:    # the chunk reached the last known token: one new token
            sched.append_token(request, token)
            if the engine's stop rules say so: sched.finish(request, RequestStatus.FINISHED_*)
    sched.abort(request_id)                  # any time; a chunk of an aborted request is skipped by advance

A step first serves RUNNING requests in admission order (a decode is 1 token, a chunked prefill its next
chunk), then admits PREEMPTED requests (oldest arrival first) and then WAITING ones while the token budget and
the sequence limit allow: interactive before batch, FIFO within a class, a batch request waiting longer than
config.batch_max_wait_s taking its turn by arrival (model_runtime.waiting). Priority only orders admission:
a running request is never preempted for a higher class. A chunk is min(uncomputed tokens, budget left), so long prompts are split
across steps. When a running request needs a block and none is free, the most recently admitted running
request is preempted by recompute (blocks freed, outputs kept; on resume it recomputes prompt + outputs, from
the prefix cache where it can). Progress: the oldest running request can always get its blocks, because every
request is checked at add() to fit the whole pool alone, and everything behind it can be preempted.

Disaggregated workers use the same core:
    prefill worker: after the sampled chunk of a prompt, `detach(request)` takes it out of scheduling but
                    leaves its blocks allocated (their KV is shipped); the owner calls pool.free(block_ids).
    decode worker:  `add_running(request)` for a request whose KV landed in blocks it allocated from this
                    pool (all tokens but the last computed); it joins running at the next schedule() that has
                    a free sequence slot (interactive before batch, as for waiting prompts).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from model_runtime.block_pool import BlockPool, extend_block_hashes
from model_runtime.config import SchedulerConfig
from model_runtime.request import PENDING_TOKEN, Request, RequestStatus, ScheduledChunk, SchedulerOutput
from model_runtime.request_rules import ints_within, pool_overflow, prompt_leaves_no_room, token_cap
from model_runtime.waiting import WaitingQueue


class RequestRejected(ValueError):
    """add()/add_running() refused a request; the message says which field or limit."""


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        pool: BlockPool,
        block_size: int,
        max_model_len: int,
        clock: Callable[[], float] = time.monotonic,  # the clock of Request.arrival_time
    ) -> None:
        if block_size != pool.block_size:
            raise ValueError(f"block_size: {block_size} differs from the pool's block_size {pool.block_size}")
        if not isinstance(max_model_len, int) or max_model_len < 2:
            raise ValueError(f"max_model_len: must be an integer >= 2, got {max_model_len!r}")
        self.config = config
        self._clock = clock
        self.pool = pool
        self.block_size = block_size
        self.max_model_len = max_model_len
        self._requests: dict[str, Request] = {}  # every unfinished request this scheduler owns
        self._waiting = WaitingQueue(config.batch_max_wait_s, clock)
        self._preempted: list[Request] = []  # kept sorted by arrival_time
        self._ready = WaitingQueue(config.batch_max_wait_s, clock)  # KV landed (add_running), needs a slot
        self._running: list[Request] = []  # admission order; the tail is preempted first
        self._hashes: dict[str, list[bytes]] = {}  # chained full-block hashes per request
        self._pending: SchedulerOutput | None = None  # scheduled, not yet advanced
        # Prompt tokens taken from the prefix cache at first admission, over all requests.
        self.cached_tokens_total = 0
        # request id -> prompt tokens add() found in the prefix cache, until the request is admitted
        self._expected_hits: dict[str, int] = {}
        # add_running's requests whose prompt blocks go into the prefix cache later (_commit_deferred): those
        # admitted since the last schedule(), and those of the step that ran since.
        self._commit_next: dict[str, Request] = {}
        self._commit_later: dict[str, Request] = {}

    # --- queries ---------------------------------------------------------------------------------------
    def get(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_waiting(self) -> int:
        """Requests not running yet: waiting, preempted, and landed KV waiting for a slot."""
        return len(self._waiting) + len(self._preempted) + len(self._ready)

    @property
    def prompts_waiting(self) -> bool:
        """A new or preempted request waits for its prompt to be computed (landed KV waiting for a slot does not
        count: it needs no prompt step)."""
        return bool(self._waiting or self._preempted)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def running(self) -> tuple[Request, ...]:
        return tuple(self._running)

    def uncomputed_prompt_tokens(self) -> int:
        """Prompt tokens still to compute over every request held (the prefill placement signal). A request not
        admitted yet counts without the prefix-cache hit it found when it was added: a prompt whose every block
        but the last is cached is a few tokens of work, not its whole length."""
        return sum(
            max(0, r.num_prompt_tokens - max(r.num_computed_tokens, self._expected_hits.get(rid, 0)))
            for rid, r in self._requests.items()
        )

    def token_cap(self, request: Request) -> int:
        """Most tokens (prompt + output) the request may ever hold: max_tokens, capped by max_model_len."""
        return token_cap(request.num_prompt_tokens, request.sampling.max_tokens, self.max_model_len)

    # --- entry points ----------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue a new request. Raises RequestRejected if it is malformed or could never fit."""
        self._check_new(request)
        if request.status is not RequestStatus.WAITING or request.block_ids or request.num_computed_tokens:
            raise RequestRejected(
                f"request {request.request_id!r}: add() takes a fresh WAITING request without blocks; "
                "use add_running() for one whose KV is already computed"
            )
        self._requests[request.request_id] = request
        self._waiting.append(request)
        if self.pool.enable_prefix_caching:  # the hashes are kept for _admit's match
            hashes = self._block_hashes(request, 0, (request.num_tokens - 1) // self.block_size)
            self._expected_hits[request.request_id] = self.pool.cached_prefix_blocks(hashes) * self.block_size

    def add_running(self, request: Request) -> None:
        """Take a request whose KV already sits in its blocks (allocated from this pool) for decoding."""
        self._check_new(request)
        rid = request.request_id
        if request.num_computed_tokens != request.num_tokens - 1 or request.num_output_tokens < 1:
            raise RequestRejected(
                f"request {rid!r}: add_running needs all tokens but the last computed and at least one "
                f"output token; num_computed_tokens={request.num_computed_tokens}, "
                f"num_tokens={request.num_tokens}"
            )
        if len(request.block_ids) < self._blocks_for(request.num_computed_tokens):
            raise RequestRejected(
                f"request {rid!r}: block_ids has {len(request.block_ids)} blocks, "
                f"{self._blocks_for(request.num_computed_tokens)} needed for its computed tokens"
            )
        for block_id in request.block_ids:
            if self.pool.ref_count(block_id) < 1:
                raise RequestRejected(f"request {rid!r}: block {block_id} is not allocated in this pool")
        self._requests[rid] = request
        self._ready.append(request)
        # Its prompt's blocks enter the prefix cache after its first step's tokens went out: hashing a
        # 2-4k-token prompt (0.4 ms here, 1.5 ms behind a busy worker's other threads) would otherwise delay
        # the step that makes the request's second token.
        self._commit_next[rid] = request

    def abort(self, request_id: str) -> Request | None:
        """Finish a request as aborted, wherever it is. None if it is unknown or already finished."""
        request = self._requests.get(request_id)
        if request is not None:
            self.finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Set a finished status, free the request's blocks and forget it."""
        if not status.finished:
            raise ValueError(f"finish: status must be a FINISHED_* status, got {status}")
        self._forget(request, "finish")
        if request.block_ids:
            self.pool.free(request.block_ids)
        request.block_ids = []
        request.status = status

    def detach(self, request: Request) -> None:
        """Prefill worker: stop scheduling a running request but keep its blocks for the KV handoff."""
        if request.status is not RequestStatus.RUNNING:
            raise ValueError(f"detach: request {request.request_id!r} is {request.status.value}, not running")
        self._forget(request, "detach")

    def append_token(self, request: Request, token_id: int) -> None:
        """Record the token sampled from `request`'s last computed position."""
        rid = request.request_id
        self._check_owned(request, "append_token")
        if request.status is not RequestStatus.RUNNING:
            raise ValueError(f"append_token: request {rid!r} is {request.status.value}, not running")
        num_tokens = request.num_tokens  # read once: this runs for every sequence of every step
        if request.num_computed_tokens != num_tokens:
            raise ValueError(
                f"append_token: request {rid!r} has uncomputed tokens (num_computed_tokens="
                f"{request.num_computed_tokens}, num_tokens={num_tokens}); call advance() first"
            )
        if num_tokens >= self.token_cap(request):
            raise ValueError(
                f"append_token: request {rid!r} already holds {num_tokens} tokens, its cap "
                "(prompt + max_tokens, at most max_model_len); the engine must finish it"
            )
        if not isinstance(token_id, int) or token_id < 0:
            raise ValueError(f"append_token: token_id must be a non-negative integer, got {token_id!r}")
        request.output_token_ids.append(token_id)

    def append_pending(self, request: Request) -> None:
        """Step-ahead (Engine with scheduler.async_scheduling): hold the place of the token that the step in
        flight samples for `request`, so the next step can be scheduled before its value reaches the host.
        The next step reads the value on the device; `resolve` writes it here once it arrives, before any
        later schedule() or advance() reads the request's tokens."""
        self._check_owned(request, "append_pending")
        if request.num_computed_tokens != request.num_tokens or request.num_tokens >= self.token_cap(request):
            raise ValueError(
                f"append_pending: request {request.request_id!r} has uncomputed tokens or no room for another"
            )
        request.output_token_ids.append(PENDING_TOKEN)

    def resolve(self, request: Request, token_id: int) -> None:
        """The sampled token in place of `request`'s pending one (append_pending). The request may have been
        preempted meanwhile (its outputs are kept); it must not have finished."""
        self._check_owned(request, "resolve")
        outputs = request.output_token_ids
        if not outputs or outputs[-1] != PENDING_TOKEN:
            raise ValueError(f"resolve: request {request.request_id!r} has no pending token")
        if not isinstance(token_id, int) or token_id < 0:
            raise ValueError(f"resolve: token_id must be a non-negative integer, got {token_id!r}")
        outputs[-1] = token_id

    # --- one step --------------------------------------------------------------------------------------
    def schedule(self, hold: frozenset[str] = frozenset()) -> SchedulerOutput:
        """The next step's chunks. `hold`: ids of running requests to leave out of this step (step-ahead: those
        whose pending token is their last)."""
        if self._pending is not None:
            raise RuntimeError("schedule: the previous step's output was not passed to advance()")
        self._commit_deferred()
        self._promote_ready()
        chunks: list[ScheduledChunk] = []
        preempted: list[Request] = []
        budget = self._schedule_running(chunks, preempted, self.config.max_num_batched_tokens, hold)
        if not preempted:  # blocks are short: admitting more would only preempt again
            self._admit_waiting(chunks, budget)
        output = SchedulerOutput(chunks=tuple(chunks), preempted=tuple(preempted))
        self._pending = output if chunks else None
        return output

    def advance(self, output: SchedulerOutput) -> None:
        """Mark the chunks of `output` (the last schedule()'s) as computed."""
        if output.is_empty:
            return
        if output is not self._pending:
            raise RuntimeError("advance: output is not the last schedule() output, or was advanced already")
        self._pending = None
        for chunk in output.chunks:
            request = chunk.request
            if self._requests.get(request.request_id) is not request:
                continue  # aborted or detached while the step ran
            before = request.num_computed_tokens
            request.num_computed_tokens += chunk.num_tokens
            if request.request_id not in self._commit_later:  # else its deferred commit takes every block
                self._commit_full_blocks(request, before // self.block_size)

    # --- scheduling internals --------------------------------------------------------------------------
    def _commit_deferred(self) -> None:
        """Put the full blocks of add_running's requests into the prefix cache one schedule() after the step
        they first ran in (whose outputs the caller has delivered by now)."""
        for rid, request in self._commit_later.items():
            if self._requests.get(rid) is request and request.block_ids:  # still running with its blocks
                self._commit_full_blocks(request, 0)
        self._commit_later, self._commit_next = self._commit_next, {}

    def _promote_ready(self) -> None:
        while self._ready and len(self._running) < self.config.max_num_seqs:
            request = self._ready.popleft()
            request.status = RequestStatus.RUNNING
            self._running.append(request)

    def _schedule_running(
        self, chunks: list[ScheduledChunk], preempted: list[Request], budget: int, hold: frozenset[str]
    ) -> int:
        i = 0
        while i < len(self._running) and budget > 0:
            request = self._running[i]
            if hold and request.request_id in hold:
                i += 1
                continue
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if n <= 0:
                raise RuntimeError(
                    f"schedule: running request {request.request_id!r} has no token to compute; after a "
                    "sampled chunk call append_token, finish or detach"
                )
            if not self._reserve_blocks(request, request.num_computed_tokens + n, preempted):
                break  # it preempted itself: it was the last running request
            chunks.append(self._chunk(request, n))
            budget -= n
            i += 1
        return budget

    def _reserve_blocks(self, request: Request, num_tokens: int, preempted: list[Request]) -> bool:
        """Give `request` blocks for `num_tokens` tokens, preempting from the tail of running as needed."""
        need = self._blocks_for(num_tokens) - len(request.block_ids)
        while need > self.pool.num_free:
            victim = self._running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        if need > 0:
            request.block_ids.extend(self.pool.allocate(need))
        return True

    def _preempt(self, request: Request) -> None:
        if self._running.pop() is not request:
            raise RuntimeError(f"preempt: {request.request_id!r} is not the last running request")
        self.pool.free(request.block_ids)
        request.block_ids = []
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self._preempted.append(request)
        self._preempted.sort(key=lambda r: r.arrival_time)  # stable: ties keep preemption order

    def _admit_waiting(self, chunks: list[ScheduledChunk], budget: int) -> None:
        while budget > 0 and len(self._running) < self.config.max_num_seqs:
            preempted = bool(self._preempted)
            request = self._preempted[0] if preempted else self._waiting.peek()
            if request is None:
                return
            n = self._admit(request, budget)
            if n == 0:
                return  # the head does not fit now; keep the order rather than let others pass it
            if preempted:
                self._preempted.pop(0)
            else:
                self._waiting.remove(request)
            self._running.append(request)
            chunks.append(self._chunk(request, n))
            budget -= n

    def _admit(self, request: Request, budget: int) -> int:
        """Give a waiting/preempted request its prefix-cache hits and blocks for its first chunk; 0 if none fit."""
        # Match at most the full blocks before the last token: one token must run to sample from, and the
        # blocks it writes into must be this request's own.
        # A request that scores its prompt runs every position (model_runtime.prompt_scores).
        cached = (
            []
            if request.scoring_prompt
            else self.pool.match_hashes(
                self._block_hashes(request, 0, (request.num_tokens - 1) // self.block_size)
            )
        )
        num_computed = len(cached) * self.block_size
        n = min(request.num_tokens - num_computed, budget)
        need = self._blocks_for(num_computed + n) - len(cached)
        if need > self.pool.num_free:
            self.pool.free(cached)
            return 0
        request.block_ids = cached + self.pool.allocate(need)
        request.num_computed_tokens = num_computed
        if request.status is RequestStatus.WAITING:
            if request.scheduled_time is None:
                request.scheduled_time = self._clock()
            request.num_cached_tokens = num_computed
            self.cached_tokens_total += num_computed
            self._expected_hits.pop(request.request_id, None)
        request.status = RequestStatus.RUNNING
        return n

    def _chunk(self, request: Request, n: int) -> ScheduledChunk:
        sample = request.num_computed_tokens + n == request.num_tokens
        return ScheduledChunk(request=request, num_tokens=n, sample=sample)

    # --- bookkeeping -----------------------------------------------------------------------------------
    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _block_hashes(self, request: Request, first: int, end: int) -> list[bytes]:
        """Chained hashes of the request's full blocks [first, end), computed once per block and kept."""
        if not self.pool.enable_prefix_caching or end <= first:
            return []
        hashes = self._hashes.setdefault(request.request_id, [])
        if len(hashes) < end:
            extend_block_hashes(hashes, request.all_token_ids, self.block_size, end * self.block_size)
        return hashes[first:end]

    def _commit_full_blocks(self, request: Request, first_block: int) -> None:
        """Register the request's full computed blocks from index `first_block` on with the prefix cache."""
        end = request.num_computed_tokens // self.block_size
        hashes = self._block_hashes(request, first_block, end)
        if hashes:
            self.pool.cache_full_blocks(request.block_ids[first_block:end], hashes)

    def _check_new(self, request: Request) -> None:
        rid = request.request_id
        if rid in self._requests:
            raise RequestRejected(f"request_id: {rid!r} is already scheduled")
        if request.num_prompt_tokens == 0:
            raise RequestRejected(f"request {rid!r}: prompt_token_ids is empty")
        ids = request.all_token_ids
        if not ints_within(ids, 0) and not all(isinstance(t, int) and t >= 0 for t in ids):
            raise RequestRejected(f"request {rid!r}: token ids must be non-negative integers")
        problem = prompt_leaves_no_room(request.num_prompt_tokens, self.max_model_len)
        if problem is not None:
            raise RequestRejected(f"request {rid!r}: prompt_token_ids: {problem}")
        if request.num_tokens > self.token_cap(request):
            raise RequestRejected(
                f"request {rid!r}: already holds more tokens than its cap {self.token_cap(request)}"
            )
        problem = pool_overflow(self.token_cap(request), self.block_size, self.pool.usable)
        if problem is not None:
            raise RequestRejected(f"request {rid!r}: {problem}")

    def _check_owned(self, request: Request, where: str) -> None:
        if self._requests.get(request.request_id) is not request:
            raise ValueError(f"{where}: request {request.request_id!r} is not owned by this scheduler")

    def _forget(self, request: Request, where: str) -> None:
        """Remove a request from every queue and from the registry."""
        self._check_owned(request, where)
        rid = request.request_id
        del self._requests[rid]
        self._hashes.pop(rid, None)
        self._expected_hits.pop(rid, None)
        self._commit_next.pop(rid, None)
        self._commit_later.pop(rid, None)
        for queue in (self._running, self._preempted):
            _remove_by_identity(queue, request)
        self._waiting.remove(request)
        self._ready.remove(request)


def _remove_by_identity(queue: list[Request], request: Request) -> None:
    # Request is a dataclass with field-wise ==, so list.remove could drop an equal twin: compare identity.
    for i, r in enumerate(queue):
        if r is request:
            del queue[i]
            return
