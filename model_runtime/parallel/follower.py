"""A tensor-parallel engine's other ranks: they build their share of the model and run what the lead publishes.

    rank 0:  engine = Engine(config, tp_group=group)  ...  engine.close()     (schedules, samples)
    rank r:  run_follower(config, group)                                       (returns when the lead closes)

A follower has no scheduler, block pool, tokenizer or sampler: the lead's step carries everything a step needs
(model_runtime.parallel.step_sync), and the follower's cache is addressed by the lead's block ids.
"""

from __future__ import annotations

from collections.abc import Callable

from model_runtime.config import EngineConfig
from model_runtime.parallel.group import TPGroup
from model_runtime.parallel.step_sync import StepReceiver
from model_runtime.runner_setup import RankRunner, build_runner
from model_runtime.startup import StartupProgress
from model_runtime.weights import load_model_config, resolve_model


def build_follower(
    config: EngineConfig, group: TPGroup, on_progress: Callable[[str], None] | None = None
) -> RankRunner:
    """This rank's runner (weights, KV cache); its start-up collectives pair with the lead's Engine()."""
    if group.is_lead:
        raise ValueError("build_follower: rank 0 is the lead; it runs the Engine")
    source = resolve_model(config.model)
    return build_runner(config, source, load_model_config(source), StartupProgress(on_progress), group)


def follow(
    rank: RankRunner,
    group: TPGroup,
    after_step: Callable[[], None] | None = None,
) -> int:
    """Run the lead's steps until it stops the ranks; returns how many ran. `after_step` runs after each step
    (a KV agent's clock: the k-th call follows the lead's k-th published step)."""
    receiver = StepReceiver(group)
    steps = 0
    while (batch := receiver.receive()) is not None:
        rank.runner.execute_batch(batch)
        steps += 1
        if after_step is not None:
            after_step()
    return steps


def run_follower(
    config: EngineConfig, group: TPGroup, on_progress: Callable[[str], None] | None = None
) -> int:
    """build_follower, then follow; returns the steps run."""
    return follow(build_follower(config, group, on_progress), group)
