"""Prompt chunks of a step, by group (attention.base.MixedPlan): causal attention over packed sequences.

    q      [Tp, Hq, D]   a group's rows, chunk after chunk (cu_q marks the chunks)
    k, v   [K, Hkv, D]   each chunk's whole context, chunk after chunk (cu_k): the chunk's own fresh rows when
                         nothing is cached before it, else gathered from the paged cache by slot (the store
                         has already written the chunk's new keys there)

Query j of a chunk with q_len queries and seq_len keys sits at position seq_len - q_len + j and sees keys
0 .. that position: causal from the bottom right. Kernels, by group (CUDA, 16-bit):

    long_fresh    cuDNN attention (SDPA's CUDNN backend, GQA native), one call per prompt, reading and writing
                  the step's own rows: on an H100 it runs a causal 8k prompt at 583 TFLOP/s where
                  FlashAttention-2 runs 315 (4k: 431 vs 263; on an H200 2k: 286 vs 181, bench/prefill_attention.py).
                  Per-prompt calls cost host launches, so only a few long prompts take them.
    fresh, cached one FlashAttention-2 varlen call per group (GQA native, no K/V repeat, no per-sequence host
                  loop, bottom-right causal for cached prefixes). Only the cached group gathers: a fresh chunk
                  in the same step keeps its own rows (until 2026-11-29 one chunk with a cached prefix made the
                  whole step gather and dequantize every chunk's context, and lose cuDNN).

Elsewhere (CPU, float32) one SDPA per chunk. If the cuDNN backend refuses the shapes once, the process falls
back to the varlen call for good and says so in the log (PackedPrefill keeps that state, one per backend).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from model_runtime.attention.base import PrefillGroup, read_kv, slot_rows

log = logging.getLogger(__name__)


def group_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: PrefillGroup,
    kv_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's keys and values (see the module docstring); gathered from an FP8 cache, they are
    dequantized with their rows' scales (kv_scale), so a chunk with a cached prefix reads every key as the
    decode kernel does."""
    slots = group.context_slots
    if slots is None:
        return group.rows.take(k), group.rows.take(v)

    def rows(pages: torch.Tensor) -> torch.Tensor:
        return slot_rows(pages, slots)

    return read_kv(k_cache, kv_scale, 0, k.dtype, rows), read_kv(v_cache, kv_scale, 1, v.dtype, rows)


def _use_flash(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


class PackedPrefill:
    """Runs a group's attention with the kernel its group and device call for; remembers a cuDNN refusal."""

    def __init__(self) -> None:
        self.cudnn_usable = True

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: PrefillGroup, scale: float
    ) -> torch.Tensor:
        """One call over the group: q [Tp, Hq, D] (its rows) against k, v [K, Hkv, D] (group_kv); returns
        [Tp, Hq, D]."""
        k, v = k.to(q.dtype), v.to(q.dtype)
        if not _use_flash(q):
            return _per_chunk(q, k, v, group, scale)
        return torch.ops.aten._flash_attention_forward(
            q, k, v, group.cu_q, group.cu_k, group.max_q, group.max_k, 0.0, True, False, scale=scale
        )[0]

    def per_prompt(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        group: PrefillGroup,
        scale: float,
        out: torch.Tensor,
    ) -> bool:
        """Each fresh prompt of the group through SDPA's cuDNN backend, from the step's rows (q, k, v: every
        row of the step) into `out`'s ([1, H, T, D] views); False when this device cannot (CPU, float32) or
        the backend refuses (then never again in this process): the caller runs the group as one call."""
        if not (self.cudnn_usable and _use_flash(q)):
            return False
        try:
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                for start, n in zip(group.starts, group.query_lens):
                    qi, ki, vi = (x[start : start + n].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
                    o = F.scaled_dot_product_attention(
                        qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True
                    )
                    out[start : start + n] = o.squeeze(0).transpose(0, 1)
        except RuntimeError as exc:
            self.cudnn_usable = False
            log.warning("cuDNN attention refused a prefill (%s); FlashAttention-2 varlen from now on", exc)
            return False
        return True


def _per_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: PrefillGroup, scale: float
) -> torch.Tensor:
    out = torch.empty_like(q)
    heads_per_kv = q.shape[1] // k.shape[1]
    qs = ks = 0
    for q_len, seq_len in zip(group.query_lens, group.seq_lens):
        qi = q[qs : qs + q_len].transpose(0, 1)
        ki = k[ks : ks + seq_len].transpose(0, 1).repeat_interleave(heads_per_kv, dim=0)
        vi = v[ks : ks + seq_len].transpose(0, 1).repeat_interleave(heads_per_kv, dim=0)
        mask = causal_lower_right(q_len, seq_len)
        o = F.scaled_dot_product_attention(
            qi.unsqueeze(0), ki.unsqueeze(0), vi.unsqueeze(0), attn_mask=mask, scale=scale
        )
        out[qs : qs + q_len] = o.squeeze(0).transpose(0, 1)
        qs, ks = qs + q_len, ks + seq_len
    return out
