"""Prompt chunks of a step, by group (attention.base.MixedPlan): causal attention over packed sequences.

    q      [Tp, Hq, D]   a group's rows, chunk after chunk (cu_q marks the chunks)
    k, v   [K, Hkv, D]   each chunk's whole context, chunk after chunk (cu_k): the chunk's own fresh rows when
                         nothing is cached before it, else gathered from the paged cache by slot (the store
                         has already written the chunk's new keys there)

Query j of a chunk with q_len queries and seq_len keys sits at position seq_len - q_len + j and sees keys
0 .. that position: causal from the bottom right. Kernels, by group (CUDA, 16-bit):

    long_fresh    cuDNN attention (SDPA's CUDNN backend, GQA native), one call per prompt, reading the step's
                  own rows and writing into its output: on an H100 it runs a causal 8k prompt at 583 TFLOP/s
                  where FlashAttention-2 runs 315 (4k: 431 vs 263; on an H200 2k: 286 vs 181,
                  bench/prefill_attention.py). Per-prompt calls cost host launches, so only a few long prompts
                  take them. Each call runs at a bucketed length (attention.base.per_prompt_length), whose
                  cuDNN plan start-up built: the rows past the chunk's own are the step's next rows where there
                  are enough, else a padded copy with the same strides; causal attention keeps them out of the
                  chunk's rows, and their outputs are dropped.
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

from model_runtime.attention.base import (
    PER_PROMPT_BUCKET,
    PER_PROMPT_MIN_TOKENS,
    PrefillGroup,
    per_prompt_length,
    read_kv,
    slot_rows,
)
from model_runtime.attention.triton_gather import gather_fp8_kv

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
    decode kernel does (one Triton launch for both, attention.triton_gather)."""
    slots = group.context_slots
    if slots is None:
        return group.rows.take(k), group.rows.take(v)
    if kv_scale is not None:
        return gather_fp8_kv(k_cache, v_cache, kv_scale, slots, k.dtype)

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
        row of the step) into `out`'s, at its bucketed length (see the module docstring); False when this
        device cannot (CPU, float32) or the backend refuses (then never again in this process): the caller
        runs the group as one call."""
        if not (self.cudnn_usable and _use_flash(q)):
            return False
        try:
            for start, n in zip(group.starts, group.query_lens):
                qi, ki, vi = padded_rows(q, k, v, start, n, per_prompt_length(n))
                out[start : start + n] = _cudnn_causal(qi, ki, vi, scale)[:n]
        except RuntimeError as exc:
            self.cudnn_usable = False
            log.warning("cuDNN attention refused a prefill (%s); FlashAttention-2 varlen from now on", exc)
            return False
        return True

    def warm_up(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, max_tokens: int) -> int:
        """Builds the cuDNN plan of every per-prompt length up to `max_tokens` (the step budget), on q, k, v
        laid out as the model's (rows of the step; at least per_prompt_length(max_tokens) of them, any values):
        a plan is keyed by shapes and strides. Returns how many lengths it built (0 where the device cannot)."""
        if not (self.cudnn_usable and _use_flash(q)) or max_tokens < PER_PROMPT_MIN_TOKENS:
            return 0
        first, last = per_prompt_length(PER_PROMPT_MIN_TOKENS), per_prompt_length(max_tokens)
        if min(x.shape[0] for x in (q, k, v)) < last:
            raise ValueError(
                f"PackedPrefill.warm_up: plans up to {last} rows need q, k, v of at least {last} rows, got "
                f"{q.shape[0]}, {k.shape[0]}, {v.shape[0]}"
            )
        built = 0
        try:
            for n in range(first, last + 1, PER_PROMPT_BUCKET):
                _cudnn_causal(q[:n], k[:n], v[:n], 1.0)
                built += 1
        except RuntimeError as exc:
            self.cudnn_usable = False
            log.warning("cuDNN attention refused a prefill (%s); FlashAttention-2 varlen from now on", exc)
        return built


def _cudnn_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One sequence's causal attention through SDPA's cuDNN backend: [n, Hq, D] rows in, [n, Hq, D] out."""
    qi, ki, vi = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)


def padded_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, n: int, length: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows start .. start + length of q, k, v, of which the first n are a prompt's: views of the step's own
    rows where it has that many (the rows after the prompt's are other chunks' values, finite), else a copy
    of the n rows followed by zeros, laid out with q's, k's and v's strides (one buffer when they are views
    of one, as the model's are) so that the copy meets the same cuDNN plan as a view would."""
    rows = (q, k, v)
    if start + length <= q.shape[0]:
        return q[start : start + length], k[start : start + length], v[start : start + length]
    row = q.stride(0)
    shared = (
        k.stride(0) == row
        and v.stride(0) == row
        and k.untyped_storage().data_ptr() == q.untyped_storage().data_ptr()
        and v.untyped_storage().data_ptr() == q.untyped_storage().data_ptr()
    )
    base = min(x.storage_offset() for x in rows) if shared else 0
    offsets = [x.storage_offset() - base for x in rows]
    if shared and max(o + x[0].numel() for o, x in zip(offsets, rows)) <= row:
        buffer = torch.empty(length * row, dtype=q.dtype, device=q.device)
        buffer[n * row :].zero_()  # the padding rows; gaps between q, k and v in a row are never read
        views = [buffer.as_strided((length, *x.shape[1:]), x.stride(), o) for x, o in zip(rows, offsets)]
    else:
        views = [x.new_zeros((length, *x.shape[1:])) for x in rows]
    for view, x in zip(views, rows):
        view[:n].copy_(x[start : start + n])
    return views[0], views[1], views[2]


def _per_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: PrefillGroup, scale: float
) -> torch.Tensor:
    # Imported here: torch.nn.attention.bias imports torch._dynamo (about 2 s of CPU), which only this
    # fallback needs, and a CPU worker would otherwise pay it at start-up through the Triton backend's imports.
    from torch.nn.attention.bias import causal_lower_right

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
