"""Reference paged attention in plain torch: gather the pages, then scaled_dot_product_attention.

`paged_attention_ref` is the oracle the Triton kernels are tested against (a plain loop over sequences).
`TorchAttention` serves CPU engines: the same math, with decode-only steps batched into one call.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from model_runtime.attention.base import AttentionBackend, AttentionMetadata, read_kv


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Tokens [0, seq_len) of one sequence from its pages [N, B, ...] (values [.., Hkv, D], or an FP8 cache's
    scales [.., Hkv]): [seq_len, ...]."""
    n_blocks = -(-seq_len // cache.shape[1])
    pages = cache[block_table[:n_blocks].long()]  # [n, B, ...]
    return pages.flatten(0, 1)[:seq_len]


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's queries over its paged context (cache already holds the new K/V;
    an FP8 cache is read through kv_scale)."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        if q_len == 0:
            continue
        qi = q[start : start + q_len].transpose(0, 1)  # [Hq, q_len, D]
        rows = partial(gather_context, block_table=meta.block_tables[i], seq_len=seq_len)
        k = read_kv(k_cache, kv_scale, 0, q.dtype, rows)
        v = read_kv(v_cache, kv_scale, 1, q.dtype, rows)
        k = k.transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, S, D]
        v = v.transpose(0, 1).repeat_interleave(group, dim=0)
        # Query j sits at position seq_len - q_len + j and sees keys 0 .. that position.
        qpos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        mask = torch.arange(seq_len, device=q.device)[None, :] <= qpos
        o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale)
        out[start : start + q_len] = o.transpose(0, 1)
        start += q_len
    return out


def batched_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every sequence has one query: gather all pages at once and run one SDPA.

    The query heads that share a KV head become the query-length axis, so no K/V is repeated:
        q [B, Hkv, group, D]  x  k [B, Hkv, W*bs, D]   with keys past seq_len masked out.
    """
    b, hq, d = q.shape
    hkv = k_cache.shape[2]
    tables = meta.block_tables.long()
    width = tables.shape[1] * k_cache.shape[1]

    def rows(pages: torch.Tensor) -> torch.Tensor:  # [b, width, ...]: every sequence's whole table
        return pages[tables].flatten(1, 2)

    k = read_kv(k_cache, kv_scale, 0, q.dtype, rows).transpose(1, 2)
    v = read_kv(v_cache, kv_scale, 1, q.dtype, rows).transpose(1, 2)
    mask = torch.arange(width, device=q.device)[None, :] < meta.seq_lens[:, None]
    qg = q.view(b, hkv, hq // hkv, d)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask[:, None, None, :], scale=scale)
    return out.reshape(b, hq, d)


class TorchAttention(AttentionBackend):
    name = "torch"

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
            return batched_decode(q, k_cache, v_cache, meta, scale, kv_scale)
        return paged_attention_ref(q, k_cache, v_cache, meta, scale, kv_scale)
