"""Building one rank's ModelRunner: its weights, the KV layout and cache size, attention and kernels.

The engine (the only rank, or the lead of a tensor-parallel engine) and every other rank of a tensor-parallel
engine (model_runtime.parallel.follower) build theirs here, so all ranks derive their model and cache one way.
With tensor_parallel_size 1 this is the engine's start-up as it always was: no group, no sharding.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from model_runtime.attention.select import make_attention_backend
from model_runtime.config import EngineConfig, ModelConfig
from model_runtime.cuda_graphs import graph_memory_estimate
from model_runtime.fused.select import make_fused_ops
from model_runtime.kv_layout import KVLayout
from model_runtime.kv_quant import layout_dtype
from model_runtime.model_runner import TORCH_DTYPES, ModelRunner, plan_num_blocks
from model_runtime.parallel.context import TensorParallel
from model_runtime.parallel.group import TPGroup
from model_runtime.parallel.weights import load_weight_shard
from model_runtime.prefill_graphs import prefill_graph_memory_estimate
from model_runtime.quantization.apply import quantize_weights, resolve_method
from model_runtime.startup import StartupProgress
from model_runtime.weights import ModelSource, load_weights


@dataclass(frozen=True)
class RankRunner:
    runner: ModelRunner
    layout: KVLayout
    max_model_len: int
    tensor_parallel: TensorParallel | None  # None: one device


def activation_estimate(model: ModelConfig, max_tokens: int, max_seqs: int, dtype_bytes: int) -> int:
    """Peak bytes of one step's activations, kept on purpose generous: hidden states, qkv, the MLP's
    gate/up product, and float32 logits plus sampler scratch for every sequence."""
    per_token = (4 * model.hidden_size + 2 * model.q_size + 3 * model.intermediate_size) * dtype_bytes
    return 2 * max_tokens * per_token + 4 * max_seqs * model.vocab_size * 4


def prefill_graph_tokens(config: EngineConfig) -> int:
    """The largest step that replays the piecewise prefill graphs: no step has more tokens than the scheduler's
    budget, so none are captured past it; 0 when graphs are off."""
    if config.device.enforce_eager:
        return 0
    return min(config.device.prefill_graph_tokens, config.scheduler.max_num_batched_tokens)


def build_runner(
    config: EngineConfig,
    source: ModelSource,
    model: ModelConfig,
    progress: StartupProgress,
    group: TPGroup | None = None,
) -> RankRunner:
    """This rank's runner. `group`: the tensor-parallel ranks (required when parallel.tensor_parallel_size
    is above 1); the rank builds its slice of the model (TPShard.local_model) and a cache of its KV heads."""
    device = config.device.resolved_device()
    dtype_name = config.device.resolved_dtype()
    tp = TensorParallel.join(config.parallel, model, group)
    local = model if tp is None else tp.shard.local_model(model)
    quantization = resolve_method(config.device.quantization, source)  # a pre-quantized checkpoint's own
    if tp is None:
        weights = load_weights(source, model, TORCH_DTYPES[dtype_name], device, progress.weights)
    else:
        weights = load_weight_shard(
            source, model, tp.shard, TORCH_DTYPES[dtype_name], device, progress.weights
        )
    # Before the cache is sized: on a GPU the bytes the quantized weights free go to the KV cache.
    if quantization != "none" and source.fp8 is None:
        progress.phase(f"quantizing weights ({quantization})")
    quantize_weights(weights, quantization)
    progress.phase("sizing the KV cache")
    max_model_len = min(
        config.scheduler.max_model_len or model.max_position_embeddings, model.max_position_embeddings
    )
    layout = plan_layout(config, model, local, device, tp)
    runner = ModelRunner(
        local,
        weights,
        layout,
        device,
        make_attention_backend(
            config.device.attention_backend,
            device,
            decode_gather_tokens=config.device.decode_gather_tokens,
            chunk_attention_tokens=config.device.chunk_attention_tokens,
        ),
        max_model_len,
        max_num_seqs=config.scheduler.max_num_seqs,
        enforce_eager=config.device.enforce_eager,
        on_graph_progress=progress.graphs,
        ops=make_fused_ops(config.device.kernels, device),
        tensor_parallel=tp,
        quantization=quantization,
        fp8_fast_accum=config.device.fp8_fast_accum,
        prefill_graph_tokens=prefill_graph_tokens(config),
        prefill_graph_kv_store=config.device.prefill_graph_kv_store,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        on_phase=progress.phase,
    )
    return RankRunner(runner, layout, max_model_len, tp)


def plan_layout(
    config: EngineConfig,
    model: ModelConfig,
    local: ModelConfig,
    device: str,
    tp: TensorParallel | None,
) -> KVLayout:
    """The rank's KV layout: its own heads (`local`), as many blocks as its memory allows; under tensor
    parallelism the smallest count of any rank, since every rank's cache holds the lead's block ids."""
    kv_dtype = layout_dtype(config.cache.dtype, config.device.resolved_dtype())
    shard = None if tp is None else tp.shard.kv_shard(model)
    probe = KVLayout(
        local.num_layers,
        local.num_kv_heads,
        local.head_dim,
        config.cache.block_size,
        2,
        kv_dtype,
    )
    # Activations are in the model dtype, whatever the cache's.
    activation_bytes = TORCH_DTYPES[config.device.resolved_dtype()].itemsize
    sched = config.scheduler
    # Activations are the rank's own, but the gathered logits span the whole vocabulary.
    sized = local if tp is None else dataclasses.replace(local, vocab_size=model.vocab_size)
    activations = activation_estimate(
        sized, sched.max_num_batched_tokens, sched.max_num_seqs, activation_bytes
    )
    if device != "cpu" and not config.device.enforce_eager:
        # The decode CUDA graphs' private pool, allocated after the cache (eager steps cannot reuse it).
        activations += graph_memory_estimate(local, sched.max_num_seqs, activation_bytes)
        pieces = prefill_graph_tokens(config)
        if pieces:  # the piecewise prefill graphs' buffers and pool
            activations += prefill_graph_memory_estimate(local, pieces, activation_bytes)
    num_blocks = plan_num_blocks(local, config.cache, probe.bytes_per_block, device, activations)
    if tp is not None:
        num_blocks = tp.group.agree_min(num_blocks)
    return KVLayout(
        local.num_layers,
        local.num_kv_heads,
        local.head_dim,
        config.cache.block_size,
        num_blocks,
        kv_dtype,
        shard,
    )
