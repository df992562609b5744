"""The attention seam: what the model hands a backend, and what a backend must do with it.

A step runs a packed batch of T query tokens from B sequences (prefill chunks and decode tokens mixed):

    q: [T, Hq, D]   k, v: [T, Hkv, D]      tokens of sequence i are rows query_start_loc[i]:query_start_loc[i+1]
    seq_lens[i]: the sequence's context length after this step (cached tokens + its new tokens)
    the new tokens of sequence i sit at positions seq_lens[i] - q_len_i ... seq_lens[i] - 1

A backend (1) writes k and v into the paged cache at `slot_mapping` (slot -1: padding, skipped) and (2) returns
causal attention of each query over its sequence's context read through `block_tables`.

An FP8 cache (float8_e4m3fn pages) comes with `kv_scale` [2, N, B, Hkv] bfloat16: one scale per cached token
and KV head for K and for V, a view of the same blocks (model_runtime.kv_quant): the backend stores each row's
codes and scale and reads code * scale. Other caches get None.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from model_runtime.kv_quant import dequantize_kv, quantize_kv

# Fresh prompt chunks at least this long, at most this many in a step, run one attention call each (the cuDNN
# kernel on a GPU: bench/prefill_attention.py); shorter or more go together in one variable-length call. cuDNN
# builds an execution plan per sequence length (on an H200 63 ms at a length new to the process, up to 0.7 s,
# against 0.25 ms once built: prefill_attention.py --first-calls), so every call is made at a multiple of
# PER_PROMPT_BUCKET rows, the chunk's rows followed by padding that causal attention keeps out of them, and the
# plans for those lengths are built at start-up (packed_prefill.PackedPrefill.warm_up).
PER_PROMPT_MIN_TOKENS = 1024
PER_PROMPT_MAX_CHUNKS = 4
PER_PROMPT_BUCKET = 256


def per_prompt_length(n: int) -> int:
    """The length a per-prompt call of an n-token chunk runs at: n rounded up to PER_PROMPT_BUCKET."""
    return -(-n // PER_PROMPT_BUCKET) * PER_PROMPT_BUCKET


@dataclass
class Rows:
    """Rows of a step's q that one part of the step computes: [start, stop) when they are contiguous (`index`
    None: slices, views and in-place writes), else `index` int64 [n] on the device."""

    start: int
    stop: int
    index: torch.Tensor | None = None

    def take(self, x: torch.Tensor) -> torch.Tensor:
        return x[self.start : self.stop] if self.index is None else x.index_select(0, self.index)

    def target(self, out: torch.Tensor) -> torch.Tensor | None:
        """The rows of `out` as a view to write into, or None when they are not contiguous."""
        return out[self.start : self.stop] if self.index is None else None

    def write(self, out: torch.Tensor, values: torch.Tensor) -> None:
        if self.index is None:
            out[self.start : self.stop].copy_(values)
        else:
            out.index_copy_(0, self.index, values)


@dataclass
class PrefillGroup:
    """Prompt chunks of a step that attend in one way (MixedPlan says which):

    rows           their q rows, chunk after chunk
    cu_q, cu_k     int32 [P+1]  cumulative query lengths / context lengths of the P chunks
    context_slots  int64 [K]    cache slots of every context token of the chunks (K = cu_k[-1]); None when
                                the chunks have no cached prefix (their keys are their own fresh rows)
    starts         each chunk's first row in the step (host), for calls per chunk
    chunk_work     a backend's per-step plan for the group, made by the first layer that needs it and reused
                   by the others (the Triton backend's split-KV work table, triton_chunk.ChunkWork)
    """

    rows: Rows
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    context_slots: torch.Tensor | None
    query_lens: list[int]  # host copies: calls per chunk and the per-chunk fallback (CPU, float32)
    seq_lens: list[int]
    starts: list[int]
    chunk_work: object | None = field(default=None, repr=False)

    @property
    def num_rows(self) -> int:
        return self.rows.stop - self.rows.start if self.rows.index is None else int(self.rows.index.shape[0])


@dataclass
class MixedPlan:
    """How an eager step's rows split between prefill attention and the decode kernel, on the device.

    Built once per step by the model runner (from HostBatch.mixed_plan) so that no layer builds an index.
    Prompt chunks (more than one query token) fall in three groups, each None when the step has none:

        long_fresh   no cached prefix, >= PER_PROMPT_MIN_TOKENS each, at most PER_PROMPT_MAX_CHUNKS of them:
                     one attention call per chunk over its own fresh rows
        fresh        the other chunks without a cached prefix: one variable-length call over their fresh rows
        cached       chunks with a cached prefix: one variable-length call over their contexts, gathered from
                     the cache by slot (a chunk's own new keys included: the store has written them there);
                     and single-token chunks (decode rows) whose contexts are short enough in total
                     (config.DECODE_GATHER_MAX_TOKENS)

    Other single-token chunks run through the paged decode kernel (decode_rows, decode_seqs [Sd] their sequence
    index). `covered`: every row of the step is in one of them (no padding rows, which must stay zero).
    """

    long_fresh: PrefillGroup | None
    fresh: PrefillGroup | None
    cached: PrefillGroup | None
    decode_rows: Rows | None
    decode_seqs: torch.Tensor | None
    num_rows: int
    covered: bool

    _sole: PrefillGroup | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        groups = [g for g in (self.long_fresh, self.fresh, self.cached) if g is not None]
        whole = len(groups) == 1 and self.decode_rows is None and self.covered
        rows = groups[0].rows if whole else None
        self._sole = (
            groups[0]
            if rows is not None and rows.index is None and (rows.start, rows.stop) == (0, self.num_rows)
            else None
        )

    def sole_group(self) -> PrefillGroup | None:
        """The one prefill group that computes every row of the step, in order (its output is the step's);
        found once per step, when the plan is built, not in every layer."""
        return self._sole


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, -1 for padding
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with the null block 0
    # Host copies for eager paths (never read inside a CUDA graph).
    query_lens_host: list[int]
    seq_lens_host: list[int]
    max_query_len: int
    max_seq_len: int
    # Eager steps with a prefill chunk: the precomputed split (backends that batch prefill read it).
    mixed: MixedPlan | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(ABC):
    """Paged attention over one layer's cache. Implementations: torch reference (CPU), Triton (GPU)."""

    name: str = "abstract"
    # Decode rows of a step with prompt chunks may join its cached group up to this many context tokens
    # (config.DECODE_GATHER_MAX_TOKENS); only a backend that reads MixedPlan sets it.
    decode_gather_tokens: int = 0
    # A cached group of at most this many query rows is read from the pages in place by a split-KV kernel
    # (config.CHUNK_ATTENTION_MAX_TOKENS); 0 where the backend has none.
    chunk_attention_tokens: int = 0

    @abstractmethod
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
        """Store k/v at meta.slot_mapping into k_cache/v_cache ([N, B, Hkv, D] each), return [T, Hq, D].
        `kv_scale`: the layer's [2, N, B, Hkv] scale pages when the cache is FP8, else None. `stored`: the
        rows are in the cache already (`store` wrote them, inside a piecewise prefill graph), so only attend."""

    def store(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_scale: torch.Tensor | None = None,
    ) -> None:
        """The store half of `forward` on its own (rows whose slot is -1 are skipped)."""
        store_kv(k, v, k_cache, v_cache, slot_mapping, kv_scale)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """Scatter new K/V rows into the pages; rows whose slot is -1 are padding and are dropped. An FP8 cache
    stores each row's codes and its scale in kv_scale[0] (K) / kv_scale[1] (V) (codes as bytes: CPU torch has
    no FP8 index_copy_)."""
    n, b, h, d = k_cache.shape
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    if kv_scale is None:
        k_cache.view(n * b, h, d).index_copy_(0, slots, k[valid].to(k_cache.dtype))
        v_cache.view(n * b, h, d).index_copy_(0, slots, v[valid].to(v_cache.dtype))
        return
    # An FP8 block is its codes then its scales, so neither view flattens to slots: index by (block, offset).
    blocks, offsets = slots // b, slots % b
    for rows, cache, scale_pages in ((k[valid], k_cache, kv_scale[0]), (v[valid], v_cache, kv_scale[1])):
        codes, scales = quantize_kv(rows)
        cache.view(torch.uint8)[blocks, offsets] = codes.view(torch.uint8)
        scale_pages[blocks, offsets] = scales


def read_kv(
    pages: torch.Tensor,
    kv_scale: torch.Tensor | None,
    which: int,
    dtype: torch.dtype,
    rows: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """K (`which` 0) or V (1) cache rows [..., Hkv, D] as values in `dtype`. `rows` picks them from [N, B, ...]
    pages (a gather by block table or by slot); an FP8 cache's scale pages (kv_scale[which], [N, B, Hkv]) are
    picked alike and multiply their codes."""
    picked = rows(pages)
    if kv_scale is None:
        return picked.to(dtype)
    return dequantize_kv(picked, rows(kv_scale[which]), dtype)


def slot_rows(pages: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows of [N, B, ...] pages (values [.., H, D], or an FP8 cache's scales [.., H]) by flat slot:
    [len(slots), ...]. Pages whose blocks are back to back take one index_select; an FP8 cache's codes and
    scales (a block is both, so neither view's blocks are adjacent) are indexed by (block, offset)."""
    b = pages.shape[1]
    if pages.stride(0) == b * pages.stride(1):
        return pages.flatten(0, 1).index_select(0, slots)
    return pages[slots // b, slots % b]
