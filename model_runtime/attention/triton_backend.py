"""TritonAttention: the GPU attention backend.

forward() always scatters the new K/V with the Triton store kernel, then dispatches:

- decode-only batches (one query token per sequence, the CUDA-graph path): the split-KV Triton decode kernel,
  reading only device tensors and shapes, never the host lists.
- anything else (prefill chunks, mixed batches; eager only), split once per step by the runner (MixedPlan):
    q_len > 1   -> the step's prompt chunks by group (packed_prefill.py): a few long fresh prompts through
                   cuDNN one by one, the other fresh chunks in one varlen FlashAttention-2 call over their own
                   rows, chunks with a cached prefix in one such call over their contexts gathered from the
                   cache by slot (one index_select per layer; a 2k-token Llama-3-8B context is 8 MiB)
                   (a cached group with a prompt chunk, of at most `chunk_attention_tokens` query rows: read
                   from the pages in place by the split-KV Triton kernel of triton_chunk.py, no gather, an FP8
                   cache's codes and scales included)
    q_len == 1  -> one decode-kernel launch over those sequences
  Rows that are contiguous in the step (the scheduler puts running sequences first, new prompts after them)
  are read and written as slices; the decode kernel writes straight into its rows of the output.
  Decode rows with short contexts in total join the cached group instead (config.
  DECODE_GATHER_MAX_TOKENS: the decode kernel's launches cost more host time than their gather costs the GPU).
"""

from __future__ import annotations

import numpy as np
import torch

from model_runtime.attention.base import AttentionBackend, AttentionMetadata, PrefillGroup
from model_runtime.attention.decode_plan import (
    MAX_SEGMENTS,
    DecodeTuning,
    DecodeWorkspace,
    choose_num_segments,
)
from model_runtime.attention.packed_prefill import PackedPrefill, group_kv
from model_runtime.attention.triton_chunk import ChunkWork, chunk_attention, plan_chunk_work
from model_runtime.attention.triton_decode import decode_attention
from model_runtime.attention.triton_store import store_kv_triton
from model_runtime.config import (
    CHUNK_ATTENTION_FP8_MAX_TOKENS,
    CHUNK_ATTENTION_MAX_TOKENS,
    DECODE_GATHER_MAX_TOKENS,
)

# Programs per SM the decode grid aims for when it picks a segment count (see choose_num_segments).
PROGRAMS_PER_SM = 4
# Where no CUDA device answers (the CPU interpreter, which runs every program of a grid in Python): a GPU-sized
# grid there only costs the tests time (132 SMs made a three-sequence decode step 1,500 programs and 7-11 s);
# 8 still splits their contexts into several segments and their chunks into several slices.
FALLBACK_SM_COUNT = 8


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return FALLBACK_SM_COUNT


