"""How loaded each pool is over the autoscaler's window, from the workers' own numbers (Admin.Status's WorkerInfo,
as the routers last polled them). Latency alone cannot say whether a pool may give up a worker: a prefill pool's
time to first token stays low until its workers are nearly always busy and then climbs steeply (the sweeps in
docs/performance.md: two prefill workers at 12 req/s answered with a p90 of 0.39 s, one worker alone at the same
rate was at its limit). So a pool shrinks, or gives a worker to the other pool, only when its load would fit
in one worker fewer:

    prefill      busy share: the increase of busy_seconds_total over the window / (elapsed time x workers)
    decode       KV occupancy: the pool's kv_blocks_used / kv_blocks_total, the highest reading in the window
    colocated    KV occupancy, as decode (a colocated engine runs steps whenever it holds a sequence, so its busy
                 share says little)

    projected = load x n / (n - 1)          it fits when projected <= autoscaler.scale_down_utilization

A pool whose workers report nothing (no reading yet, a worker of an older version without busy_seconds_total)
has no load: the policy then keeps it as it is rather than guess.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from model_runtime.roles import WorkerRole
from tandem_api.tandem.v1 import admin_pb2

WorkerSource = Callable[[], Sequence[admin_pb2.WorkerInfo]]  # the workers as the router(s) last polled them

MAX_READINGS = 4096  # per tracker: a bound whatever the interval and window


@dataclass(frozen=True)
class PoolLoad:
    """One pool's load over the window (0..1, None when its workers gave no reading)."""

    role: WorkerRole
    workers: int  # ready workers in the last reading
    busy_share: float | None = None
    kv_occupancy: float | None = None

    @property
    def load(self) -> float | None:
        """The share that decides whether the pool fits in one worker fewer (see the module docstring)."""
        return self.busy_share if self.role is WorkerRole.PREFILL else self.kv_occupancy

    def projected(self, workers: int) -> float | None:
        """The load spread over `workers` instead of self.workers (None without a load or a worker)."""
        load = self.load
        if load is None or workers <= 0 or self.workers <= 0:
            return None
        return load * self.workers / workers


@dataclass(frozen=True)
class _Reading:
    at: float
    # (pool, worker id) -> busy_seconds_total (the ready workers that report it)
    busy: dict[tuple[WorkerRole, str], float]
    kv: dict[WorkerRole, float]  # pool -> kv_blocks_used / kv_blocks_total
    workers: dict[WorkerRole, int]  # pool -> ready workers


class LoadTracker:
    """Readings of the workers at each evaluation; `loads(window_s)` summarises the ones in the window."""

    def __init__(self, source: WorkerSource) -> None:
        self._source = source
        self._readings: deque[_Reading] = deque(maxlen=MAX_READINGS)

    def read(self, now: float) -> None:
        infos = [w for w in self._source() if w.state == admin_pb2.WORKER_STATE_READY]
        used: dict[WorkerRole, int] = {}
        total: dict[WorkerRole, int] = {}
        workers: dict[WorkerRole, int] = {}
        busy: dict[tuple[WorkerRole, str], float] = {}
        for info in infos:
            if info.role == admin_pb2.WORKER_ROLE_UNSPECIFIED:
                continue
            role = WorkerRole.from_wire(info.role)
            workers[role] = workers.get(role, 0) + 1
            used[role] = used.get(role, 0) + info.kv_blocks_used
            total[role] = total.get(role, 0) + info.kv_blocks_total
            if info.busy_seconds_total > 0:
                busy[(role, info.worker_id)] = info.busy_seconds_total
        kv = {role: used[role] / total[role] for role in total if total[role] > 0}
        self._readings.append(_Reading(now, busy, kv, workers))

    def loads(self, window_s: float) -> dict[WorkerRole, PoolLoad]:
        """Each pool's load over the readings of the last window_s seconds (as of the newest reading)."""
        if not self._readings:
            return {}
        last = self._readings[-1]
        recent = [r for r in self._readings if r.at >= last.at - window_s]
        return {
            role: PoolLoad(role, n, self._busy_share(role, recent), self._kv_peak(role, recent))
            for role, n in last.workers.items()
        }

    @staticmethod
    def _busy_share(role: WorkerRole, recent: list[_Reading]) -> float | None:
        """Mean busy share of the pool's workers that reported at both ends of the window."""
        first, last = recent[0], recent[-1]
        elapsed = last.at - first.at
        if elapsed <= 0:
            return None
        shares = [
            min(1.0, (last.busy[w] - first.busy[w]) / elapsed)
            for w in last.busy
            if w[0] is role and w in first.busy and last.busy[w] >= first.busy[w]  # not restarted
        ]
        return sum(shares) / len(shares) if shares else None

    @staticmethod
    def _kv_peak(role: WorkerRole, recent: list[_Reading]) -> float | None:
        values = [r.kv[role] for r in recent if role in r.kv]
        return max(values) if values else None


__all__ = ["LoadTracker", "PoolLoad", "WorkerSource"]
