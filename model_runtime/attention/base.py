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
from dataclasses import dataclass

import torch

from model_runtime.kv_quant import dequantize_kv, quantize_kv


@dataclass
class MixedPlan:
    """How an eager step's rows split between packed prefill attention and the decode kernel, on the device.

    Built once per step by the model runner (from HostBatch.mixed_plan) so that no layer builds an index.
    Prefill chunks (more than one query token) run as one variable-length causal attention over packed
    sequences; single-token chunks run through the paged decode kernel:

        prefill_rows   int64 [Tp]   rows of q in prefill chunks, in order; None when every row is one
        cu_q, cu_k     int32 [P+1]  cumulative query lengths / context lengths of those P chunks
        context_slots  int64 [K]    cache slots of every context token of the P chunks (K = cu_k[-1]); None
                                    when no chunk has a cached prefix (its keys are then its own fresh rows)
        decode_rows    int64 [Sd]   rows of single-token chunks, decode_seqs [Sd] their sequence index
    """

    prefill_rows: torch.Tensor | None
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    context_slots: torch.Tensor | None
    decode_rows: torch.Tensor | None
    decode_seqs: torch.Tensor | None
    prefill_query_lens: list[int]  # host copies, for the per-sequence fallback (CPU, float32)
    prefill_seq_lens: list[int]


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
    ) -> torch.Tensor:
        """Store k/v at meta.slot_mapping into k_cache/v_cache ([N, B, Hkv, D] each), return [T, Hq, D].
        `kv_scale`: the layer's [2, N, B, Hkv] scale pages when the cache is FP8, else None."""


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
