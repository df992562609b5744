"""The FP8 cache's scales in the decode kernels' loops, read ahead of their use.

Both decode kernels (triton_decode, triton_decode_columns) multiply a tile's scores by its tokens' K scales
and its probabilities by their V scales. Triton's software pipeliner copies the K and V tiles ahead into shared
memory (they feed dots), but leaves loads that feed only elementwise arithmetic in place: the scales were read
inside the iteration that needed them, behind the block ids they are addressed by, so every tile waited out a
memory latency or two that a 16-bit cache (no scales) never waits for. Here the loop carries them instead: a
tile's scales are requested one iteration before it, their block ids two.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def block_ids(bt_row, tok, end, PAGE: tl.constexpr):
    """The pages of tokens `tok` (block 0, the null block, for tokens at or past `end`)."""
    return tl.load(bt_row + tok // PAGE, mask=tok < end, other=0).to(tl.int64)


@triton.jit
def token_scales(scale_ptr, blocks, tok, end, kv_head, stride_sn, stride_sb, stride_sh, PAGE: tl.constexpr):
    """One scale page's values for tokens `tok` of one KV head, 0 at or past `end`."""
    at = blocks * stride_sn + (tok % PAGE) * stride_sb + kv_head * stride_sh
    return tl.load(scale_ptr + at, mask=tok < end, other=0.0)


@triton.jit
def scales_ahead(
    k_scale_ptr, v_scale_ptr, bt_row, blocks, tok, end, kv_head, stride_sn, stride_sb, stride_sh,
    PAGE: tl.constexpr, TILE_N: tl.constexpr,
):  # fmt: skip
    """K and V scales of tokens `tok` (on pages `blocks`), and the pages of the tile after them."""
    k_scale = token_scales(k_scale_ptr, blocks, tok, end, kv_head, stride_sn, stride_sb, stride_sh, PAGE)
    v_scale = token_scales(v_scale_ptr, blocks, tok, end, kv_head, stride_sn, stride_sb, stride_sh, PAGE)
    return k_scale, v_scale, block_ids(bt_row, tok + TILE_N, end, PAGE)
