"""Tensor parallelism: one engine over several devices, each rank holding a share of every layer.

Module map:
    shard.py      TPShard: which heads, MLP columns and vocabulary rows a rank holds; the cut of each
                  checkpoint tensor (the one rule weights and tests use)
    group.py      TPGroup: the ranks and every collective (all-reduce, gather, host broadcast); init_tp_group
    fast_all_reduce.py  small all-reduces over CUDA symmetric memory (one-shot / two-shot), NCCL otherwise
    layers.py     apply_tensor_parallel: the sharded model's communication, added from outside the model
    weights.py    load_weight_shard: each rank loads only its slices (safetensors, GGUF, dummy)
    step_sync.py  the lead publishes each step's host inputs, the other ranks receive them (no pickle)
    shm_channel.py  the shared-memory ring step_sync sends them over (one writer, N readers, one node)
    context.py    TensorParallel: what a ModelRunner holds to be one rank
    follower.py   run_follower: a non-lead rank's life (build its runner, run the lead's steps)

The engine's config says how many ranks (EngineConfig.parallel); building a rank's runner is
model_runtime.runner_setup.build_runner for every rank, the lead's Engine included.
"""
