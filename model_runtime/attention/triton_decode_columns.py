"""The split-KV decode kernel with its tiles turned: tokens along the dots' rows, query heads along their columns.

attention.triton_decode packs a KV head's query-head group into the rows (M) of `q @ k^T` and `p @ v`; a
tensor-core dot (mma m16n8k16) takes 16 rows, so a group of 4 (Llama-3-8B) pads to 16 and three quarters of
every dot and of the softmax's elementwise work are padding. Here the same sums run transposed:

    s^T [TILE_N, G] = k [TILE_N, D] @ q^T [D, G]          (tokens are the rows: 16 a mma, all real)
    o^T [D, G]     += v^T [D, TILE_N] @ p^T [TILE_N, G]    (head dims are the rows)

so the group is the dots' N, which the mma pads only to 8, and the softmax runs on G columns instead of 16
rows. Per cached byte this halves the tensor-core work and quarters the exponentials. It matters where the
bytes per token are few: an FP8 cache reads half the bytes of a 16-bit one for the same dots, and its kernel
in row form reached 44-57% of its bytes' roofline on an H200 while the 16-bit kernel reached 86-103%
(docs/performance.md, FP8 section). Compiled for sm_90 (Triton 3.7), the row form's FP8 loop issues 64 mma and
128 single-byte shared-memory loads per thread and tile (the e4m3 V tile is gathered byte by byte into the
B operand's token pairs); this form issues 32 mma and no byte loads (V is converted to float16 first and
transposed by ldmatrix).

Everything else (pages, segments, FP8 scales folded into the score columns and the probabilities,
V_SCALE_LIFT, the partial outputs and the reduce) is as in triton_decode, whose docstring describes it; the
launch there picks this kernel when DecodeTuning says so, with the same arguments.
"""

from __future__ import annotations

import triton
import triton.language as tl

from model_runtime.attention.decode_plan import V_SCALE_LIFT
from model_runtime.attention.triton_scales import block_ids, scales_ahead

# The query-head group is padded to a power of two of at least this many columns (the mma pads N to 8 anyway;
# 4 keeps the softmax at a group of 4 exact).
MIN_COLUMNS = 4


# fmt: off
@triton.jit(do_not_specialize=["stride_bt"])
def _decode_columns_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, part_out_ptr, part_lse_ptr, out_ptr,
    k_scale_ptr, v_scale_ptr, scale_log2,
    stride_qt, stride_qh, stride_kn, stride_kb, stride_kh, stride_vn, stride_vb, stride_vh,
    stride_sn, stride_sb, stride_sh, stride_bt,
    stride_ps, stride_ph, stride_pg, stride_ls, stride_lh, stride_ot, stride_oh,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, TILE_N: tl.constexpr, NUM_SEGMENTS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    QUANTIZED: tl.constexpr, ALIGNED: tl.constexpr,
):
    # fmt: on
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seg = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)

    cols = tl.arange(0, BLOCK_M)  # the group's query heads, as columns
    heads = kv_head * GROUP + cols
    col_ok = cols < GROUP
    d = tl.arange(0, BLOCK_D)
    out_mask = (d < HEAD_DIM)[:, None] & col_ok[None, :]
    q_t = tl.load(q_ptr + seq * stride_qt + heads[None, :] * stride_qh + d[:, None], mask=out_mask, other=0.0)
    if QUANTIZED:
        q_t = q_t.to(tl.float16)  # and k, p, v follow its dtype below (see triton_decode)

    per_seg = tl.cdiv(tl.cdiv(seq_len, NUM_SEGMENTS), TILE_N) * TILE_N
    start = seg * per_seg
    end = tl.minimum(start + per_seg, seq_len)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_t = tl.zeros([BLOCK_D, BLOCK_M], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_mask = (d < HEAD_DIM)[None, :]
    in_page = tl.arange(0, TILE_N) % PAGE
    if QUANTIZED:  # scales run one tile ahead of their use, their pages two (triton_scales)
        first = start + tl.arange(0, TILE_N)
        k_scale_next, v_scale_next, blocks_after = scales_ahead(
            k_scale_ptr, v_scale_ptr, bt_row, block_ids(bt_row, first, end, PAGE), first, end, kv_head,
            stride_sn, stride_sb, stride_sh, PAGE, TILE_N,
        )  # fmt: skip
    for t0 in range(start, end, TILE_N):
        tok = t0 + tl.arange(0, TILE_N)
        tok_ok = tok < end
        if QUANTIZED:
            k_scale, v_scale = k_scale_next, v_scale_next
            k_scale_next, v_scale_next, blocks_after = scales_ahead(
                k_scale_ptr, v_scale_ptr, bt_row, blocks_after, tok + TILE_N, end, kv_head,
                stride_sn, stride_sb, stride_sh, PAGE, TILE_N,
            )  # fmt: skip
        block = tl.load(bt_row + tok // PAGE, mask=tok_ok, other=0).to(tl.int64)
        if not ALIGNED:  # a tile that starts inside a page
            in_page = tok % PAGE
        # Rows past `end` read the null block (zeros), as in triton_decode; their scores are masked below.
        k_rows = (block * stride_kn + in_page * stride_kb + kv_head * stride_kh)[:, None] + d[None, :]
        k = tl.load(k_cache_ptr + k_rows, mask=kv_mask, other=0.0)
        s_t = tl.dot(k.to(q_t.dtype), q_t, input_precision=DOT_PRECISION) * scale_log2  # [TILE_N, BLOCK_M]
        if QUANTIZED:
            s_t = s_t * k_scale.to(tl.float32)[:, None]
        s_t = tl.where(tok_ok[:, None], s_t, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s_t, 0))
        p_t = tl.exp2(s_t - m_new[None, :])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p_t, 0)
        v_rows = (block * stride_vn + in_page * stride_vb + kv_head * stride_vh)[:, None] + d[None, :]
        v = tl.load(v_cache_ptr + v_rows, mask=kv_mask, other=0.0)
        if QUANTIZED:
            p_t = p_t * (v_scale.to(tl.float32) * V_SCALE_LIFT)[:, None]
        pv = tl.dot(tl.trans(v.to(q_t.dtype)), p_t.to(q_t.dtype), input_precision=DOT_PRECISION)
        acc_t = acc_t * alpha[None, :] + pv
        m_i = m_new

    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    o_t = acc_t / l_safe[None, :]  # all zeros for an empty segment or a padded sequence
    if QUANTIZED:
        o_t = o_t * (1.0 / V_SCALE_LIFT)
    if NUM_SEGMENTS == 1:
        out_ptrs = out_ptr + seq * stride_ot + heads[None, :] * stride_oh + d[:, None]
        tl.store(out_ptrs, o_t.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        lse = tl.where(has_keys, m_i + tl.log2(l_safe), float("-inf"))
        part_ptrs = part_out_ptr + seq * stride_ps + heads[None, :] * stride_ph + seg * stride_pg + d[:, None]
        tl.store(part_ptrs, o_t, mask=out_mask)
        tl.store(part_lse_ptr + seq * stride_ls + heads * stride_lh + seg, lse, mask=col_ok)
