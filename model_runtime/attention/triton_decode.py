"""Paged decode attention in Triton: one query token per sequence, split-KV over a fixed number of segments.

Stage 1 runs one program per (sequence, KV head, segment). All query heads that share the KV head are packed
into the M dimension of the tile (padded to >= 16 rows so `tl.dot` runs on tensor cores), and the program
walks its slice of the context TILE_N tokens at a time through the block table:

    context of sequence s:  |-- seg 0 --|-- seg 1 --| ... |-- seg S-1 --|      (empty tail segments allowed)
    token t lives at        k_cache[block_tables[s, t // B], t % B, kv_head, :]

Each program keeps an fp32 online softmax (log2 domain) and writes its normalised partial output and its
log-sum-exp into preallocated scratch; stage 2 merges the segments per (sequence, query head). With one
segment, stage 1 writes the final output directly and stage 2 is skipped.

An FP8 cache (QUANTIZED) comes with scale pages: one bfloat16 scale per cached token and KV head, for K and for V
(model_runtime.kv_quant; a block keeps a head's B scales side by side). A tile loads its tokens' scales beside
their codes (2 bytes per 128 codes, one 32-byte sector per block and head) and applies
them per token, never per element: a key's scale multiplies its score column (q . (k8 * s) = (q . k8) * s), a
value's scale its probability before the PV dot (p * (v8 * s) = (p * s) . v8), so the loop still reads one
byte per element. Its dots run in float16 (float32 accumulation) whatever the query dtype: Hopper converts two
e4m3 codes to float16 in one instruction, while bfloat16 takes a detour through float32 that made the FP8 kernel
0.8x the bf16 one (H200, bench/results/fp8/attention_fp8_run1.json). Codes (|c| <= 448) and queries fit
float16, whose 10-bit mantissa holds more than bfloat16's 7; the scaled probabilities are lifted by
V_SCALE_LIFT (a power of two, undone on the output) so that small ones stay out of float16's subnormals.
Triton's software pipeliner copies the K and V tiles ahead into shared memory (they feed dots) but leaves loads
that feed elementwise arithmetic where they are, so a tile's scales, read in the iteration that used them behind
the block ids that address them, made every FP8 tile wait out a memory latency that a 16-bit tile never waits
for. The loop carries them instead: a tile's scales are requested one iteration ahead, their block ids two
(1.13-1.18x at batch 128-300 on an H200; bench/results/fp8/attention_run50_*.json).

CUDA-graph safety: the grid depends only on tensor shapes (padded batch, heads, segment count), scratch comes
from a `DecodeWorkspace` sized before capture, nothing reads device values on the host. A sequence with
seq_len 0 (graph padding) runs no loop iteration and yields an all-zero output row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from model_runtime.attention.decode_plan import DecodeScratch, DecodeTuning, DecodeWorkspace
from model_runtime.attention.triton_store import check_scale_pages
from model_runtime.fused.e4m3 import converts_e4m3, e4m3_to_float16

MIN_ROWS = 16  # tl.dot needs M >= 16 on tensor cores; the query-head group is padded up to this
# p * v_scale runs in float16: v_scale is max|v| / 448 (about 1e-4 .. 1e-2 for real values), so the products
# would often fall below float16's smallest normal (6e-5). 2^8 lifts them; a v_scale up to 255 (|v| ~ 1e5) fits.
V_SCALE_LIFT: tl.constexpr = tl.constexpr(256.0)


@triton.jit
def _block_ids(bt_row, tok, end, PAGE: tl.constexpr):
    """The pages of tokens `tok` (block 0, the null block, for tokens at or past `end`)."""
    return tl.load(bt_row + tok // PAGE, mask=tok < end, other=0).to(tl.int64)


@triton.jit
def _token_scales(scale_ptr, blocks, tok, end, kv_head, stride_sn, stride_sb, stride_sh, PAGE: tl.constexpr):
    """One scale page's values for tokens `tok` of one KV head, 0 at or past `end`."""
    at = blocks * stride_sn + (tok % PAGE) * stride_sb + kv_head * stride_sh
    return tl.load(scale_ptr + at, mask=tok < end, other=0.0)