class TritonAttention(AttentionBackend):
    """Paged attention with Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1).

    `num_segments` fixes the split-KV count (a power of two <= 64); None picks it from the batch shape.
    `decode_gather_tokens`: a mixed step's decode rows join its cached group up to this many context tokens in
    total (device.decode_gather_tokens; 0: never).
    `chunk_attention_tokens`: a cached group of at most this many query rows with a prompt chunk in it runs
    the split-KV chunk kernel over the pages in place (device.chunk_attention_tokens; 0: never; an FP8 cache's
    groups at most config.CHUNK_ATTENTION_FP8_MAX_TOKENS rows). A group of gathered decode rows alone (beside a
    fresh prompt) keeps the gathered call: the kernel was measured to win with a chunk over a cached prefix in
    the group, and on a mixed workload, whose steps often hold such decode-only groups, one run was slower with
    it and a later one in both orders showed no difference (docs/performance.md, "A chunk over a cached prefix,
    split along its context").
    One instance serves every layer of a model: its decode scratch is shared and reused.
    """

    name = "triton"

    def __init__(
        self,
        num_segments: int | None = None,
        tuning: DecodeTuning | None = None,
        decode_gather_tokens: int = DECODE_GATHER_MAX_TOKENS,
        chunk_attention_tokens: int = CHUNK_ATTENTION_MAX_TOKENS,
    ) -> None:
        if num_segments is not None and not (
            1 <= num_segments <= MAX_SEGMENTS and num_segments & (num_segments - 1) == 0
        ):
            raise ValueError(
                f"TritonAttention.num_segments: must be a power of two in [1, {MAX_SEGMENTS}], "
                f"got {num_segments}"
            )
        self.num_segments = num_segments
        self.tuning = tuning or DecodeTuning()
        self.workspace = DecodeWorkspace()
        self.prefill = PackedPrefill()
        self.decode_gather_tokens = decode_gather_tokens
        self.chunk_attention_tokens = chunk_attention_tokens

    def segments_for(self, num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
        if self.num_segments is not None:
            return self.num_segments
        return choose_num_segments(num_seqs, num_kv_heads, PROGRAMS_PER_SM * _sm_count(device))

    def reserve(
        self, max_num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device | str
    ) -> None:
        """Allocate decode scratch for every batch size up to max_num_seqs; call before CUDA-graph capture."""
        dev = torch.device(device)
        need = max(n * self.segments_for(n, num_kv_heads, dev) for n in range(1, max_num_seqs + 1))
        self.workspace.reserve(need, num_heads, 1, head_dim, dev)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scale: torch.Tensor | None = None,
        stored: bool = False,
    ) -> torch.Tensor:
        if not stored:
            self.store(k, v, k_cache, v_cache, meta.slot_mapping, kv_scale)
        if meta.decode_only and q.shape[0] == meta.num_seqs:
            return self.decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, kv_scale)
        return self._forward_mixed(q, k, v, k_cache, v_cache, meta, scale, kv_scale)

    def store(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_scale: torch.Tensor | None = None,
    ) -> None:
        store_kv_triton(k, v, k_cache, v_cache, slot_mapping, kv_scale)

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        kv_scale: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Row s of q is sequence s's single query token; returns [S, Hq, D] (zeros where seq_lens is 0),
        written into `out` when given (a contiguous [S, Hq, D] view)."""
        out = torch.empty_like(q) if out is None else out
        segments = self.segments_for(q.shape[0], k_cache.shape[2], q.device)
        return decode_attention(
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            scale,
            out,
            self.workspace,
            segments,
            self.tuning,
            kv_scale,
        )

    def _forward_mixed(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scale: torch.Tensor | None,
    ) -> torch.Tensor:
        """Each group of prompt chunks with its kernel, single-token chunks as one decode launch; the split
        was computed once for the step (meta.mixed). Contiguous rows are read and written as slices; rows of
        padding sequences stay zero."""
        plan = meta.mixed
        if plan is None:
            raise ValueError(
                "TritonAttention: a step with a prefill chunk needs meta.mixed (ModelRunner builds it)"
            )
        sole = plan.sole_group()
        if (
            sole is not None and sole is not plan.long_fresh
        ):  # one call computes every row: its output is ours
            return self._group_call(q, k, v, k_cache, v_cache, sole, scale, kv_scale)
        out = torch.empty_like(q) if plan.covered else torch.zeros_like(q)
        long_fresh = plan.long_fresh
        if long_fresh is not None and not self.prefill.per_prompt(q, k, v, long_fresh, scale, out):
            o = self._group_call(q, k, v, k_cache, v_cache, long_fresh, scale, kv_scale)
            long_fresh.rows.write(out, o)
        for group in (plan.fresh, plan.cached):
            if group is not None:
                group.rows.write(out, self._group_call(q, k, v, k_cache, v_cache, group, scale, kv_scale))
        rows, seqs = plan.decode_rows, plan.decode_seqs
        if rows is not None and seqs is not None:
            target = rows.target(out)
            o = self.decode(
                rows.take(q),
                k_cache,
                v_cache,
                meta.block_tables.index_select(0, seqs),
                meta.seq_lens.index_select(0, seqs),
                scale,
                kv_scale,
                target,
            )
            if target is None:
                rows.write(out, o)
        return out

    def _group_call(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        group: PrefillGroup,
        scale: float,
        kv_scale: torch.Tensor | None,
    ) -> torch.Tensor:
        """The group's rows' attention as one call (packed_prefill.PackedPrefill, or the chunk kernel for a short
        cached group): [group rows, Hq, D]."""
        slots = group.context_slots
        if (
            slots is not None
            and group.max_q > 1  # a prompt chunk over a cached prefix, not decode rows alone (see below)
            and group.num_rows <= self._chunk_rows_limit(kv_scale)
        ):
            work = self._chunk_work(q, k_cache, group)
            return chunk_attention(group.rows.take(q), k_cache, v_cache, slots, work, scale, kv_scale)
        kc, vc = group_kv(k, v, k_cache, v_cache, group, kv_scale)
        return self.prefill(group.rows.take(q), kc, vc, group, scale)

    def _chunk_rows_limit(self, kv_scale: torch.Tensor | None) -> int:
        """The most query rows a cached group may have for the chunk kernel (fewer with an FP8 cache:
        config.CHUNK_ATTENTION_FP8_MAX_TOKENS says why)."""
        if kv_scale is None:
            return self.chunk_attention_tokens
        return min(self.chunk_attention_tokens, CHUNK_ATTENTION_FP8_MAX_TOKENS)

    def _chunk_work(self, q: torch.Tensor, k_cache: torch.Tensor, group: PrefillGroup) -> ChunkWork:
        """The group's work table, planned by the step's first layer and kept on the group for the others."""
        work = group.chunk_work
        if not isinstance(work, ChunkWork):
            num_heads, kv_heads = q.shape[1], k_cache.shape[2]
            host = plan_chunk_work(
                np.concatenate([[0], np.cumsum(group.query_lens)]),
                np.concatenate([[0], np.cumsum(group.seq_lens)]),
                num_heads // kv_heads,
                kv_heads,
                _sm_count(q.device),
            )
            work = group.chunk_work = ChunkWork.on(host, num_heads, q.shape[2], q.device)
        return work
