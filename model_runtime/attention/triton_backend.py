"""TritonAttention: the GPU attention backend.

forward() always scatters the new K/V with the Triton store kernel, then dispatches:

- decode-only batches (one query token per sequence, the CUDA-graph path): the split-KV Triton decode kernel,
  reading only device tensors and shapes, never the host lists.
- anything else (prefill chunks, mixed batches; eager only), split once per step by the runner (MixedPlan):
    q_len > 1   -> every prefill chunk of the step in one packed causal attention (packed_prefill.py: varlen
                   FlashAttention-2, or cuDNN per prompt for a few long fresh prompts):
                   fresh K/V rows when no chunk has a cached prefix, else each chunk's context gathered from
                   the cache by slot (one index_select per layer; a 2k-token Llama-3-8B context is 8 MiB)
    q_len == 1  -> one decode-kernel launch over those sequences
"""

from __future__ import annotations

import torch

from model_runtime.attention.base import AttentionBackend, AttentionMetadata
from model_runtime.attention.decode_plan import (
    MAX_SEGMENTS,
    DecodeTuning,
    DecodeWorkspace,
    choose_num_segments,
)
from model_runtime.attention.packed_prefill import PackedPrefill, context_kv
from model_runtime.attention.triton_decode import decode_attention
from model_runtime.attention.triton_store import store_kv_triton

# Programs per SM the decode grid aims for when it picks a segment count (see choose_num_segments).
PROGRAMS_PER_SM = 4
FALLBACK_SM_COUNT = 132  # H100 SXM; used where no CUDA device answers (the CPU interpreter)


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return FALLBACK_SM_COUNT


class TritonAttention(AttentionBackend):
    """Paged attention with Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1).

    `num_segments` fixes the split-KV count (a power of two <= 64); None picks it from the batch shape.
    One instance serves every layer of a model: its decode scratch is shared and reused.
    """

    name = "triton"

    def __init__(self, num_segments: int | None = None, tuning: DecodeTuning | None = None) -> None:
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
    ) -> torch.Tensor:
        store_kv_triton(k, v, k_cache, v_cache, meta.slot_mapping, kv_scale)
        if meta.decode_only and q.shape[0] == meta.num_seqs:
            return self.decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, kv_scale)
        return self._forward_mixed(q, k, v, k_cache, v_cache, meta, scale, kv_scale)

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        kv_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Row s of q is sequence s's single query token; returns [S, Hq, D] (zeros where seq_lens is 0)."""
        out = torch.empty_like(q)
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
        """Prefill chunks as one packed varlen attention, single-token chunks as one decode launch; the
        split was computed once for the step (meta.mixed). Rows of padding sequences stay zero."""
        plan = meta.mixed
        if plan is None:
            raise ValueError(
                "TritonAttention: a step with a prefill chunk needs meta.mixed (ModelRunner builds it)"
            )
        if plan.decode_rows is None and plan.prefill_rows is None:  # every row is a prefill chunk's
            kc, vc = context_kv(k, v, k_cache, v_cache, plan, kv_scale)
            return self.prefill(q, kc, vc, plan, scale)
        out = torch.zeros_like(q)
        if plan.prefill_query_lens:
            kc, vc = context_kv(k, v, k_cache, v_cache, plan, kv_scale)
            rows = plan.prefill_rows
            qp = q if rows is None else q.index_select(0, rows)
            o = self.prefill(qp, kc, vc, plan, scale)
            if rows is None:
                out = o
            else:
                out.index_copy_(0, rows, o)
        if plan.decode_rows is not None and plan.decode_seqs is not None:
            o = self.decode(
                q.index_select(0, plan.decode_rows),
                k_cache,
                v_cache,
                meta.block_tables.index_select(0, plan.decode_seqs),
                meta.seq_lens.index_select(0, plan.decode_seqs),
                scale,
                kv_scale,
            )
            out.index_copy_(0, plan.decode_rows, o)
        return out
