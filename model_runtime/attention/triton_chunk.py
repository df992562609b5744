"""Short prompt chunks over long cached contexts: attention read from the paged cache in place, split along the
context (the cached group of a mixed step, attention.base.MixedPlan.cached).

Why: a chat turn is a few hundred new tokens over a cached prefix of thousands. Gathered into one
FlashAttention-2 varlen call, its 128 new tokens over 32 query heads make 32 programs of 128 query rows on 132
SMs, each walking the whole 2k-token context alone: 81 us a layer on an H200, 29% of the step's kernels
(docs/performance.md, "A chunk over a cached prefix, split along its context"). Here a program takes a tile of a
chunk's tokens times the query heads of one KV head (GQA packed into the tile's rows, so each key is read once
per KV head) and one slice of the keys that tile may see, and the slices are merged after:

    work item w = (rows [q_lo, q_hi) of the group, keys [k_lo, k_hi) of the group's context), grid (W, Hkv)
    key a of the group's context sits at slot context_slots[a]: k_cache[slot // B, slot % B, kv_head, :]
    row r sees key a  iff  a <= r + delta   (delta = cu_k[c+1] - cu_q[c+1] for r's chunk c: bottom-right causal)

A tile whose keys fit in one item writes its output rows directly; the others write normalised partial outputs
and log-sum-exps (log2) that the merge kernel combines per (row, query head). The work table is planned on the
host once per step (plan_chunk_work, numpy) and reused by every layer. No gather, no copy of the context.

An FP8 cache (QUANTIZED) is read as the decode kernel reads it (triton_decode's docstring): e4m3 codes and one
bfloat16 scale per token and KV head from the same blocks, dots in float16, a key's scale applied to its score
column and a value's to its probability (lifted by V_SCALE_LIFT, undone on the output), so the loop reads one byte
per element and no dequantized copy of the context is made. As there, a tile's scales are loaded one iteration
ahead and the slots that address them two: a first version that loaded them beside their codes was 1-1.6 ms a
step slower than gathering (docs/performance.md, "A chunk over a cached prefix, split along its context").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from model_runtime.attention.triton_decode import V_SCALE_LIFT
from model_runtime.attention.triton_store import check_scale_pages
from model_runtime.fused.e4m3 import converts_e4m3, e4m3_to_float16

ROWS = 64  # a tile's M rows: tokens x the query heads of one KV head (GQA packed), padded to a power of two
TILE_N = 64  # keys per loop iteration
PROGRAMS_PER_SM = 2  # the split aims for this many programs (work items x KV heads) per SM
NUM_WARPS = 4
NUM_STAGES = 2
ITEM_FIELDS = 6  # q_lo, q_hi, k_lo, k_hi, delta, items of its tile


def tile_tokens(group: int) -> int:
    """Query tokens per tile for `group` query heads per KV head."""
    return max(1, ROWS // group)


@dataclass(frozen=True)
class HostChunkWork:
    """The work table of one cached group (see the module docstring), on the host."""

    items: np.ndarray  # int32 [W, ITEM_FIELDS]
    # int32 [Tg, 3]: per row of the group, the first item of its tile, the tile's item count, its place in the tile
    rows: np.ndarray
    tokens_per_tile: int
    split_keys: int


def plan_chunk_work(
    cu_q: np.ndarray, cu_k: np.ndarray, group: int, num_kv_heads: int, sm_count: int
) -> HostChunkWork:
    """Tiles of tile_tokens(group) rows per chunk, each cut into slices of `split_keys` keys (a multiple of
    TILE_N, sized so that items x KV heads come to about PROGRAMS_PER_SM programs per SM); a tile's slices
    cover exactly the keys its last row may see."""
    cu_q, cu_k = np.asarray(cu_q, dtype=np.int64), np.asarray(cu_k, dtype=np.int64)
    q_lens = np.diff(cu_q)
    if (q_lens < 1).any() or (np.diff(cu_k) < q_lens).any():
        raise ValueError(
            f"plan_chunk_work: chunks need 1 <= query length <= context, got {q_lens} / {np.diff(cu_k)}"
        )
    per_tile = tile_tokens(group)
    tiles = -(-q_lens // per_tile)  # per chunk
    chunk = np.repeat(np.arange(len(q_lens)), tiles)
    first_tile = np.concatenate([[0], np.cumsum(tiles)[:-1]])
    t = np.arange(int(tiles.sum())) - np.repeat(first_tile, tiles)
    q_lo = cu_q[chunk] + t * per_tile
    q_hi = np.minimum(q_lo + per_tile, cu_q[chunk + 1])
    delta = cu_k[chunk + 1] - cu_q[chunk + 1]
    k_lo = cu_k[chunk]
    k_hi = q_hi + delta  # the tile's last row sees keys up to (q_hi - 1) + delta
    keys = k_hi - k_lo
    target_items = max(1, PROGRAMS_PER_SM * sm_count // max(1, num_kv_heads))
    split = max(TILE_N, -(-int(keys.sum()) // target_items))
    split = -(-split // TILE_N) * TILE_N
    per = -(-keys // split)  # items per tile
    tile_of = np.repeat(np.arange(len(keys)), per)
    first_item = np.concatenate([[0], np.cumsum(per)[:-1]])
    s = np.arange(int(per.sum())) - np.repeat(first_item, per)
    lo = k_lo[tile_of] + s * split
    items = np.stack(
        [
            q_lo[tile_of],
            q_hi[tile_of],
            lo,
            np.minimum(lo + split, k_hi[tile_of]),
            delta[tile_of],
            per[tile_of],
        ],
        axis=1,
    ).astype(np.int32)
    rows_tile = np.repeat(np.arange(len(keys)), q_hi - q_lo)
    row = np.arange(int(cu_q[-1]))
    rows = np.stack([first_item[rows_tile], per[rows_tile], row - q_lo[rows_tile]], axis=1).astype(np.int32)
    return HostChunkWork(items, rows, per_tile, split)


@dataclass
class ChunkWork:
    """HostChunkWork on the device with the partial-output scratch its split tiles need."""

    items: torch.Tensor  # int32 [W, ITEM_FIELDS]
    rows: torch.Tensor  # int32 [Tg, 3]
    tokens_per_tile: int
    split: bool  # some tile has more than one item: partials are written and merged
    part_out: torch.Tensor  # float32 [W, tokens_per_tile, Hq, D] (empty when not split)
    part_lse: torch.Tensor  # float32 [W, tokens_per_tile, Hq]

    @classmethod
    def on(cls, host: HostChunkWork, num_heads: int, head_dim: int, device: torch.device) -> ChunkWork:
        # One copy for both tables. From pageable memory a non-blocking copy returns once the bytes are staged,
        # without waiting for the stream's queued work (a blocking one would wait for the GPU).
        both = torch.from_numpy(np.concatenate([host.items.ravel(), host.rows.ravel()])).to(
            device, non_blocking=True
        )
        items = both[: host.items.size].view(host.items.shape)
        rows = both[host.items.size :].view(host.rows.shape)
        split = bool((host.items[:, 5] > 1).any())
        w = host.items.shape[0] if split else 0
        part_out = torch.empty(
            w, host.tokens_per_tile, num_heads, head_dim, dtype=torch.float32, device=device
        )
        part_lse = torch.empty(w, host.tokens_per_tile, num_heads, dtype=torch.float32, device=device)
        return cls(items, rows, host.tokens_per_tile, split, part_out, part_lse)


@triton.jit
def _slot_scales(
    k_scale_ptr, v_scale_ptr, slots, ok, kv_head, stride_sn, stride_sb, stride_sh, PAGE: tl.constexpr
):  # fmt: skip
    """An FP8 cache's K and V scales of the keys at `slots` for one KV head, 0 where not `ok`."""
    at = (slots // PAGE) * stride_sn + (slots % PAGE) * stride_sb + kv_head * stride_sh
    return tl.load(k_scale_ptr + at, mask=ok, other=0.0), tl.load(v_scale_ptr + at, mask=ok, other=0.0)


# The work tables and the slots are views into per-step buffers at offsets that vary from step to step: kept out of
# Triton's 16-byte alignment specialization, which would otherwise build another variant mid-run.
# fmt: off
@triton.jit(do_not_specialize_on_alignment=["slots_ptr", "items_ptr"])
def _chunk_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, items_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    k_scale_ptr, v_scale_ptr, scale_log2,
    stride_qt, stride_qh, stride_kn, stride_kb, stride_kh, stride_vn, stride_vb, stride_vh,
    stride_sn, stride_sb, stride_sh,
    stride_ot, stride_oh, stride_pw, stride_pt, stride_ph, stride_lw, stride_lt, stride_lh,
    GROUP: tl.constexpr, TOKENS: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, PAGE: tl.constexpr, TILE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    QUANTIZED: tl.constexpr, STAGE_V: tl.constexpr,
):
    # fmt: on
    w = tl.program_id(0)
    kv_head = tl.program_id(1)
    item = items_ptr + w * 6  # ITEM_FIELDS
    q_lo = tl.load(item)
    q_hi = tl.load(item + 1)
    k_lo = tl.load(item + 2)
    k_hi = tl.load(item + 3)
    delta = tl.load(item + 4)
    num_items = tl.load(item + 5)

    m = tl.arange(0, BLOCK_M)
    tok = m // GROUP
    heads = kv_head * GROUP + m % GROUP
    row = q_lo + tok
    row_ok = (tok < TOKENS) & (row < q_hi)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    io_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + row[:, None].to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=io_mask, other=0.0)
    if QUANTIZED:
        q = q.to(tl.float16)  # and k, p, v follow q's dtype below
    last_key = row + delta  # row's own position in the group's context

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if QUANTIZED:  # scales run one tile ahead of their use, their slots two (see the module docstring)
        first = k_lo + tl.arange(0, TILE)
        k_scale_next, v_scale_next = _slot_scales(
            k_scale_ptr, v_scale_ptr, tl.load(slots_ptr + first, mask=first < k_hi, other=0), first < k_hi,
            kv_head, stride_sn, stride_sb, stride_sh, PAGE,
        )
        slots_after = tl.load(slots_ptr + first + TILE, mask=first + TILE < k_hi, other=0)
    for n0 in range(k_lo, k_hi, TILE):
        a = n0 + tl.arange(0, TILE)
        a_ok = a < k_hi
        if QUANTIZED:
            k_scale, v_scale = k_scale_next, v_scale_next
            k_scale_next, v_scale_next = _slot_scales(
                k_scale_ptr, v_scale_ptr, slots_after, a + TILE < k_hi, kv_head, stride_sn, stride_sb, stride_sh,
                PAGE,
            )
            slots_after = tl.load(slots_ptr + a + 2 * TILE, mask=a + 2 * TILE < k_hi, other=0)
        # Keys past the item read slot 0 (block 0, the null block: zeros, never written) and are masked below.
        slot = tl.load(slots_ptr + a, mask=a_ok, other=0)
        block = slot // PAGE
        in_page = slot % PAGE
        k = tl.load(k_cache_ptr + (block * stride_kn + in_page * stride_kb + kv_head * stride_kh)[:, None]
                    + d[None, :], mask=d_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * scale_log2
        if QUANTIZED:
            s = s * k_scale.to(tl.float32)[None, :]
        seen = a_ok[None, :] & (a[None, :] <= last_key[:, None])
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + (block * stride_vn + in_page * stride_vb + kv_head * stride_vh)[:, None]
                    + d[None, :], mask=d_ok[None, :], other=0.0)
        pv = p
        if QUANTIZED:
            pv = p * (v_scale.to(tl.float32) * V_SCALE_LIFT)[None, :]
        if STAGE_V:  # V's codes as float16 before the dot's operand is formed (fused/e4m3.py)
            v = e4m3_to_float16(v)
        acc = acc * alpha[:, None] + tl.dot(pv.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        m_i = m_new

    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    o = acc / l_safe[:, None]
    if QUANTIZED:
        o = o * (1.0 / V_SCALE_LIFT)
    if num_items == 1:
        tl.store(out_ptr + row[:, None].to(tl.int64) * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        lse = tl.where(has_keys, m_i + tl.log2(l_safe), float("-inf"))
        at = w.to(tl.int64) * stride_pw + tok * stride_pt + heads * stride_ph
        tl.store(part_out_ptr + at[:, None] + d[None, :], o, mask=io_mask)
        tl.store(part_lse_ptr + w.to(tl.int64) * stride_lw + tok * stride_lt + heads * stride_lh, lse,
                 mask=row_ok)


# fmt: off
@triton.jit(do_not_specialize_on_alignment=["rows_ptr"])
def _chunk_merge_kernel(
    rows_ptr, part_out_ptr, part_lse_ptr, out_ptr,
    stride_pw, stride_pt, stride_ph, stride_lw, stride_lt, stride_lh, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # fmt: on
    r = tl.program_id(0)
    head = tl.program_id(1)
    first = tl.load(rows_ptr + r * 3)
    num_items = tl.load(rows_ptr + r * 3 + 1)
    if num_items > 1:  # a tile of one item wrote its rows itself
        t = tl.load(rows_ptr + r * 3 + 2)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        m = tl.load(part_lse_ptr + first.to(tl.int64) * stride_lw + t * stride_lt + head * stride_lh)
        for i in range(1, num_items):
            m = tl.maximum(m, tl.load(part_lse_ptr + (first + i).to(tl.int64) * stride_lw + t * stride_lt
                                      + head * stride_lh))
        num = tl.zeros([BLOCK_D], tl.float32)
        den = tl.sum(num, 0)  # 0.0, as a float32 scalar the loop can carry
        for i in range(0, num_items):
            w = (first + i).to(tl.int64)
            lse = tl.load(part_lse_ptr + w * stride_lw + t * stride_lt + head * stride_lh)
            weight = tl.exp2(lse - m)  # 0 for a slice the row saw nothing of (lse -inf)
            part = tl.load(part_out_ptr + w * stride_pw + t * stride_pt + head * stride_ph + d, mask=d_ok, other=0.0)
            num += tl.where(weight > 0.0, part, 0.0) * weight
            den += weight
        tl.store(out_ptr + r.to(tl.int64) * stride_ot + head * stride_oh + d, (num / den).to(out_ptr.dtype.element_ty),
                 mask=d_ok)


def chunk_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    context_slots: torch.Tensor,
    work: ChunkWork,
    scale: float,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the group's rows q [Tg, Hq, D] over their contexts (slots `context_slots`, the
    chunks' own new keys stored already) in pages k_cache, v_cache [N, B, Hkv, D]: [Tg, Hq, D]. `kv_scale`
    [2, N, B, Hkv] bfloat16: an FP8 cache's scale pages (kv_quant.split_fp8_cache)."""
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"chunk_attention: q must be [T, Hq, D] and the caches [N, B, Hkv, D] alike; got {tuple(q.shape)}, "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[2]
    if num_heads % kv_heads or head_dim != k_cache.shape[3] or q.stride(2) != 1 or k_cache.stride(3) != 1:
        raise ValueError(
            f"chunk_attention: {num_heads} query heads of dim {head_dim} (contiguous) over {kv_heads} KV heads "
            f"of dim {k_cache.shape[3]}"
        )
    check_scale_pages(k_cache, kv_scale, "chunk_attention")
    group = num_heads // kv_heads
    quantized = kv_scale is not None
    k_scale, v_scale = (context_slots, context_slots) if kv_scale is None else (kv_scale[0], kv_scale[1])  # unread
    scale_strides = (0, 0, 0) if kv_scale is None else (kv_scale.stride(1), kv_scale.stride(2), kv_scale.stride(3))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    po, pl = work.part_out, work.part_lse
    block_d = max(16, triton.next_power_of_2(head_dim))
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    # fmt: off
    _chunk_split_kernel[(work.items.shape[0], kv_heads)](
        q, k_cache, v_cache, context_slots, work.items, out, po, pl, k_scale, v_scale, scale * math.log2(math.e),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), *scale_strides, out.stride(0), out.stride(1),
        *_part_strides(po, pl),
        GROUP=group, TOKENS=work.tokens_per_tile,
        BLOCK_M=max(16, triton.next_power_of_2(work.tokens_per_tile * group)),
        HEAD_DIM=head_dim, BLOCK_D=block_d, PAGE=k_cache.shape[1], TILE=TILE_N, DOT_PRECISION=precision,
        QUANTIZED=quantized, STAGE_V=quantized and converts_e4m3(q.device),
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    if work.split:
        _chunk_merge_kernel[(q.shape[0], num_heads)](
            work.rows, po, pl, out, *_part_strides(po, pl), out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d,
        )
    # fmt: on
    return out


def _part_strides(po: torch.Tensor, pl: torch.Tensor) -> tuple[int, ...]:
    return po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1), pl.stride(2)


def warm_up(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_scale: torch.Tensor | None = None
) -> None:
    """Builds both kernels for the model's shapes and strides (q [>= 1, Hq, D] laid out as the model's rows, any
    values; one layer's pages, with an FP8 cache's scale pages) by running a one-token chunk over two tiles of
    null-block keys, split in two: no start-up step runs a chunk over a cached prefix, and a kernel built mid-run
    would hold up the first one."""
    keys = 2 * TILE_N
    host = plan_chunk_work(np.array([0, 1]), np.array([0, keys]), q.shape[1] // k_cache.shape[2], 1, keys)
    work = ChunkWork.on(host, q.shape[1], q.shape[2], q.device)
    assert work.split, "the warm-up must build the merge kernel too"
    slots = torch.zeros(keys, dtype=torch.int64, device=q.device)
    chunk_attention(q[:1], k_cache, v_cache, slots, work, 1.0, kv_scale)
