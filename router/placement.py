"""Which worker gets a request: the only place that decides. Pure functions over plain values.

Every candidate gets one cost, in prompt tokens of work that would stand before or beside the request there:

    prefill   : queued prefill tokens + this prompt's tokens it would still compute (after its prefix-cache hit)
    decode    : running sequences x CostWeights.running_sequence_tokens + queued prefill tokens
                + KV pressure (CostWeights.kv_full_tokens x the fraction of its KV blocks in use)
    colocated : decode's cost + this prompt's tokens it would still compute
    fit       : a decode or colocated worker whose free blocks cannot hold the prompt ranks after every one
                that can (its poll may be stale, so it stays a last resort, not a refusal)
    ties      : `turn` (a counter the caller advances per placement) rotates among equal costs, so an idle
                cluster spreads traffic over every worker instead of always picking the first; among prefill
                workers of equal cost, those on the decode worker's node come first (a cheaper handoff).
    pairs     : a prefill worker pairs with a decode worker when their KV layouts match and, if the router knows
                the deployment's transfer.kinds and both advertised their node and transports, some allowed
                transport suits both (router.transport_choice); otherwise the pair is not placed.

The loads are the workers' last polled numbers corrected by the router's own charges since that poll
(`WorkerLoad.charged`): without the correction a burst arriving between two polls would all land on the
worker that looked emptiest at the last poll. Counting queued work rather than free memory is what keeps a
replica that has just freed its blocks from taking a whole burst.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from model_runtime.roles import WorkerRole
from router.transport_choice import NoCommonTransport, PairEnd, pair_transport

if TYPE_CHECKING:
    from router.config import RouterConfig

DEFAULT_BLOCK_SIZE = 16  # used for a worker that has not reported its block size yet


@dataclass(frozen=True)
class WorkerLoad:
    """One worker as placement sees it. `ready`: READY at the last poll and not failing since."""

    worker_id: str
    role: WorkerRole
    ready: bool = True
    free_kv_blocks: int = 0
    running_requests: int = 0
    queued_prefill_tokens: int = 0
    layout_fingerprint: str = ""
    kv_blocks_total: int = 0  # 0: unknown (no KV pressure term)
    kv_block_size: int = 0  # tokens per block; 0: unknown
    pair_end: PairEnd | None = None  # its node and KV transports; None: not advertised (an older worker)

    def charged(self, running: int = 0, kv_blocks: int = 0, prefill_tokens: int = 0) -> WorkerLoad:
        """The load after the router's own placements that the last poll could not have seen yet."""
        return replace(
            self,
            free_kv_blocks=max(0, self.free_kv_blocks - kv_blocks),
            running_requests=self.running_requests + running,
            queued_prefill_tokens=self.queued_prefill_tokens + prefill_tokens,
        )

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // (self.kv_block_size or DEFAULT_BLOCK_SIZE))


@dataclass(frozen=True)
class PromptWork:
    """What placement knows of one request: its prompt length (prompt + tokens already sent, on a resume) and,
    per worker, how many of those tokens that worker's prefix cache holds (the router's estimate)."""

    num_tokens: int = 0
    cached: Mapping[str, int] = field(default_factory=dict)

    def cached_on(self, worker_id: str) -> int:
        return min(self.num_tokens, self.cached.get(worker_id, 0))

    def uncached_on(self, worker_id: str) -> int:
        """Prompt tokens the worker would still compute."""
        return self.num_tokens - self.cached_on(worker_id)


@dataclass(frozen=True)
class CostWeights:
    """How decode-side load converts to prompt tokens of work. running_sequence_tokens: what one running
    sequence costs a newcomer (it shares every step's token budget and KV reads); kv_full_tokens: the cost of a
    completely full KV cache (a nearly full worker preempts and refuses reservations)."""

    running_sequence_tokens: int = 32
    kv_full_tokens: int = 1024


@dataclass(frozen=True)
class LocalPrefill:
    """When a disaggregated request is prefilled on its chosen decode worker instead (the same Decode call with
    local_prefill that colocated workers serve: no prefill worker, no KV transfer).

    max_uncached_tokens: local when the decode worker would compute at most this many prompt tokens (a short
      prompt, or a long one mostly in its prefix cache); 0 turns local prefill off.
    max_queued_tokens: ... and only while the prompt tokens queued there, this one included, stay within this
      (headroom), so local prefills never stall that worker's running decodes for long. The worker must also
      have free blocks for the prompt.
    spill_queued_tokens: any prompt spills onto its decode worker when the least loaded matching prefill
      worker already has at least this many prompt tokens queued, while the decode worker's own queue, this
      prompt included, stays within it too; 0: never. A prefill pool that is short for the traffic (2 prefill +
      2 decode GPUs on 4x H200 missed TTFT at 24 req/s of 2-4k-token prompts while decode had room, and 3 + 1
      missed TPOT: docs/performance.md) then borrows the decode workers' spare compute. A remote prefill that
      would wait behind that many tokens loses more time than a local one costs the decode batch.
    """

    max_uncached_tokens: int = 0
    max_queued_tokens: int = 2048
    spill_queued_tokens: int = 0

    def reason(self, decode: WorkerLoad, work: PromptWork) -> str | None:
        """LOCAL_CACHED or LOCAL_SHORT when the prompt should be prefilled on `decode`, else None."""
        uncached = work.uncached_on(decode.worker_id)
        applies = (
            self.max_uncached_tokens > 0
            and uncached <= self.max_uncached_tokens
            and decode.queued_prefill_tokens + uncached <= self.max_queued_tokens
            and _fits(decode, work)
        )
        if not applies:
            return None
        return LOCAL_CACHED if work.cached_on(decode.worker_id) >= uncached else LOCAL_SHORT

    def spills(self, decode: WorkerLoad, prefill: WorkerLoad, work: PromptWork) -> bool:
        """The prompt goes to `decode` instead of `prefill` (the cheapest matching prefill worker): see
        spill_queued_tokens."""
        limit = self.spill_queued_tokens
        return (
            limit > 0
            and prefill.queued_prefill_tokens >= limit
            and decode.queued_prefill_tokens + work.uncached_on(decode.worker_id) <= limit
            and _fits(decode, work)
        )


