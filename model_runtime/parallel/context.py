"""TensorParallel: what a ModelRunner holds to be one rank of a tensor-parallel engine.

The runner asks it three things: shard the model it built (once), publish each step it runs to the other
ranks (the lead only), and gather the logits. An engine on one device has none, and its runner pays nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_runtime.config import ConfigError, ModelConfig, ParallelConfig
from model_runtime.host_batch import HostBatch
from model_runtime.models.llama import LlamaForCausalLM
from model_runtime.parallel.group import TPGroup
from model_runtime.parallel.layers import apply_tensor_parallel, gather_logits
from model_runtime.parallel.shard import TPShard
from model_runtime.parallel.step_sync import StepPublisher


@dataclass
class TensorParallel:
    group: TPGroup
    shard: TPShard
    vocab_size: int  # the model's, before padding to the shards
    publisher: StepPublisher | None  # the lead's; None on the other ranks

    @classmethod
    def join(
        cls, parallel: ParallelConfig, model: ModelConfig, group: TPGroup | None
    ) -> TensorParallel | None:
        """This rank's part in `group`, or None for an engine on one device (size 1: today's path exactly).
        Raises ConfigError naming parallel.tensor_parallel_size when the group or the model does not fit."""
        size = parallel.tensor_parallel_size
        if group is not None and group.size != size:
            raise ConfigError(
                f"parallel.tensor_parallel_size: {size}, but the tensor-parallel group has {group.size} ranks"
            )
        if size == 1:
            return None
        parallel.check_model(model)  # a shape that cannot be split is the error to see first
        if group is None:
            raise ConfigError(
                f"parallel.tensor_parallel_size: {size} ranks need a tensor-parallel group; start one process "
                "per rank, join them with model_runtime.parallel.init_tp_group and pass the group to the engine "
                "(rank 0) and to run_follower (the others)"
            )
        shard = TPShard.plan(model, parallel, group.rank)
        return cls(group, shard, model.vocab_size, StepPublisher(group) if group.is_lead else None)

    def shard_model(self, model: LlamaForCausalLM) -> LlamaForCausalLM:
        return apply_tensor_parallel(model, self.shard, self.group)

    def publish(self, batch: HostBatch) -> None:
        if self.publisher is not None:
            self.publisher.publish(batch)

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        return gather_logits(local, self.group, self.vocab_size)

    def stop_followers(self) -> None:
        """The lead's shutdown: the other ranks leave their step loop (safe to call twice)."""
        if self.publisher is not None:
            self.publisher.stop()
