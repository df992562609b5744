"""TritonAttention: the GPU attention backend.

forward() always scatters the new K/V with the Triton store kernel, then dispatches:

- decode-only batches (one query token per sequence, the CUDA-graph path): the split-KV Triton decode kernel,
  reading only device tensors and shapes, never the host lists.
- anything else (prefill chunks, mixed batches; eager only), sequence by sequence from the host lists:
    q_len == 1             -> batched together into one decode-kernel launch
    q_len == seq_len       -> no cached prefix: causal SDPA on the fresh k/v (FlashAttention-2 on GPU, GQA
                              through `enable_gqa`, so K/V are never repeated)
    1 < q_len < seq_len    -> cached prefix (chunked prefill, prefix-cache hit): gather the sequence's pages
                              and run SDPA with a lower-right causal mask. Correctness first: this re-reads the
                              prefix once per chunk, which is fine next to the chunk's own matmuls; a Triton
                              prefix kernel is the next step if profiles show it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from model_runtime.attention.base import AttentionBackend, AttentionMetadata
from model_runtime.attention.torch_ref import gather_context
from model_runtime.attention.triton_decode import (
    MAX_SEGMENTS,
    DecodeTuning,
    DecodeWorkspace,
    choose_num_segments,
    decode_attention,
)
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
    ) -> torch.Tensor:
        store_kv_triton(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.decode_only and q.shape[0] == meta.num_seqs:
            return self.decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)
        return self._forward_mixed(q, k, v, k_cache, v_cache, meta, scale)

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Row s of q is sequence s's single query token; returns [S, Hq, D] (zeros where seq_lens is 0)."""
        out = torch.empty_like(q)
        segments = self.segments_for(q.shape[0], k_cache.shape[2], q.device)
        return decode_attention(
            q, k_cache, v_cache, block_tables, seq_lens, scale, out, self.workspace, segments, self.tuning
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
    ) -> torch.Tensor:
        out = torch.zeros_like(q)  # rows of padding sequences stay zero
        starts = _query_starts(meta.query_lens_host)
        decode_seqs: list[int] = []
        for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
            if q_len == 0 or seq_len == 0:
                continue
            if q_len > seq_len:
                raise ValueError(f"AttentionMetadata: sequence {i} has query_len {q_len} > seq_len {seq_len}")
            rows = slice(starts[i], starts[i] + q_len)
            if q_len == 1:
                decode_seqs.append(i)
            elif q_len == seq_len:
                out[rows] = _causal_prefill(q[rows], k[rows], v[rows], scale)
            else:
                kc = gather_context(k_cache, meta.block_tables[i], seq_len)
                vc = gather_context(v_cache, meta.block_tables[i], seq_len)
                out[rows] = _prefix_chunk(q[rows], kc, vc, scale)
        if decode_seqs:
            self._decode_subset(q, k_cache, v_cache, meta, scale, out, decode_seqs, starts)
        return out

    def _decode_subset(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
        seqs: list[int],
        starts: list[int],
    ) -> None:
        """The single-token sequences of a mixed batch, as one decode launch."""
        seq_idx = torch.tensor(seqs, dtype=torch.long, device=q.device)
        row_idx = torch.tensor([starts[i] for i in seqs], dtype=torch.long, device=q.device)
        o = self.decode(
            q.index_select(0, row_idx),
            k_cache,
            v_cache,
            meta.block_tables.index_select(0, seq_idx).contiguous(),
            meta.seq_lens.index_select(0, seq_idx),
            scale,
        )
        out.index_copy_(0, row_idx, o)


def _query_starts(query_lens: list[int]) -> list[int]:
    starts, total = [], 0
    for n in query_lens:
        starts.append(total)
        total += n
    return starts


def _sdpa_gqa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None
) -> torch.Tensor:
    """SDPA on [Hq, Tq, D] x [Hkv, Tk, D]. `enable_gqa` only where FlashAttention honours it (CUDA, 16-bit,
    no mask); elsewhere SDPA would drop to the math kernel anyway, so K/V are repeated to Hq explicitly."""
    group = q.shape[0] // k.shape[0]
    flash_gqa = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and mask is None
    if group > 1 and not flash_gqa:
        k = k.repeat_interleave(group, dim=0)
        v = v.repeat_interleave(group, dim=0)
    qb, kb, vb = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    if mask is None:
        o = F.scaled_dot_product_attention(
            qb, kb, vb, is_causal=True, scale=scale, enable_gqa=group > 1 and flash_gqa
        )
    else:
        o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale)
    return o.squeeze(0)


def _causal_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """A whole prompt ([T, Hq, D] against [T, Hkv, D]): plain causal attention, no cache reads."""
    o = _sdpa_gqa(
        q.transpose(0, 1), k.to(q.dtype).transpose(0, 1), v.to(q.dtype).transpose(0, 1), scale, None
    )
    return o.transpose(0, 1)


def _prefix_chunk(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, scale: float) -> torch.Tensor:
    """A chunk's last Tq positions ([Tq, Hq, D]) against the whole context ([S, Hkv, D]), causal from the
    bottom right: query j sits at position S - Tq + j."""
    mask = causal_lower_right(q.shape[0], k_ctx.shape[0])
    o = _sdpa_gqa(
        q.transpose(0, 1), k_ctx.to(q.dtype).transpose(0, 1), v_ctx.to(q.dtype).transpose(0, 1), scale, mask
    )
    return o.transpose(0, 1)
