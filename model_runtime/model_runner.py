"""ModelRunner: owns the device-side state of one engine (weights, the KV cache tensor, CUDA graphs) and turns a
SchedulerOutput into logits for the positions that sample.

It is the only place that builds device inputs. The KV cache is one tensor shaped by KVLayout.cache_shape.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from model_runtime.attention.base import AttentionBackend, AttentionMetadata
from model_runtime.config import CacheConfig, ModelConfig
from model_runtime.kv_layout import KVLayout
from model_runtime.models.llama import LlamaForCausalLM
from model_runtime.request import SchedulerOutput

log = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class OutOfMemoryPlan(RuntimeError):
    """The model and a minimal KV cache do not fit; the message says what to change."""


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the step's hidden states that sample


def plan_num_blocks(
    model_config: ModelConfig,
    cache: CacheConfig,
    block_size_bytes: int,
    device: str,
    activation_bytes: int = 0,
) -> int:
    """How many KV blocks fit: an explicit cache.num_blocks wins; on CPU `cpu_cache_bytes`; on GPU what is left
    of `gpu_memory_utilization` x total memory after weights (already allocated) and the activation peak."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    if device == "cpu":
        return max(2, cache.cpu_cache_bytes // block_size_bytes)
    free, total = torch.cuda.mem_get_info(torch.device(device))
    used_by_others = total - free - torch.cuda.memory_reserved(torch.device(device))
    budget = int(total * cache.gpu_memory_utilization) - used_by_others
    budget -= torch.cuda.memory_allocated(torch.device(device)) + activation_bytes
    num_blocks = budget // block_size_bytes
    if num_blocks < 2:
        raise OutOfMemoryPlan(
            f"no room for the KV cache on {device}: {total / 2**30:.1f} GiB total, weights and activations use "
            f"{(total - budget) / 2**30:.1f} GiB at gpu_memory_utilization={cache.gpu_memory_utilization}. "
            "Raise cache.gpu_memory_utilization, lower scheduler.max_num_batched_tokens, or use a smaller model."
        )
    return int(num_blocks)


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        weights: dict[str, torch.Tensor],
        layout: KVLayout,
        device: str,
        backend: AttentionBackend,
        max_model_len: int,
    ) -> None:
        self.config = model_config
        self.layout = layout
        self.device = torch.device(device)
        self.max_blocks_per_seq = layout.blocks_for_tokens(max_model_len)
        with torch.device("meta"):
            model = LlamaForCausalLM(model_config, backend, rope_device=self.device)
        model.load_weights(weights)
        self.model = model.eval()
        self.kv_cache = torch.zeros(layout.cache_shape, dtype=TORCH_DTYPES[layout.dtype], device=self.device)
        self._pin = self.device.type == "cuda"

    # --- inputs ----------------------------------------------------------------------------------------
    def prepare(self, out: SchedulerOutput) -> StepInputs:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        query_lens: list[int] = []
        tables: list[list[int]] = []
        logits_indices: list[int] = []
        for chunk in out.chunks:
            req = chunk.request
            start, end = req.num_computed_tokens, req.num_computed_tokens + chunk.num_tokens
            tokens = req.all_token_ids[start:end]
            ids.extend(tokens)
            positions.extend(range(start, end))
            slots.extend(self.layout.slots(req.block_ids, start, end))
            query_start.append(query_start[-1] + chunk.num_tokens)
            query_lens.append(chunk.num_tokens)
            seq_lens.append(end)
            tables.append(req.block_ids)
            if chunk.sample:
                logits_indices.append(query_start[-1] - 1)
        width = max(len(t) for t in tables)
        table = [t + [0] * (width - len(t)) for t in tables]
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots, torch.int64),
            query_start_loc=self._tensor(query_start, torch.int32),
            seq_lens=self._tensor(seq_lens, torch.int32),
            block_tables=self._tensor(table, torch.int32),
            query_lens_host=query_lens,
            seq_lens_host=seq_lens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )
        return StepInputs(
            self._tensor(ids, torch.int64),
            self._tensor(positions, torch.int64),
            meta,
            self._tensor(logits_indices, torch.int64),
        )

    def _tensor(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        t = torch.tensor(data, dtype=dtype, pin_memory=self._pin)
        return t.to(self.device, non_blocking=True)

    # --- execution -------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """Run one step; returns float32 logits [num sampling chunks, vocab] in chunk order."""
        inputs = self.prepare(out)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta)
        return self.model.compute_logits(hidden[inputs.logits_indices])
