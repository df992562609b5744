"""The `autoscaler:` section of the deploy config (deploy/config.py parses it; the policy reads it).

autoscaler:
  enabled: false              # off by default
  interval_s: 5               # one evaluation every interval_s ...
  window_s: 30                # ... over the requests that ended in the last window_s (at most 600)
  min_requests: 10            # a window with fewer requests (TTFT or TPOT samples) is no evidence either way
  ttft_s: 1.0                 # target: p90 time to first token  (a miss grows prefill)
  tpot_s: 0.05                # target: p90 time per output token (a miss grows decode)
  scale_up_patience: 2        # evaluations in a row that miss before a pool grows
  scale_down_patience: 6      # evaluations in a row comfortably inside before a pool shrinks
  scale_down_margin: 0.5      # comfortably inside: p90 <= margin * target
  scale_down_utilization: 0.6 # ... and a pool gives up a worker only if its load fits in one fewer at this
                              # share (prefill: busy share, decode/colocated: KV occupancy; deploy.autoscaler.load)
  cooldown_s: 60              # no change for this long after one
  shrink_memory_s: 600        # a shrink undone by a miss soon after is not repeated at that load for this long
  max_total_workers: 0        # the budget over all pools (the GPUs you have, or a CPU total); 0: sum of max
  prefill:   {min: 1, max: 4} # bounds of each pool's target (only the pools of the mode are used)
  decode:    {min: 1, max: 4}
  colocated: {min: 1, max: 4}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from model_runtime.config import ConfigError, dataclass_from_dict
from model_runtime.roles import WorkerRole
from router.recent_latency import MAX_WINDOW_S

MAX_POOL_SIZE = 1024  # deploy.controller refuses larger targets


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class PoolBounds:
    min: int = 1
    max: int = 4

    def __post_init__(self) -> None:
        if not _is_int(self.min) or not 1 <= self.min <= MAX_POOL_SIZE:
            raise ConfigError(f"pool.min: must be an integer in [1, {MAX_POOL_SIZE}], got {self.min!r}")
        if not _is_int(self.max) or not self.min <= self.max <= MAX_POOL_SIZE:
            raise ConfigError(
                f"pool.max: must be an integer in [min ({self.min}), {MAX_POOL_SIZE}], got {self.max!r}"
            )


@dataclass(frozen=True)
class AutoscalerSettings:
    enabled: bool = False
    interval_s: float = 5.0
    window_s: float = 30.0
    min_requests: int = 10
    ttft_s: float = 1.0
    tpot_s: float = 0.05
    scale_up_patience: int = 2
    scale_down_patience: int = 6
    scale_down_margin: float = 0.5
    scale_down_utilization: float = 0.6
    cooldown_s: float = 60.0
    shrink_memory_s: float = 600.0
    max_total_workers: int = 0
    prefill: PoolBounds = field(default_factory=PoolBounds)
    decode: PoolBounds = field(default_factory=PoolBounds)
    colocated: PoolBounds = field(default_factory=PoolBounds)

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ConfigError(f"autoscaler.enabled: must be true or false, got {self.enabled!r}")
        for name in ("interval_s", "ttft_s", "tpot_s"):
            value = getattr(self, name)
            if not _is_number(value) or not value > 0:
                raise ConfigError(f"autoscaler.{name}: must be a number > 0 (seconds), got {value!r}")
        if not _is_number(self.window_s) or not 0 < self.window_s <= MAX_WINDOW_S:
            raise ConfigError(
                f"autoscaler.window_s: must be in (0, {MAX_WINDOW_S:g}] seconds (the router keeps that much), "
                f"got {self.window_s!r}"
            )
        if not _is_number(self.cooldown_s) or self.cooldown_s < 0:
            raise ConfigError(f"autoscaler.cooldown_s: must be >= 0 seconds, got {self.cooldown_s!r}")
        if not _is_number(self.shrink_memory_s) or self.shrink_memory_s < 0:
            raise ConfigError(
                f"autoscaler.shrink_memory_s: must be >= 0 seconds (0: forget a regretted shrink at once), "
                f"got {self.shrink_memory_s!r}"
            )
        for name in ("min_requests", "scale_up_patience", "scale_down_patience"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ConfigError(f"autoscaler.{name}: must be an integer >= 1, got {value!r}")
        margin = self.scale_down_margin
        if not _is_number(margin) or not 0 < margin < 1:
            raise ConfigError(
                f"autoscaler.scale_down_margin: must be in (0, 1) (shrink only when p90 <= margin * target), "
                f"got {margin!r}"
            )
        share = self.scale_down_utilization
        if not _is_number(share) or not 0 < share <= 1:
            raise ConfigError(
                f"autoscaler.scale_down_utilization: must be in (0, 1] (a pool gives up a worker only when its "
                f"load spread over one worker fewer stays at or below this share), got {share!r}"
            )
        if not _is_int(self.max_total_workers) or self.max_total_workers < 0:
            raise ConfigError(
                f"autoscaler.max_total_workers: must be an integer >= 0 (0: the sum of the pools' max), "
                f"got {self.max_total_workers!r}"
            )

    def bounds(self, role: WorkerRole) -> PoolBounds:
        bounds: PoolBounds = getattr(self, role.value)
        return bounds

    def budget(self, roles: tuple[WorkerRole, ...]) -> int:
        """Workers all of `roles`' pools may have together."""
        most = sum(self.bounds(role).max for role in roles)
        return min(most, self.max_total_workers) if self.max_total_workers else most

    def check_pools(self, replicas: dict[WorkerRole, int]) -> None:
        """With the autoscaler on, each pool's starting size must lie in its bounds and the pools' minimums
        must fit the budget; the error names the field to change."""
        if not self.enabled:
            return
        for role, n in replicas.items():
            b = self.bounds(role)
            if not b.min <= n <= b.max:
                raise ConfigError(
                    f"{role.value}.replicas: {n} lies outside autoscaler.{role.value} [{b.min}, {b.max}]"
                )
        roles = tuple(replicas)
        if self.max_total_workers and sum(self.bounds(r).min for r in roles) > self.max_total_workers:
            mins = " + ".join(f"autoscaler.{r.value}.min" for r in roles)
            raise ConfigError(f"autoscaler.max_total_workers: {self.max_total_workers} is below {mins}")
        if sum(replicas.values()) > self.budget(roles):
            raise ConfigError(
                f"autoscaler.max_total_workers: {self.max_total_workers} is below the pools' starting "
                f"replicas ({sum(replicas.values())})"
            )


AUTOSCALER_KEYS = {f for f in AutoscalerSettings.__dataclass_fields__}
POOL_NAMES = ("prefill", "decode", "colocated")


def parse_autoscaler(data: Any) -> AutoscalerSettings:
    """The `autoscaler` mapping -> AutoscalerSettings; raises ConfigError naming the key path."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"autoscaler: must be a mapping, got {type(data).__name__}")
    values = dict(data)
    for name in POOL_NAMES:
        if name in values:
            values[name] = dataclass_from_dict(PoolBounds, values[name] or {}, f"autoscaler.{name}")
    return dataclass_from_dict(AutoscalerSettings, values, "autoscaler")