@triton.jit
def _scales_ahead(
    k_scale_ptr, v_scale_ptr, bt_row, blocks, tok, end, kv_head, stride_sn, stride_sb, stride_sh,
    PAGE: tl.constexpr, TILE_N: tl.constexpr,
):  # fmt: skip
    """K and V scales of tokens `tok` (on pages `blocks`), and the pages of the tile after them."""
    k_scale = _token_scales(k_scale_ptr, blocks, tok, end, kv_head, stride_sn, stride_sb, stride_sh, PAGE)
    v_scale = _token_scales(v_scale_ptr, blocks, tok, end, kv_head, stride_sn, stride_sb, stride_sh, PAGE)
    return k_scale, v_scale, _block_ids(bt_row, tok + TILE_N, end, PAGE)


@triton.jit
def _load_tokens(cache_ptr, block, in_page, kv_head, d, mask, stride_n, stride_b, stride_h):
    """[TILE_N, BLOCK_D] rows of one KV head, token i at page block[i], offset in_page[i]."""
    ptrs = (
        cache_ptr + block[:, None] * stride_n + in_page[:, None] * stride_b + kv_head * stride_h + d[None, :]
    )
    return tl.load(ptrs, mask=mask, other=0.0)


# The block table's row stride is its width: max_model_len's blocks in the CUDA graphs, the step's longest
# sequence on the eager path, so it changes from step to step there. Specialized, it would build another variant
# whenever the width turned a multiple of 16 (and back), in the middle of a run (model_runtime.kernel_builds).
# fmt: off
@triton.jit(do_not_specialize=["stride_bt"])
def _decode_segment_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, part_out_ptr, part_lse_ptr, out_ptr,
    k_scale_ptr, v_scale_ptr, scale_log2,
    stride_qt, stride_qh, stride_kn, stride_kb, stride_kh, stride_vn, stride_vb, stride_vh,
    stride_sn, stride_sb, stride_sh, stride_bt,
    stride_ps, stride_ph, stride_pg, stride_ls, stride_lh, stride_ot, stride_oh,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, TILE_N: tl.constexpr, NUM_SEGMENTS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    QUANTIZED: tl.constexpr, ALIGNED: tl.constexpr, STAGE_V: tl.constexpr,
):
    # fmt: on
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seg = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP
    d = tl.arange(0, BLOCK_D)
    out_mask = row_ok[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=out_mask, other=0.0)
    if QUANTIZED:
        q = q.to(tl.float16)  # and k, p, v follow q's dtype below

    # Segments are whole tiles so only the last tile of the context is partial.
    per_seg = tl.cdiv(tl.cdiv(seq_len, NUM_SEGMENTS), TILE_N) * TILE_N
    start = seg * per_seg
    end = tl.minimum(start + per_seg, seq_len)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    if ALIGNED:  # tiles start on page boundaries: a tile's offsets within its pages are the same every time
        in_page = tl.arange(0, TILE_N) % PAGE
        k_offs = (in_page * stride_kb + kv_head * stride_kh)[:, None] + d[None, :]
        v_offs = (in_page * stride_vb + kv_head * stride_vh)[:, None] + d[None, :]
    if QUANTIZED:  # scales run one tile ahead of their use, their pages two (see the module docstring)
        first = start + tl.arange(0, TILE_N)
        k_scale_next, v_scale_next, blocks_after = _scales_ahead(
            k_scale_ptr, v_scale_ptr, bt_row, _block_ids(bt_row, first, end, PAGE), first, end, kv_head,
            stride_sn, stride_sb, stride_sh, PAGE, TILE_N,
        )  # fmt: skip
    for t0 in range(start, end, TILE_N):
        tok = t0 + tl.arange(0, TILE_N)
        tok_ok = tok < end
        if QUANTIZED:
            k_scale, v_scale = k_scale_next, v_scale_next
            k_scale_next, v_scale_next, blocks_after = _scales_ahead(
                k_scale_ptr, v_scale_ptr, bt_row, blocks_after, tok + TILE_N, end, kv_head,
                stride_sn, stride_sb, stride_sh, PAGE, TILE_N,
            )  # fmt: skip
        # This tile's pages for its K/V rows (the pipeliner copies them ahead with the rows); an FP8 cache's scale
        # chain above reads the same entries again, two tiles earlier: 4 bytes a token, from cache.
        block = _block_ids(bt_row, tok, end, PAGE)
        # K/V rows are not masked by token: a token past `end` has block 0 (the load above), the null block,
        # which nothing writes (zeros), so its row is read in bounds, its score is masked to -inf below and its
        # probability is 0. Masking rows here made the FP8 kernel 10-15% slower (the d mask folds away when
        # BLOCK_D == HEAD_DIM).
        kv_mask = (d < HEAD_DIM)[None, :]
        if ALIGNED:
            k = tl.load(k_cache_ptr + (block * stride_kn)[:, None] + k_offs, mask=kv_mask, other=0.0)
        else:
            k = _load_tokens(k_cache_ptr, block, tok % PAGE, kv_head, d, kv_mask, stride_kn, stride_kb, stride_kh)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * scale_log2
        if QUANTIZED:
            s = s * k_scale.to(tl.float32)[None, :]
        s = tl.where(tok_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if ALIGNED:
            v = tl.load(v_cache_ptr + (block * stride_vn)[:, None] + v_offs, mask=kv_mask, other=0.0)
        else:
            v = _load_tokens(v_cache_ptr, block, tok % PAGE, kv_head, d, kv_mask, stride_vn, stride_vb, stride_vh)
        pv = p
        if QUANTIZED:
            pv = p * (v_scale.to(tl.float32) * V_SCALE_LIFT)[None, :]
        if STAGE_V:  # V's codes as float16 before the dot's operand is formed (fused/e4m3.py)
            v = e4m3_to_float16(v)
        acc = acc * alpha[:, None] + tl.dot(pv.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        m_i = m_new

    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    o = acc / l_safe[:, None]  # all zeros for an empty segment or a padded sequence
    if QUANTIZED:
        o = o * (1.0 / V_SCALE_LIFT)
    if NUM_SEGMENTS == 1:
        out_ptrs = out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :]
        tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        lse = tl.where(has_keys, m_i + tl.log2(l_safe), float("-inf"))
        part_ptrs = part_out_ptr + seq * stride_ps + heads[:, None] * stride_ph + seg * stride_pg + d[None, :]
        tl.store(part_ptrs, o, mask=out_mask)
        tl.store(part_lse_ptr + seq * stride_ls + heads * stride_lh + seg, lse, mask=row_ok)


@triton.jit
def _reduce_segments_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_ps,
    stride_ph,
    stride_pg,
    stride_ls,
    stride_lh,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    g = tl.arange(0, NUM_SEGMENTS)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    lse = tl.load(part_lse_ptr + seq * stride_ls + head * stride_lh + g)
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every segment empty (seq_len 0): all weights become 0
    w = tl.exp2(lse - m)
    part = tl.load(
        part_out_ptr + seq * stride_ps + head * stride_ph + g[:, None] * stride_pg + d[None, :],
        mask=d_ok[None, :],
        other=0.0,
    )
    part = tl.where(w[:, None] > 0.0, part, 0.0)
    num = tl.sum(part * w[:, None], 0)
    den = tl.sum(w, 0)
    o = num / tl.where(den > 0.0, den, 1.0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d_ok)


def _check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    num_segments: int,
) -> None:
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(
            f"decode_attention: q must be [S, Hq, D] and k_cache [N, B, Hkv, D]; got "
            f"{tuple(q.shape)} and {tuple(k_cache.shape)}"
        )
    if q.shape[1] % k_cache.shape[2] != 0 or q.shape[2] != k_cache.shape[3]:
        raise ValueError(
            f"decode_attention: q heads/dim {tuple(q.shape[1:])} do not match cache "
            f"heads/dim {tuple(k_cache.shape[2:])}"
        )
    if block_tables.shape[0] < q.shape[0] or seq_lens.shape[0] < q.shape[0]:
        raise ValueError(
            f"decode_attention: {q.shape[0]} query rows but block_tables has "
            f"{block_tables.shape[0]} rows and seq_lens {seq_lens.shape[0]}"
        )
    if out.shape != q.shape:
        raise ValueError(f"decode_attention: out shape {tuple(out.shape)} != q shape {tuple(q.shape)}")
    if num_segments < 1 or num_segments & (num_segments - 1):
        raise ValueError(f"decode_attention: num_segments must be a power of two >= 1, got {num_segments}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"decode_attention: v_cache {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}"
        )
    if (
        q.stride(2) != 1
        or k_cache.stride(3) != 1
        or v_cache.stride(3) != 1
        or out.stride(2) != 1
        or block_tables.stride(1) != 1
    ):
        raise ValueError(
            "decode_attention: the head_dim axis of q/out/caches and the block axis of "
            "block_tables must be contiguous"
        )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    workspace: DecodeWorkspace,
    num_segments: int,
    tuning: DecodeTuning | None = None,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[s] = attention of q[s] ([Hq, D], one token) over tokens [0, seq_lens[s]) of its pages. Returns out.
    `kv_scale` [2, N, B, Hkv] bfloat16: an FP8 cache's scale pages (kv_quant.split_fp8_cache)."""
    _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, out, num_segments)
    check_scale_pages(k_cache, kv_scale, "decode_attention")
    num_seqs, num_heads, head_dim = q.shape
    scratch = workspace.scratch(num_seqs, num_heads, num_segments, head_dim, q.device)
    launch = segment_launch(
        q, k_cache, v_cache, block_tables, seq_lens, scale, scratch, out, num_segments, tuning or DecodeTuning(),
        kv_scale, converts_e4m3(q.device),
    )  # fmt: skip
    grid = (num_seqs, k_cache.shape[2], num_segments)
    _decode_segment_kernel[grid](*launch.args, **launch.constexprs, **launch.options)
    if num_segments > 1:
        _launch_reduce(scratch, out, num_segments)
    return out