# Why the prompt runs where it does (Placement.reason; the router counts placements by it).
PREFILL_WORKER = "prefill_worker"  # on a prefill worker, its KV shipped to the decode worker
LOCAL_SHORT = "local_short"  # on the decode worker: few tokens to compute (a short prompt)
LOCAL_CACHED = "local_cached"  # on the decode worker: most of the prompt is in its prefix cache
# on the decode worker: the prefill workers' queues are long (spill_queued_tokens)
LOCAL_SPILL = "local_spill"
COLOCATED = "colocated"  # on a colocated worker (no prefill/decode pair)


@dataclass(frozen=True)
class Placement:
    """Where one request runs. prefill None: the decode worker computes the prompt itself (colocated, or a
    decode worker chosen for local prefill)."""

    decode: str
    prefill: str | None = None
    reason: str = field(default="", compare=False)

    @property
    def local_prefill(self) -> bool:
        return self.prefill is None


def prefill_cost(w: WorkerLoad, work: PromptWork) -> int:
    return w.queued_prefill_tokens + work.uncached_on(w.worker_id)


def decode_cost(w: WorkerLoad, work: PromptWork, weights: CostWeights = CostWeights()) -> int:
    cost = w.running_requests * weights.running_sequence_tokens + w.queued_prefill_tokens
    if w.kv_blocks_total > 0:
        used = w.kv_blocks_total - min(w.free_kv_blocks, w.kv_blocks_total)
        cost += weights.kv_full_tokens * used // w.kv_blocks_total
    return cost


def colocated_cost(w: WorkerLoad, work: PromptWork, weights: CostWeights = CostWeights()) -> int:
    return decode_cost(w, work, weights) + work.uncached_on(w.worker_id)


def _same_node(prefill: WorkerLoad, decode: WorkerLoad | None) -> bool:
    """Both advertised one known node (router.transport_choice.PairEnd.node_id)."""
    a, b = prefill.pair_end, decode.pair_end if decode is not None else None
    return a is not None and b is not None and bool(a.node_id) and a.node_id == b.node_id


def _fits(w: WorkerLoad, work: PromptWork) -> bool:
    return w.free_kv_blocks >= w.blocks_for(work.num_tokens)


def _ranked(
    loads: Sequence[WorkerLoad],
    role: WorkerRole,
    key: Callable[[WorkerLoad], tuple[int, ...]],
    exclude: Collection[str],
    turn: int,
) -> list[WorkerLoad]:
    """Ready workers of `role`, best (lowest key) first; each run of equal keys is rotated by `turn`."""
    candidates = sorted(
        (w for w in loads if w.role is role and w.ready and w.worker_id not in exclude),
        key=lambda w: (key(w), w.worker_id),
    )
    ranked: list[WorkerLoad] = []
    i = 0
    while i < len(candidates):
        j = i
        while j < len(candidates) and key(candidates[j]) == key(candidates[i]):
            j += 1
        group = candidates[i:j]
        shift = turn % len(group)
        ranked += group[shift:] + group[:shift]
        i = j
    return ranked


