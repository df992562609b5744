"""Prefill chunks of a step as one variable-length causal attention over packed sequences.

    q      [Tp, Hq, D]   the prefill rows of the step, chunk after chunk (cu_q marks the chunks)
    k, v   [K, Hkv, D]   each chunk's whole context, chunk after chunk (cu_k): the chunk's own fresh rows when
                         nothing is cached before it, else gathered from the paged cache by slot (the store
                         has already written the chunk's new keys there)

Query j of a chunk with q_len queries and seq_len keys sits at position seq_len - q_len + j and sees keys
0 .. that position: causal from the bottom right. Kernels, by case (CUDA, 16-bit):

    a few long fresh prompts      cuDNN attention (SDPA's CUDNN backend, GQA native), one call per prompt:
    (<= CUDNN_MAX_CHUNKS chunks,  on an H100 it runs a causal 8k prompt at 583 TFLOP/s where FlashAttention-2
     each >= CUDNN_MIN_TOKENS,    runs 315 (4k: 431 vs 263; bench/prefill_attention.py). Per-prompt calls
     no cached prefix)            cost host launches, so many short prompts stay on the varlen call.
    everything else               one FlashAttention-2 varlen call over the packed chunks (GQA native, no K/V
                                  repeat, no per-sequence host loop, bottom-right causal for cached prefixes)

Elsewhere (CPU, float32) one SDPA per chunk. If the cuDNN backend refuses the shapes once, the process falls
back to the varlen call for good and says so in the log (PackedPrefill keeps that state, one per backend).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from model_runtime.attention.base import MixedPlan, read_kv, slot_rows

log = logging.getLogger(__name__)

CUDNN_MIN_TOKENS = 1024
CUDNN_MAX_CHUNKS = 4


def context_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: MixedPlan,
    kv_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefill chunks' keys and values (see the module docstring); gathered from an FP8 cache, they are
    dequantized with their rows' scales (kv_scale), so a chunk with a cached prefix reads every key as the
    decode kernel does."""
    slots = plan.context_slots
    if slots is not None:

        def rows(pages: torch.Tensor) -> torch.Tensor:
            return slot_rows(pages, slots)

        return read_kv(k_cache, kv_scale, 0, k.dtype, rows), read_kv(v_cache, kv_scale, 1, v.dtype, rows)
    if plan.prefill_rows is None:
        return k, v
    return k.index_select(0, plan.prefill_rows), v.index_select(0, plan.prefill_rows)


def _use_flash(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


class PackedPrefill:
    """Picks the prefill kernel per step (see the module docstring); remembers a cuDNN refusal."""

    def __init__(self) -> None:
        self.cudnn_usable = True

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: MixedPlan, scale: float
    ) -> torch.Tensor:
        """q [Tp, Hq, D] against k, v [K, Hkv, D] (see the module docstring); returns [Tp, Hq, D]."""
        k, v = k.to(q.dtype), v.to(q.dtype)
        if not _use_flash(q):
            return _per_chunk(q, k, v, plan, scale)
        if self.cudnn_usable and _long_fresh_prompts(plan):
            out = self._cudnn_per_prompt(q, k, v, plan, scale)
            if out is not None:
                return out
        return torch.ops.aten._flash_attention_forward(
            q, k, v, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k, 0.0, True, False, scale=scale
        )[0]

    def _cudnn_per_prompt(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: MixedPlan, scale: float
    ) -> torch.Tensor | None:
        """Each fresh prompt through SDPA's cuDNN backend ([1, H, T, D] views of the packed rows); None if
        the backend refuses (then never again in this process)."""
        out = torch.empty_like(q)
        start = 0
        try:
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                for n in plan.prefill_query_lens:
                    qi, ki, vi = (x[start : start + n].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
                    o = F.scaled_dot_product_attention(
                        qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True
                    )
                    out[start : start + n] = o.squeeze(0).transpose(0, 1)
                    start += n
        except RuntimeError as exc:
            self.cudnn_usable = False
            log.warning("cuDNN attention refused a prefill (%s); FlashAttention-2 varlen from now on", exc)
            return None
        return out


def _long_fresh_prompts(plan: MixedPlan) -> bool:
    lens = plan.prefill_query_lens
    return (
        plan.context_slots is None
        and 0 < len(lens) <= CUDNN_MAX_CHUNKS
        and min(lens) >= CUDNN_MIN_TOKENS
        and lens == plan.prefill_seq_lens
    )


def _per_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: MixedPlan, scale: float
) -> torch.Tensor:
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    qs = ks = 0
    for q_len, seq_len in zip(plan.prefill_query_lens, plan.prefill_seq_lens):
        qi = q[qs : qs + q_len].transpose(0, 1)
        ki = k[ks : ks + seq_len].transpose(0, 1).repeat_interleave(group, dim=0)
        vi = v[ks : ks + seq_len].transpose(0, 1).repeat_interleave(group, dim=0)
        mask = causal_lower_right(q_len, seq_len)
        o = F.scaled_dot_product_attention(
            qi.unsqueeze(0), ki.unsqueeze(0), vi.unsqueeze(0), attn_mask=mask, scale=scale
        )
        out[qs : qs + q_len] = o.squeeze(0).transpose(0, 1)
        qs, ks = qs + q_len, ks + seq_len
    return out