@dataclass(frozen=True)
class SegmentLaunch:
    """The stage-1 kernel's launch apart from its grid: positional arguments, constexprs and compile options.
    bench/kernel_resources.py compiles the kernel from it for a GPU it does not have."""

    args: tuple[object, ...]
    constexprs: dict[str, object]
    options: dict[str, int]


def segment_launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    scratch: DecodeScratch,
    out: torch.Tensor,
    num_segments: int,
    tuning: DecodeTuning,
    kv_scale: torch.Tensor | None,
    converts_e4m3: bool,
) -> SegmentLaunch:
    """`converts_e4m3`: the device has the e4m3 -> float16 instruction (fused/e4m3.converts_e4m3)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    k_scale, v_scale = (seq_lens, seq_lens) if kv_scale is None else (kv_scale[0], kv_scale[1])  # unread
    scale_strides = (0, 0, 0) if kv_scale is None else (kv_scale.stride(1), kv_scale.stride(2), kv_scale.stride(3))
    group = num_heads // k_cache.shape[2]
    po, pl = scratch.partial_out, scratch.partial_lse
    # fp32 inputs stay exact (no tf32); the setting is irrelevant for 16-bit inputs.
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    quantized = kv_scale is not None
    tile_n = tuning.fp8_tile_n if quantized else tuning.tile_n
    options = {
        "num_warps": tuning.num_warps,
        "num_stages": tuning.fp8_num_stages if quantized else tuning.num_stages,
    }
    if quantized and tuning.fp8_max_registers:  # Triton reads maxnreg as a compile option
        options["maxnreg"] = tuning.fp8_max_registers
    # fmt: off
    args = (
        q, k_cache, v_cache, block_tables, seq_lens, po, pl, out,
        k_scale, v_scale, scale * math.log2(math.e),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *scale_strides, block_tables.stride(0),
        po.stride(0), po.stride(1), po.stride(2),
        pl.stride(0), pl.stride(1),
        out.stride(0), out.stride(1),
    )
    constexprs = dict(
        GROUP=group, BLOCK_M=max(MIN_ROWS, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim),
        PAGE=k_cache.shape[1], TILE_N=tile_n, NUM_SEGMENTS=num_segments, DOT_PRECISION=precision,
        QUANTIZED=quantized, ALIGNED=tile_n % k_cache.shape[1] == 0, STAGE_V=quantized and converts_e4m3,
    )
    # fmt: on
    return SegmentLaunch(args, constexprs, options)


def _launch_reduce(scratch: DecodeScratch, out: torch.Tensor, num_segments: int) -> None:
    num_seqs, num_heads, head_dim = out.shape
    po, pl = scratch.partial_out, scratch.partial_lse
    # fmt: off
    _reduce_segments_kernel[(num_seqs, num_heads)](
        po, pl, out,
        po.stride(0), po.stride(1), po.stride(2),
        pl.stride(0), pl.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim), NUM_SEGMENTS=num_segments,
    )
    # fmt: on


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))
