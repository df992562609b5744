"""The FP8-cache decode kernel that reads codes two at a time and converts them with integer operations.

The float16-dot FP8 kernel (triton_decode, DecodeTuning.fp8_decode "convert") loads a tile of e4m3 codes and
has Triton convert each to float16 before the dots. It runs at about half of the HBM roofline, while the same
kernel reading the same bytes as float16 pairs (bench/attention.py's fp8raw ablation: no conversion) runs at
94%: the per-element conversion and the byte tiles' placement for the dots cost the time, not the reads.

This kernel reads the cache as it is, one 16-bit word per two adjacent channels of a row, so its loads and the
dot operands they feed are the 16-bit kernel's. Each word becomes two float16 values by placing bits
(little-endian, so channel 2j is the low byte of word j and channel 2j+1 the high one):

    e4m3 code  s eeee mmm                 (bias 7)
    float16    s 0eeee mmm0000000         (bias 15)  = code / 2^8, exactly, subnormal codes included

An arithmetic right shift by one moves the high byte's sign, exponent and mantissa into place (the sign copies
into bit 14, cleared by the mask with the low byte's bits); the low byte is shifted up by eight first. Two shifts
and one mask a value, no conversion instruction. The 2^-8 costs nothing: it folds into each key's scale (scores)
and cancels the probabilities' lift of 2^8 (V_SCALE_LIFT; outputs). (e4m3's NaN code would read as 480; the store
clamps to +-448 and never writes it.)

A query's even and odd channels are dotted with the even and odd halves of each key (q . k = q_even . k_even +
q_odd . k_odd), and the values' halves accumulate into two outputs written back to their interleaved channels.
Everything else (segments, online softmax, per-token scales, graph safety, empty rows) is triton_decode's.
"""

from __future__ import annotations

import triton
import triton.language as tl

# A converted pair value is its code / 2^8 (PAIR_UNIT): float16's exponent bias is 8 above e4m3's.
PAIR_UNIT: tl.constexpr = tl.constexpr(256.0)
# sign | exponent (4 of float16's 5 bits) | e4m3's 3 mantissa bits, as a signed 16-bit value: 0xBF80
SIGN_EXP_MANT: tl.constexpr = tl.constexpr(-16512)
# Probabilities times a value's scale are lifted by 2^8 before their float16 cast, as in triton_decode (its
# V_SCALE_LIFT says why); with values read as code / 2^8 the output needs no correction.
V_SCALE_LIFT: tl.constexpr = tl.constexpr(256.0)


@triton.jit
def _e4m3_pairs(words):
    """int16 words of two e4m3 codes -> (low-byte values, high-byte values) as float16, each code / 2^8."""
    mask = tl.full(words.shape, SIGN_EXP_MANT, tl.int16)
    low = ((words << 8) >> 1) & mask
    high = (words >> 1) & mask
    return low.to(tl.float16, bitcast=True), high.to(tl.float16, bitcast=True)


