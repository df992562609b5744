"""Which worker gets a request: the only place that decides. Pure functions over plain values.

    decode   : most free KV blocks, then fewest running requests
    prefill  : fewest queued prefill tokens, among those whose KV layout matches the chosen decode worker
    colocated: like decode; used when no prefill/decode pair is available
    ties     : `turn` (a counter the caller advances per placement) rotates among equally good workers, so
               an idle cluster spreads traffic over every worker instead of always picking the first.

The loads are the workers' last polled numbers corrected by the router's own charges since that poll
(`WorkerLoad.charged`): without the correction a burst arriving between two polls would all land on the
worker that looked emptiest at the last poll.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace

from model_runtime.roles import WorkerRole


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

    def charged(self, running: int = 0, kv_blocks: int = 0, prefill_tokens: int = 0) -> WorkerLoad:
        """The load after the router's own placements that the last poll could not have seen yet."""
        return replace(
            self,
            free_kv_blocks=max(0, self.free_kv_blocks - kv_blocks),
            running_requests=self.running_requests + running,
            queued_prefill_tokens=self.queued_prefill_tokens + prefill_tokens,
        )


@dataclass(frozen=True)
class Placement:
    """Where one request runs. prefill None: the decode worker computes the prompt itself (colocated)."""

    decode: str
    prefill: str | None = None

    @property
    def local_prefill(self) -> bool:
        return self.prefill is None


def _decode_key(w: WorkerLoad) -> tuple[int, int]:
    return (-w.free_kv_blocks, w.running_requests)


def _prefill_key(w: WorkerLoad) -> tuple[int]:
    return (w.queued_prefill_tokens,)


def _ranked(
    loads: Sequence[WorkerLoad],
    role: WorkerRole,
    key: Callable[[WorkerLoad], tuple[int, ...]],
    exclude: Collection[str],
    turn: int,
) -> list[WorkerLoad]:
    """Ready workers of `role`, best first; each run of equal keys is rotated by `turn`."""
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


def choose_decode(
    loads: Sequence[WorkerLoad], exclude: Collection[str] = (), turn: int = 0
) -> WorkerLoad | None:
    ranked = _ranked(loads, WorkerRole.DECODE, _decode_key, exclude, turn)
    return ranked[0] if ranked else None


def choose_prefill(
    loads: Sequence[WorkerLoad], layout_fingerprint: str, exclude: Collection[str] = (), turn: int = 0
) -> WorkerLoad | None:
    """The least loaded prefill worker whose KV layout matches the decode worker's (they cannot pair otherwise)."""
    ranked = _ranked(loads, WorkerRole.PREFILL, _prefill_key, exclude, turn)
    return next((w for w in ranked if w.layout_fingerprint == layout_fingerprint), None)


def place(loads: Sequence[WorkerLoad], exclude: Collection[str] = (), turn: int = 0) -> Placement | None:
    """A decode worker plus a matching prefill worker if any pair exists, else a colocated worker, else None."""
    for decode in _ranked(loads, WorkerRole.DECODE, _decode_key, exclude, turn):
        prefill = choose_prefill(loads, decode.layout_fingerprint, exclude, turn)
        if prefill is not None:
            return Placement(decode.worker_id, prefill.worker_id)
    colocated = _ranked(loads, WorkerRole.COLOCATED, _decode_key, exclude, turn)
    return Placement(colocated[0].worker_id) if colocated else None


def can_serve(loads: Sequence[WorkerLoad]) -> bool:
    """True when some request could be placed now: a ready prefill/decode pair or a ready colocated worker.
    The health service reports exactly this, so SERVING means placement would find workers."""
    return place(loads) is not None