@dataclass(frozen=True)
class Placer:
    """The cost model with its settings; `place` is its one decision."""

    weights: CostWeights = CostWeights()
    local_prefill: LocalPrefill = LocalPrefill()
    transfer_kinds: tuple[str, ...] = ()  # the deployment's transfer.kinds; (): pairs' transports unchecked

    def transport_refusal(self, prefill: WorkerLoad, decode: WorkerLoad) -> str | None:
        """Why the pair has no allowed transport in common (router.transport_choice), or None when it has one or
        cannot be checked (no transfer_kinds, or a worker that advertised nothing)."""
        if not self.transfer_kinds or prefill.pair_end is None or decode.pair_end is None:
            return None
        try:
            pair_transport(self.transfer_kinds, prefill.pair_end, decode.pair_end)
        except NoCommonTransport as exc:
            return f"{prefill.worker_id} -> {decode.worker_id}: {exc}"
        return None

    def unpaired_reason(self, loads: Sequence[WorkerLoad]) -> str | None:
        """Why no ready prefill/decode pair with one layout can be placed, when the only obstacle is that none
        has a transport in common (the first pair's refusal); else None. For a request that found no worker."""
        ready = [w for w in loads if w.ready]
        refusals = []
        for decode in (w for w in ready if w.role is WorkerRole.DECODE):
            for prefill in (w for w in ready if w.role is WorkerRole.PREFILL):
                if prefill.layout_fingerprint != decode.layout_fingerprint:
                    continue
                reason = self.transport_refusal(prefill, decode)
                if reason is None:
                    return None
                refusals.append(reason)
        return refusals[0] if refusals else None

    def decodes(
        self, loads: Sequence[WorkerLoad], work: PromptWork, exclude: Collection[str] = (), turn: int = 0
    ) -> list[WorkerLoad]:
        def key(w: WorkerLoad) -> tuple[int, int]:
            return (not _fits(w, work), decode_cost(w, work, self.weights))

        return _ranked(loads, WorkerRole.DECODE, key, exclude, turn)

    def prefills(
        self,
        loads: Sequence[WorkerLoad],
        work: PromptWork,
        layout_fingerprint: str,
        exclude: Collection[str] = (),
        turn: int = 0,
        decode: WorkerLoad | None = None,
    ) -> list[WorkerLoad]:
        """Prefill workers whose KV layout matches the decode worker's and, given `decode`, that have a transport
        in common with it (they cannot pair otherwise), best first; at equal cost one on the decode worker's
        node first (its KV travels inside the node)."""

        def key(w: WorkerLoad) -> tuple[int, int]:
            return (prefill_cost(w, work), not _same_node(w, decode))

        ranked = _ranked(loads, WorkerRole.PREFILL, key, exclude, turn)
        return [
            w
            for w in ranked
            if w.layout_fingerprint == layout_fingerprint
            and (decode is None or self.transport_refusal(w, decode) is None)
        ]

    def colocated(
        self, loads: Sequence[WorkerLoad], work: PromptWork, exclude: Collection[str] = (), turn: int = 0
    ) -> list[WorkerLoad]:
        def key(w: WorkerLoad) -> tuple[int, int]:
            return (not _fits(w, work), colocated_cost(w, work, self.weights))

        return _ranked(loads, WorkerRole.COLOCATED, key, exclude, turn)

    def place(
        self,
        loads: Sequence[WorkerLoad],
        work: PromptWork = PromptWork(),
        exclude: Collection[str] = (),
        turn: int = 0,
    ) -> Placement | None:
        """The cheapest decode worker, prefilled locally when LocalPrefill applies, else with the cheapest
        matching prefill worker; without any pair, the cheapest colocated worker; else None."""
        for decode in self.decodes(loads, work, exclude, turn):
            local = self.local_prefill.reason(decode, work)
            if local is not None:
                return Placement(decode.worker_id, None, local)
            prefills = self.prefills(loads, work, decode.layout_fingerprint, exclude, turn, decode)
            if prefills:
                if self.local_prefill.spills(decode, prefills[0], work):
                    return Placement(decode.worker_id, None, LOCAL_SPILL)
                return Placement(decode.worker_id, prefills[0].worker_id, PREFILL_WORKER)
        colocated = self.colocated(loads, work, exclude, turn)
        return Placement(colocated[0].worker_id, None, COLOCATED) if colocated else None


DEFAULT_PLACER = Placer()


def placer_for(config: RouterConfig) -> Placer:
    """A router's placer: its local prefill settings, and the transports pairs must have in common."""
    local = LocalPrefill(
        config.local_prefill_max_tokens,
        config.local_prefill_max_queued_tokens,
        config.local_prefill_spill_tokens,
    )
    return Placer(local_prefill=local, transfer_kinds=config.transfer_kinds)


def choose_decode(
    loads: Sequence[WorkerLoad], work: PromptWork = PromptWork(), exclude: Collection[str] = (), turn: int = 0
) -> WorkerLoad | None:
    ranked = DEFAULT_PLACER.decodes(loads, work, exclude, turn)
    return ranked[0] if ranked else None


def choose_prefill(
    loads: Sequence[WorkerLoad],
    layout_fingerprint: str,
    work: PromptWork = PromptWork(),
    exclude: Collection[str] = (),
    turn: int = 0,
) -> WorkerLoad | None:
    ranked = DEFAULT_PLACER.prefills(loads, work, layout_fingerprint, exclude, turn)
    return ranked[0] if ranked else None


def place(
    loads: Sequence[WorkerLoad], work: PromptWork = PromptWork(), exclude: Collection[str] = (), turn: int = 0
) -> Placement | None:
    return DEFAULT_PLACER.place(loads, work, exclude, turn)


def can_serve(loads: Sequence[WorkerLoad], placer: Placer = DEFAULT_PLACER) -> bool:
    """True when some request could be placed now: a ready prefill/decode pair or a ready colocated worker.
    The health service reports exactly this (with the router's placer), so SERVING means placement would find
    workers."""
    return placer.place(loads) is not None
