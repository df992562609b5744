"""The SLO autoscaler's policy: from one window's latency p90s and the pools' sizes to new pool targets.

Pure: no clock, no Ray, no I/O; the loop (deploy.autoscaler.loop) feeds it and applies what it returns. Its
only memory is the hysteresis (streaks of evaluations, the time before which it does not act) and the shrinks it
regretted (below).

Each evaluation grades each signal against its target (the p90 over the window, when the window has at least
min_requests samples of it):

    miss         p90 > target                  TTFT -> the prefill pool, TPOT -> the decode pool
    inside       margin * target < p90 <= target
    comfortable  p90 <= margin * target
    (no grade)   too few samples: no evidence either way, every streak of that signal restarts

Disaggregated:
  - a signal that missed scale_up_patience evaluations in a row grows its pool by one (worst miss first);
    at the budget (max_total_workers), the other pool gives one worker if its own signal does not miss, it is
    above its min and its load fits in one worker fewer ("moved"); otherwise the miss is reported as blocked
    (at_max, at_budget) and its streak restarts
  - with no pending miss, a pool whose signal was comfortable scale_down_patience evaluations in a row shrinks by
    one, if its load (and, for decode, its TPOT) fits in one worker fewer
Colocated: replicas grow after scale_up_patience evaluations in a row with either signal missing, and shrink after
  scale_down_patience evaluations with both comfortable, if their load fits in one replica fewer.

A decode pool (and a colocated one) gives up a worker only if its TPOT p90 spread over one worker fewer,
p90 x n / (n - 1), is still comfortable. A decode step's time grows with its batch and with the prompts landing
on it, so the TPOT of a comfortable pool says little about one worker fewer: on 4x H200 (docs/performance.md)
the same prefill-heavy load gave two decode workers a TPOT p90 of 8.9 ms and one 18.2 ms at 20 req/s, 17 and
45 ms at 24; a pool that went 2 -> 1 on a p90 of 9-17 ms missed at 63-76 ms within a minute.

A shrink it regrets is not repeated at that load: when a pool that gave up a worker (shrank or moved one) misses
and grows back within REGRET_WINDOWS windows after the quiet time (counted from when every pool had settled
again: a draining worker can take longer than those windows), the request rate of the window in which it gave
the worker up is remembered for that pool and size; for shrink_memory_s it does not shrink to that size again
unless the rate has fallen below RATE_MARGIN of the remembered one. The memory holds back shrinks for comfort
only: a pool whose partner misses at the budget may still give it a worker ("moved") when its own load and TPOT
allow, since the load that needs the worker may be a different mix at the same request rate (on 4x H200,
prefill-heavy traffic at 24 req/s wanted 3 prefill + 1 decode workers, mixed traffic at 24 req/s 2 + 2).

"Its load fits in one worker fewer" (deploy.autoscaler.load): the pool's load over the window (prefill: busy
share; decode and colocated: KV occupancy) spread over one worker fewer stays <= scale_down_utilization. Latency
alone shrank pools that were needed: a prefill pool's TTFT is low until its workers are nearly always busy. A
pool without a load reading is never shrunk.

After a change nothing happens for max(cooldown_s, window_s); and while any pool is not settled (ready != target,
or workers starting or draining) streaks stay at zero and the quiet time extends to one window past it, so every
window that counts was measured wholly on the current pool sizes.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, replace

from deploy.autoscaler.load import PoolLoad
from deploy.autoscaler.settings import AutoscalerSettings
from model_runtime.roles import WorkerRole
from router.recent_latency import WindowStats
from router.scaling import PoolSize


class Direction(enum.StrEnum):
    UP = "up"
    DOWN = "down"
    BLOCKED = "blocked"  # a persistent miss that min/max or the budget keeps from growing its pool


class Grade(enum.Enum):
    NONE = 0  # too few samples
    COMFORTABLE = 1
    INSIDE = 2
    MISS = 3


@dataclass(frozen=True)
class Change:
    role: WorkerRole
    direction: Direction
    reason: str  # ttft_miss, tpot_miss, ttft_inside, tpot_inside, slo_inside, moved, at_max, at_budget
    before: int
    after: int
    detail: str = ""  # for the log only (reason is the metric's label): why the other pool gave nothing


@dataclass(frozen=True)
class Decision:
    changes: tuple[Change, ...] = ()
    hold: str = ""  # why no evidence was taken this time: "settling", "cooldown" ("" when it was)

    def targets(self) -> dict[WorkerRole, int]:
        """The pools to resize (empty: none)."""
        return {c.role: c.after for c in self.changes if c.direction is not Direction.BLOCKED}


SIGNAL_ROLE = {"ttft": WorkerRole.PREFILL, "tpot": WorkerRole.DECODE}
REGRET_WINDOWS = 3  # a miss this many windows after the quiet time that followed a shrink undoes it: a regret
RATE_MARGIN = 0.8  # after a regret, that size again only below this share of the rate it failed at


@dataclass(frozen=True)
class _Gave:
    """A pool gave up a worker: when, at what request rate, and the size it went to."""

    at: float
    rate: float
    size: int


class AutoscalePolicy:
    def __init__(self, settings: AutoscalerSettings) -> None:
        self.settings = settings
        self._streaks: Counter[str] = Counter()
        self._quiet_until = float("-inf")
        self._loads: Mapping[WorkerRole, PoolLoad] = {}
        self._now = 0.0
        self._rate = 0.0  # requests/s of the window being evaluated
        self._window = WindowStats(settings.window_s, 0, None, 0, None)
        self._gave: dict[WorkerRole, _Gave] = {}  # each pool's last shrink or move away
        self._floors: dict[tuple[WorkerRole, int], _Gave] = {}  # (pool, size) that missed: at what rate

    def evaluate(
        self,
        window: WindowStats,
        pools: Mapping[WorkerRole, PoolSize],
        now: float,
        loads: Mapping[WorkerRole, PoolLoad] | None = None,
    ) -> Decision:
        """One evaluation at time `now` (seconds, any monotonic origin); `loads`: each pool's load over the
        window (a pool without one is never shrunk)."""
        s = self.settings
        self._loads = loads or {}
        self._now, self._rate = now, window.requests / window.window_s if window.window_s > 0 else 0.0
        self._window = window
        if not all(p.ready == p.target and not p.starting and not p.draining for p in pools.values()):
            self._streaks.clear()
            self._quiet_until = max(self._quiet_until, now + s.window_s)
            # A shrink's regret horizon starts once the pools have settled, not when it was asked for.
            self._gave = {role: replace(g, at=now) for role, g in self._gave.items()}
            return Decision(hold="settling")
        if now < self._quiet_until:
            return Decision(hold="cooldown")
        grades = self._grade(window)
        self._count(grades)
        sizes = {role: p.target for role, p in pools.items()}
        if WorkerRole.COLOCATED in sizes:
            changes = self._colocated(grades, sizes[WorkerRole.COLOCATED])
        else:
            changes = self._grow(grades, self._overshoot(window), sizes) or self._shrink(sizes)
        if any(c.direction is not Direction.BLOCKED for c in changes):
            self._streaks.clear()
            self._quiet_until = now + max(s.cooldown_s, s.window_s)
            self._remember(changes)
        return Decision(tuple(changes))

    def _remember(self, changes: list[Change]) -> None:
        """Note each pool that gave up a worker; a miss that grows it back soon after makes a floor."""
        s = self.settings
        horizon = max(s.cooldown_s, s.window_s) + REGRET_WINDOWS * s.window_s
        for c in changes:
            if c.direction is Direction.DOWN:
                self._gave[c.role] = _Gave(self._now, self._rate, c.after)
            elif c.direction is Direction.UP and c.reason.endswith("_miss"):
                gave = self._gave.pop(c.role, None)
                if gave is not None and c.before == gave.size and self._now - gave.at <= horizon:
                    old = self._floors.get((c.role, gave.size))
                    rate = gave.rate if old is None else min(gave.rate, old.rate)
                    self._floors[(c.role, gave.size)] = _Gave(self._now, rate, gave.size)

    def regretted(self, role: WorkerRole, size: int) -> float | None:
        """The request rate at which `role` at `size` workers missed right after a shrink, while remembered."""
        floor = self._floors.get((role, size))
        if floor is None or self._now - floor.at > self.settings.shrink_memory_s:
            return None
        return floor.rate

    # --- grading ---------------------------------------------------------------------------------------
    def _grade(self, w: WindowStats) -> dict[str, Grade]:
        s = self.settings
        return {
            "ttft": self._one(w.ttft_p90_s, w.requests, s.ttft_s),
            "tpot": self._one(w.tpot_p90_s, w.tpot_requests, s.tpot_s),
        }

    def _overshoot(self, w: WindowStats) -> dict[str, float]:
        """p90 / target of each signal (0 without a p90): which miss is worse."""
        s = self.settings
        return {"ttft": (w.ttft_p90_s or 0.0) / s.ttft_s, "tpot": (w.tpot_p90_s or 0.0) / s.tpot_s}

    def _one(self, p90: float | None, samples: int, target: float) -> Grade:
        if p90 is None or samples < self.settings.min_requests:
            return Grade.NONE
        if p90 > target:
            return Grade.MISS
        return Grade.COMFORTABLE if p90 <= self.settings.scale_down_margin * target else Grade.INSIDE

    def _count(self, grades: dict[str, Grade]) -> None:
        """Extend or restart each streak."""
        conditions = {
            "ttft_miss": grades["ttft"] is Grade.MISS,
            "tpot_miss": grades["tpot"] is Grade.MISS,
            "ttft_comfortable": grades["ttft"] is Grade.COMFORTABLE,
            "tpot_comfortable": grades["tpot"] is Grade.COMFORTABLE,
            "any_miss": Grade.MISS in grades.values(),
            "all_comfortable": all(g is Grade.COMFORTABLE for g in grades.values()),
        }
        for name, holds in conditions.items():
            self._streaks[name] = self._streaks[name] + 1 if holds else 0

    # --- disaggregated ---------------------------------------------------------------------------------
    def _grow(
        self, grades: dict[str, Grade], overshoot: dict[str, float], sizes: dict[WorkerRole, int]
    ) -> list[Change]:
        """Grow the pools whose signal missed long enough, worst miss first (the first gets the budget)."""
        s = self.settings
        due = [signal for signal in SIGNAL_ROLE if self._streaks[f"{signal}_miss"] >= s.scale_up_patience]
        due.sort(key=lambda signal: -overshoot[signal])
        changes: list[Change] = []
        budget = s.budget(tuple(sizes))
        for signal in due:
            role, reason = SIGNAL_ROLE[signal], f"{signal}_miss"
            self._streaks[reason] = 0  # acted on (or reported blocked): the next needs a fresh streak
            n = sizes[role]
            if n >= s.bounds(role).max:
                changes.append(Change(role, Direction.BLOCKED, "at_max", n, n))
            elif sum(sizes.values()) < budget:
                sizes[role] = n + 1
                changes.append(Change(role, Direction.UP, reason, n, n + 1))
            elif (donor := self._donor(role, grades, sizes)) is not None:
                changes.append(Change(donor, Direction.DOWN, "moved", sizes[donor], sizes[donor] - 1))
                sizes[donor] -= 1
                sizes[role] = n + 1
                changes.append(Change(role, Direction.UP, reason, n, n + 1))
            else:
                why = self._no_donor(role, grades, sizes)
                changes.append(Change(role, Direction.BLOCKED, "at_budget", n, n, why))
        return changes

    def _donor(
        self, role: WorkerRole, grades: dict[str, Grade], sizes: dict[WorkerRole, int]
    ) -> WorkerRole | None:
        """The other pool, when it can give a worker: its own signal does not miss, and it is above its min."""
        for signal, other in SIGNAL_ROLE.items():
            if (
                other is not role
                and grades[signal] is not Grade.MISS
                and self._can_give(other, sizes[other], moving=True)
            ):
                return other
        return None

    def _no_donor(self, role: WorkerRole, grades: dict[str, Grade], sizes: dict[WorkerRole, int]) -> str:
        """Why no other pool gave `role` a worker, for the log (an operator sees which rule held it)."""
        reasons = []
        for signal, other in SIGNAL_ROLE.items():
            if other is not role:
                why = (
                    f"its {signal} misses too"
                    if grades[signal] is Grade.MISS
                    else self._refusal(other, sizes[other], moving=True)
                )
                reasons.append(f"{other.value} cannot give: {why}")
        return "; ".join(reasons)

    def _shrink(self, sizes: dict[WorkerRole, int]) -> list[Change]:
        if self._streaks["any_miss"]:  # a miss still building its streak: keep the workers for it
            return []
        changes = []
        for signal, role in SIGNAL_ROLE.items():
            if self._streaks[f"{signal}_comfortable"] >= self.settings.scale_down_patience:
                n = sizes[role]
                if self._can_give(role, n):
                    changes.append(Change(role, Direction.DOWN, f"{signal}_inside", n, n - 1))
        return changes

    def _can_give(self, role: WorkerRole, n: int, moving: bool = False) -> bool:
        """The pool of n workers is above its min and its load and TPOT fit in n - 1 (see the module
        docstring); `moving`: to the other pool, which misses (a regretted shrink does not hold that back)."""
        return self._refusal(role, n, moving) is None

    def _refusal(self, role: WorkerRole, n: int, moving: bool = False) -> str | None:
        """Why the pool of n workers may not give one up (the log's words), or None when it may."""
        if n <= self._min(role):
            return f"at its min {n}"
        floor = self.regretted(role, n - 1)
        if not moving and floor is not None and self._rate >= RATE_MARGIN * floor:
            return (
                f"{n - 1} workers missed at {floor:.1f} req/s within shrink_memory_s (now {self._rate:.1f})"
            )
        tpot = self._projected_tpot(role, n)
        if tpot is not None and tpot > self.settings.scale_down_margin * self.settings.tpot_s:
            limit = self.settings.scale_down_margin * self.settings.tpot_s
            return f"its tpot p90 would be about {tpot:.3f}s on {n - 1} (comfortable: <= {limit:.3f}s)"
        load = self._loads.get(role)
        projected = load.projected(n - 1) if load is not None else None
        if projected is None:
            return "no load reading yet"
        limit = self.settings.scale_down_utilization
        if projected > limit:
            return f"its load would be {projected:.2f} on {n - 1} (scale_down_utilization {limit:g})"
        return None

    def _projected_tpot(self, role: WorkerRole, n: int) -> float | None:
        """The window's TPOT p90 spread over one worker fewer, for the pools that run decode steps (None for
        prefill, or without enough TPOT samples)."""
        w = self._window
        if role is WorkerRole.PREFILL or w.tpot_p90_s is None or w.tpot_requests < self.settings.min_requests:
            return None
        return w.tpot_p90_s * n / (n - 1)

    def _min(self, role: WorkerRole) -> int:
        return self.settings.bounds(role).min

    # --- colocated -------------------------------------------------------------------------------------
    def _colocated(self, grades: dict[str, Grade], n: int) -> list[Change]:
        s, role = self.settings, WorkerRole.COLOCATED
        if self._streaks["any_miss"] >= s.scale_up_patience:
            self._streaks["any_miss"] = 0
            # The streak just grew, so this window missed: name the signal that did.
            reason = next(f"{signal}_miss" for signal, grade in grades.items() if grade is Grade.MISS)
            if n >= min(s.bounds(role).max, s.budget((role,))):
                at = "at_max" if n >= s.bounds(role).max else "at_budget"
                return [Change(role, Direction.BLOCKED, at, n, n)]
            return [Change(role, Direction.UP, reason, n, n + 1)]
        if self._streaks["all_comfortable"] >= s.scale_down_patience and self._can_give(role, n):
            return [Change(role, Direction.DOWN, "slo_inside", n, n - 1)]
        return []


def describe(window: WindowStats, settings: AutoscalerSettings, decision: Decision) -> str:
    """One log line: the measured p90s against their targets, then each change."""

    def p90(value: float | None, samples: int, target: float) -> str:
        measured = "-" if value is None else f"{value:.3f}s"
        return f"p90 {measured} (target {target:g}s, {samples} requests)"

    measured = (
        f"ttft {p90(window.ttft_p90_s, window.requests, settings.ttft_s)}, "
        f"tpot {p90(window.tpot_p90_s, window.tpot_requests, settings.tpot_s)} over {window.window_s:g}s"
    )
    changes = ", ".join(
        f"{c.role.value} {c.before} -> {c.after} ({c.reason})"
        if c.direction is not Direction.BLOCKED
        else f"{c.role.value} stays {c.before} ({c.reason}{': ' + c.detail if c.detail else ''})"
        for c in decision.changes
    )
    return f"{measured}: {changes or decision.hold or 'no change'}"