# fmt: off
@triton.jit(do_not_specialize=["stride_bt"])
def _decode_pairs_kernel(
    q_ptr, k_words_ptr, v_words_ptr, block_tables_ptr, seq_lens_ptr, part_out_ptr, part_lse_ptr, out_ptr,
    k_scale_ptr, v_scale_ptr, scale_log2,
    stride_qt, stride_qh, stride_kn, stride_kb, stride_kh, stride_vn, stride_vb, stride_vh,
    stride_sn, stride_sb, stride_sh, stride_bt,
    stride_ps, stride_ph, stride_pg, stride_ls, stride_lh, stride_ot, stride_oh,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, HALF_D: tl.constexpr, BLOCK_H: tl.constexpr,
    PAGE: tl.constexpr, TILE_N: tl.constexpr, NUM_SEGMENTS: tl.constexpr, ALIGNED: tl.constexpr,
):
    # fmt: on
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seg = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP
    j = tl.arange(0, BLOCK_H)  # word j holds channels 2j and 2j + 1
    j_ok = j < HALF_D
    out_mask = row_ok[:, None] & j_ok[None, :]
    q_even_ptrs = q_ptr + seq * stride_qt + heads[:, None] * stride_qh + 2 * j[None, :]
    q_even = tl.load(q_even_ptrs, mask=out_mask, other=0.0).to(tl.float16)
    q_odd = tl.load(q_even_ptrs + 1, mask=out_mask, other=0.0).to(tl.float16)
    score_scale = scale_log2 * PAIR_UNIT  # keys read as code / 2^8

    per_seg = tl.cdiv(tl.cdiv(seq_len, NUM_SEGMENTS), TILE_N) * TILE_N
    start = seg * per_seg
    end = tl.minimum(start + per_seg, seq_len)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_even = tl.zeros([BLOCK_M, BLOCK_H], tl.float32)
    acc_odd = tl.zeros([BLOCK_M, BLOCK_H], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    word_mask = j_ok[None, :]
    if ALIGNED:
        in_page = tl.arange(0, TILE_N) % PAGE
        k_offs = (in_page * stride_kb + kv_head * stride_kh)[:, None] + j[None, :]
        v_offs = (in_page * stride_vb + kv_head * stride_vh)[:, None] + j[None, :]
    for t0 in range(start, end, TILE_N):
        tok = t0 + tl.arange(0, TILE_N)
        tok_ok = tok < end
        block = tl.load(bt_row + tok // PAGE, mask=tok_ok, other=0).to(tl.int64)
        # Rows past `end` read the null block (block 0), as in triton_decode: in bounds, masked below.
        if ALIGNED:
            kw = tl.load(k_words_ptr + (block * stride_kn)[:, None] + k_offs, mask=word_mask, other=0)
        else:
            k_rows = block * stride_kn + (tok % PAGE) * stride_kb + kv_head * stride_kh
            kw = tl.load(k_words_ptr + k_rows[:, None] + j[None, :], mask=word_mask, other=0)
        k_even, k_odd = _e4m3_pairs(kw)
        s = tl.dot(q_even, tl.trans(k_even)) + tl.dot(q_odd, tl.trans(k_odd))
        scale_at = block * stride_sn + (tok % PAGE) * stride_sb + kv_head * stride_sh
        k_scale = tl.load(k_scale_ptr + scale_at, mask=tok_ok, other=0.0).to(tl.float32)
        s = s * (k_scale * score_scale)[None, :]
        s = tl.where(tok_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if ALIGNED:
            vw = tl.load(v_words_ptr + (block * stride_vn)[:, None] + v_offs, mask=word_mask, other=0)
        else:
            v_rows = block * stride_vn + (tok % PAGE) * stride_vb + kv_head * stride_vh
            vw = tl.load(v_words_ptr + v_rows[:, None] + j[None, :], mask=word_mask, other=0)
        v_even, v_odd = _e4m3_pairs(vw)
        v_scale = tl.load(v_scale_ptr + scale_at, mask=tok_ok, other=0.0).to(tl.float32)
        pv = (p * (v_scale * V_SCALE_LIFT)[None, :]).to(tl.float16)
        acc_even = acc_even * alpha[:, None] + tl.dot(pv, v_even)
        acc_odd = acc_odd * alpha[:, None] + tl.dot(pv, v_odd)
        m_i = m_new

    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    # values read as code / 2^8 and probabilities lifted by V_SCALE_LIFT: one factor undoes both
    norm = (1.0 / l_safe) * (PAIR_UNIT / V_SCALE_LIFT)
    o_even = acc_even * norm[:, None]
    o_odd = acc_odd * norm[:, None]
    if NUM_SEGMENTS == 1:
        out_ptrs = out_ptr + seq * stride_ot + heads[:, None] * stride_oh + 2 * j[None, :]
        tl.store(out_ptrs, o_even.to(out_ptr.dtype.element_ty), mask=out_mask)
        tl.store(out_ptrs + 1, o_odd.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        lse = tl.where(has_keys, m_i + tl.log2(l_safe), float("-inf"))
        part_ptrs = part_out_ptr + seq * stride_ps + heads[:, None] * stride_ph + seg * stride_pg + 2 * j[None, :]
        tl.store(part_ptrs, o_even, mask=out_mask)
        tl.store(part_ptrs + 1, o_odd, mask=out_mask)
        tl.store(part_lse_ptr + seq * stride_ls + heads * stride_lh + seg, lse, mask=row_ok)
