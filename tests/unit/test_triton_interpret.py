"""Triton attention kernels on the CPU through Triton's interpreter (fp32, tiny shapes), against torch_ref.

The kernels run in one child process, this file executed as a script (tests/unit/interpreter.py says why); each
pytest test asserts one of its cases.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests.unit.interpreter import HAVE_TRITON, interpreted_cases, run_cases
from tests.unit.paged_inputs import TOL, compare, fp8_caches, on_grid, paged_case, rel_err, step_meta

pytestmark = pytest.mark.unit

# The FP8-cache decode kernel's dots run in float16 (triton_decode says why): its queries and scaled probabilities
# round to float16's 11-bit significand (2^-11 relative), the rest is exact.
TOL_FP8_DECODE = 2e-3


# --- cases (child side) -------------------------------------------------------------------------------------
def _case_store() -> tuple[bool, str]:
    from model_runtime.attention.base import store_kv
    from model_runtime.attention.triton_store import store_kv_triton

    gen = torch.Generator().manual_seed(0)
    kc, vc = torch.randn(6, 4, 2, 24, generator=gen), torch.randn(6, 4, 2, 24, generator=gen)
    fused = torch.randn(7, 3, 2, 24, generator=gen)  # strided k/v views, as sliced out of a fused qkv output
    k, v = fused[:, 1], fused[:, 2]
    slots = torch.tensor([5, -1, 22, 4, -1, 9, 23], dtype=torch.int64)
    ref_k, ref_v = kc.clone(), vc.clone()
    store_kv(k, v, ref_k, ref_v, slots)
    store_kv_triton(k, v, kc, vc, slots)
    ok = torch.equal(kc, ref_k) and torch.equal(vc, ref_v)
    return ok, f"caches equal: {ok}"


def _case_store_fp8() -> tuple[bool, str]:
    """The Triton store computes each row's scale (bf16 of max / 448) and codes as kv_quant does: byte for byte
    what the torch store writes, codes and scales. Inputs sit on the FP8 grid: the interpreter's float32 ->
    e4m3 conversion drops the carry when rounding crosses a power of two (31.8 -> 16, not 32), which the GPU's
    conversion instruction does not; rounding itself is checked on the GPU. Rows span 1e-3 .. 1e3 and one is
    all zero (its scale the smallest, its codes zero)."""
    from model_runtime.attention.base import store_kv
    from model_runtime.attention.triton_store import store_kv_triton

    gen = torch.Generator().manual_seed(0)
    kc, vc, scales = fp8_caches(
        torch.randn(6, 4, 2, 24, generator=gen), torch.randn(6, 4, 2, 24, generator=gen)
    )
    magnitude = torch.logspace(-3, 3, 7)[:, None, None, None]
    fused = on_grid(torch.randn(7, 3, 2, 24, generator=gen) * magnitude)
    k, v = fused[:, 1], fused[:, 2]
    k[3, 1] = 0.0
    slots = torch.tensor([5, -1, 22, 4, -1, 9, 23], dtype=torch.int64)
    ref_k, ref_v, ref_scales = kc.clone(), vc.clone(), scales.clone()
    store_kv(k, v, ref_k, ref_v, slots, ref_scales)
    store_kv_triton(k, v, kc, vc, slots, scales)
    same = torch.equal(kc.view(torch.uint8), ref_k.view(torch.uint8)) and torch.equal(
        vc.view(torch.uint8), ref_v.view(torch.uint8)
    )
    same_scales = torch.equal(scales, ref_scales)
    peaks = kc.flatten(0, 1)[slots[slots >= 0]].float().abs().amax(-1)  # [stored rows, H]
    zero_row = peaks[2, 1].item() == 0.0  # k[3] went to slot 4, the third stored row
    peaks[2, 1] = 448.0
    full = bool((peaks == 448.0).all())
    ok = same and same_scales and zero_row and full
    return ok, f"codes byte-equal: {same}, scales equal: {same_scales}, zero row {zero_row}, peaks 448 {full}"


def _case_gather_fp8() -> tuple[bool, str]:
    """The Triton gather of cached rows out of an FP8 cache (attention.triton_gather, what a chunk over a cached
    prefix attends to) against the torch gather and dequantization (base.read_kv by slot), for slots in any
    order, repeated, across blocks and at both ends of one, pages spanning 1e-3 .. 1e3 per row (the scales
    differ by rows and heads). In float32 (the product is exact) bit for bit. In bfloat16 within one unit in
    the last place: the interpreter's float32 -> bfloat16 conversion truncates where the GPU's rounds to
    nearest even, so the bit-for-bit bfloat16 check is the GPU test's
    (tests/gpu/test_fp8_kv_gpu.py::test_triton_gather_of_fp8_rows_is_torchs_bit_for_bit)."""
    from model_runtime.attention.base import read_kv, slot_rows
    from model_runtime.attention.triton_gather import gather_fp8_kv

    gen = torch.Generator().manual_seed(11)
    n, b, h, d = 6, 4, 3, 24
    magnitude = 10.0 ** torch.randint(-3, 4, (n, b, h, 1), generator=gen).float()
    kc, vc, scales = fp8_caches(
        torch.randn(n, b, h, d, generator=gen) * magnitude, torch.randn(n, b, h, d, generator=gen) * magnitude
    )
    slots = torch.tensor([5, 0, 23, 23, 4, 7, 12, 3, 20, 9], dtype=torch.int64)

    def torch_rows(dtype: torch.dtype) -> list[torch.Tensor]:
        return [
            read_kv(p, scales, i, dtype, lambda pages: slot_rows(pages, slots))
            for i, p in enumerate((kc, vc))
        ]

    exact, got32 = torch_rows(torch.float32), gather_fp8_kv(kc, vc, scales, slots, torch.float32)
    same32 = all(torch.equal(g, w) and g.shape == w.shape for g, w in zip(got32, exact))
    got16 = gather_fp8_kv(kc, vc, scales, slots, torch.bfloat16)
    ulp = [2.0 ** (torch.floor(torch.log2(w.abs().clamp(min=1e-30))) - 7) for w in exact]
    near16 = all(bool(((g.float() - w).abs() <= u).all()) for g, w, u in zip(got16, exact, ulp))
    ok = same32 and near16 and got16[0].dtype == torch.bfloat16 and bool(exact[0].abs().max() > 100)
    return ok, f"float32 equal {same32}, bfloat16 within one ulp {near16}"


def _case_quantize_rows() -> tuple[bool, str]:
    """The FP8 activation kernel (quantization.act_quant) against the torch ops it replaces: each row's scale is
    its max / 448, codes byte-equal, a zero row all zero. Rows of 2500 (three iterations of the kernel's block,
    the last one masked). On the grid for the interpreter's rounding, as above: each row is e4m3 codes times a
    power of two with one code at +-448, so its scale is that power of two and nothing rounds."""
    from model_runtime.quantization.act_quant import quantize_rows
    from model_runtime.quantization.fp8 import quantize_rows_torch
    from model_runtime.weights.canonical import FP8_DTYPE

    gen = torch.Generator().manual_seed(3)
    codes = (torch.randn(5, 2500, generator=gen) * 60).clamp(-448, 448).to(FP8_DTYPE).float()
    codes[torch.arange(5), torch.randint(0, 2500, (5,), generator=gen)] = torch.tensor(
        [448.0, -448, 448, -448, 448]
    )
    x = codes * torch.exp2(torch.tensor([-9.0, -3, 0, 2, 5]))[:, None]
    x[3] = 0.0
    got, want = quantize_rows(x), quantize_rows_torch(x)
    same_codes = torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    same_scales = torch.equal(got[1], want[1]) and got[1].shape == (5, 1)
    zero_row = bool((got[0][3].float() == 0).all())
    ok = same_codes and same_scales and zero_row
    return ok, f"codes byte-equal {same_codes}, scales equal {same_scales}: {got[1].flatten().tolist()}"


def _decode_case(
    seed: int,
    seq_lens: list[int],
    group: int,
    block_size: int,
    head_dim: int = 32,
    segments: int = 4,
    tile_n: int = 16,
    fp8: bool = False,
) -> Callable[[], tuple[bool, str]]:
    def run() -> tuple[bool, str]:
        from model_runtime.attention.decode_plan import DecodeTuning, DecodeWorkspace
        from model_runtime.attention.torch_ref import paged_attention_ref
        from model_runtime.attention.triton_decode import decode_attention

        q, _, _, kc, vc, meta = paged_case(
            seed, seq_lens, [1] * len(seq_lens), 2, group, head_dim, block_size
        )
        scales = None
        if fp8:  # an FP8 cache: codes plus a scale per token and head, read back as code * scale
            kc, vc, scales = fp8_caches(kc, vc)
        out = torch.full_like(q, float("nan"))
        decode_attention(
            q,
            kc,
            vc,
            meta.block_tables,
            meta.seq_lens,
            0.3,
            out,
            DecodeWorkspace(),
            segments,
            DecodeTuning(tile_n=tile_n, fp8_tile_n=tile_n),
            scales,
        )
        live = [s > 0 for s in seq_lens]
        safe = step_meta(
            [max(1, s) for s in seq_lens], [1] * len(seq_lens), meta.block_tables, [0] * len(seq_lens)
        )
        tol = TOL_FP8_DECODE if fp8 else TOL
        return compare(out, paged_attention_ref(q, kc, vc, safe, 0.3, scales), live, tol)

    return run


def _backend_case(
    seq_lens: list[int],
    query_lens: list[int],
    fp8: bool = False,
    segments: int | None = None,
    gather_decodes: bool = False,
    chunk_kernel: bool = True,
) -> Callable[[], tuple[bool, str]]:
    """TritonAttention.forward (store + dispatch) against TorchAttention.forward on the same inputs. With an
    FP8 cache the Triton prefill of a fresh prompt attends to its own unquantized rows where the torch
    reference reads them back from the cache: only cases where every chunk reads the cache compare there.
    `segments`: the decode kernel's split (None: the backend's choice for the interpreter's 8 SMs,
    triton_backend.FALLBACK_SM_COUNT: 8-16 segments for these few sequences, most of them empty; the cases
    about the prefill groups fix 4). `gather_decodes`: the plan puts the decode rows in the cached group (the
    case fails if it did not). `chunk_kernel`: a cached group runs the split-KV chunk kernel (the default) or
    is gathered for the per-chunk reference path (device.chunk_attention_tokens 0)."""

    def run() -> tuple[bool, str]:
        from model_runtime.attention.select import make_attention_backend
        from model_runtime.attention.torch_ref import TorchAttention
        from model_runtime.attention.triton_backend import TritonAttention

        gather = 8192 if gather_decodes else 0
        q, k, v, kc, vc, meta = paged_case(7, seq_lens, query_lens, 2, 2, 32, 4, gather)
        if gather_decodes and (meta.mixed is None or meta.mixed.decode_rows is not None):
            return False, "the plan left decode rows to the decode kernel"
        scales = ref_scales = None
        if fp8:  # new rows on the FP8 grid: see _case_store_fp8 on the interpreter's rounding
            kc, vc, scales = fp8_caches(kc, vc)
            k, v = on_grid(k), on_grid(v)
            ref_scales = scales.clone()
        backend = make_attention_backend("triton", "cpu")
        if segments is not None:
            backend = TritonAttention(num_segments=segments)
        if not chunk_kernel:
            backend.chunk_attention_tokens = 0
        ref_kc, ref_vc = kc.clone(), vc.clone()
        ref = TorchAttention().forward(q, k, v, ref_kc, ref_vc, meta, 0.25, ref_scales)
        out = backend.forward(q, k, v, kc, vc, meta, 0.25, scales)
        live = [s > 0 for s, n in zip(seq_lens, query_lens) for _ in range(n)]
        ok, detail = compare(out, torch.nan_to_num(ref), live, TOL_FP8_DECODE if fp8 else TOL)
        caches = (
            torch.equal(kc.view(torch.uint8), ref_kc.view(torch.uint8))
            and torch.equal(vc.view(torch.uint8), ref_vc.view(torch.uint8))
            and (scales is None or torch.equal(scales, ref_scales))
        )
        cached = meta.mixed.cached if meta.mixed is not None else None
        used = cached is not None and cached.chunk_work is not None
        wanted = cached is not None and max(cached.query_lens) > 1 and chunk_kernel
        return ok and caches and used == wanted, f"{detail} caches_equal={caches} chunk_kernel_used={used}"

    return run


def _chunk_case(
    seed: int,
    seq_lens: list[int],
    query_lens: list[int],
    kv_heads: int,
    group: int,
    block_size: int,
    sms: int,
    fp8: bool = False,
) -> Callable[[], tuple[bool, str]]:
    """The split-KV chunk kernel alone (attention.triton_chunk) on the cached group of a step whose decode rows
    join it, against the reference; `sms` sizes the split (1: one item per tile, no merge; more: the keys of
    a tile cut into slices of one tile, merged), and the case fails unless the plan split as asked. `fp8`: the
    pages as an FP8 cache, read in place (codes and scales) as the reference reads them."""

    def run() -> tuple[bool, str]:
        from model_runtime.attention.torch_ref import paged_attention_ref
        from model_runtime.attention.triton_chunk import TILE_N, ChunkWork, chunk_attention, plan_chunk_work

        q, _, _, kc, vc, meta = paged_case(seed, seq_lens, query_lens, kv_heads, group, 32, block_size, 8192)
        cached = meta.mixed.cached if meta.mixed is not None else None
        if cached is None or cached.context_slots is None:
            return False, "the step has no cached group"
        scales = None
        if fp8:
            kc, vc, scales = fp8_caches(kc, vc)
        ref = cached.rows.take(paged_attention_ref(q, kc, vc, meta, 0.25, scales))
        host = plan_chunk_work(cached.cu_q.numpy(), cached.cu_k.numpy(), group, kv_heads, sms)
        work = ChunkWork.on(host, q.shape[1], q.shape[2], torch.device("cpu"))
        out = chunk_attention(cached.rows.take(q), kc, vc, cached.context_slots, work, 0.25, scales)
        split_as_asked = work.split == (sms > 1) and (sms == 1 or host.split_keys == TILE_N)
        err = rel_err(out, ref)
        detail = (
            f"rel_err={err:.2e} items={host.items.shape[0]} split={work.split} split_keys={host.split_keys}"
        )
        tol = TOL_FP8_DECODE if fp8 else TOL
        return err < tol and split_as_asked and not bool(out.isnan().any()), detail

    return run


CASES: dict[str, Callable[[], tuple[bool, str]]] = {
    "store_skips_padding_slots": _case_store,
    "decode_b1_gqa1_block4": _decode_case(1, [13], 1, 4),
    "decode_b3_gqa2_block8": _decode_case(2, [1, 8, 29], 2, 8),
    "decode_b6_gqa4_block16_padded": _decode_case(3, [17, 0, 5, 40, 0, 33], 4, 16),
    "decode_many_segments": _decode_case(4, [300, 2], 2, 4, segments=16),
    "decode_one_segment_direct_write": _decode_case(5, [23, 0, 70], 4, 8, segments=1),
    "decode_head_dim_40_tile_32": _decode_case(6, [45, 9], 2, 16, head_dim=40, tile_n=32),
    "decode_pages_longer_than_tiles": _decode_case(7, [45, 9, 0], 2, 32, tile_n=16),  # tiles not page-aligned
    "decode_fp8_pages_longer_than_tiles": _decode_case(8, [45, 9], 2, 32, tile_n=16, fp8=True),
    "backend_decode_only_with_padding": _backend_case([9, 0, 21], [1, 1, 1]),
    "backend_mixed_prefill_prefix_decode": _backend_case([5, 11, 9, 0], [5, 4, 1, 0], segments=4),
    "backend_packed_prompts_no_prefix": _backend_case([7, 3, 12], [7, 3, 12]),
    "backend_packed_chunks_with_prefixes": _backend_case([20, 6, 33], [4, 6, 2]),
    # fresh, decode, over a prefix, decode, fresh: no group's rows are one slice (indexed reads and writes)
    "backend_groups_interleaved_with_decodes": _backend_case([6, 9, 20, 13, 3], [6, 1, 5, 1, 3], segments=4),
    "store_fp8_quantizes_per_token_head": _case_store_fp8,
    "decode_fp8_b3_gqa2_block8": _decode_case(2, [1, 8, 29], 2, 8, fp8=True),
    "decode_fp8_one_segment_padded": _decode_case(5, [23, 0, 70], 4, 8, segments=1, fp8=True),
    # many tiles a segment and segments starting mid-context: the scales read a tile ahead, their pages two
    "decode_fp8_many_segments": _decode_case(4, [300, 2, 97], 2, 4, segments=4, fp8=True),
    "backend_fp8_decode_only": _backend_case([9, 0, 21], [1, 1, 1], fp8=True),
    "backend_fp8_chunks_with_prefixes": _backend_case([20, 6, 33], [4, 6, 2], fp8=True),
    # decodes first, then a chunk over a prefix, then a fresh prompt (the scheduler's order): slices
    "backend_fp8_decode_prefix_fresh": _backend_case([9, 21, 20, 7], [1, 1, 4, 7], fp8=True, segments=4),
    # a mixed step's decode rows attended with its chunks over gathered contexts (device.decode_gather_tokens)
    "backend_decodes_gathered_with_chunks": _backend_case(
        [9, 29, 7, 20, 40, 0], [1, 5, 7, 1, 3, 1], gather_decodes=True
    ),
    # the split-KV chunk kernel: one item per tile, then tiles cut into one-tile slices and merged; GQA 1-4
    # (3: a tile's rows are not a power of two), pages shorter and longer than a tile, decode rows in the group
    "chunk_kernel_one_item_per_tile": _chunk_case(11, [100, 9, 70], [37, 1, 20], 2, 4, 16, sms=1),
    "chunk_kernel_split_and_merged": _chunk_case(11, [100, 9, 70], [17, 1, 20], 1, 4, 16, sms=10_000),
    "chunk_kernel_gqa3_pages_of_4": _chunk_case(12, [150, 2], [45, 1], 1, 3, 4, sms=10_000),
    "chunk_kernel_gqa1_pages_of_128": _chunk_case(13, [200, 90], [20, 90], 2, 1, 128, sms=10_000),
    # an FP8 cache read in place: scales a tile ahead of their keys, their slots two; many tiles a slice (sms=1)
    "chunk_kernel_fp8_one_item_per_tile": _chunk_case(15, [300, 2], [45, 1], 1, 3, 4, sms=1, fp8=True),
    "chunk_kernel_fp8_split_and_merged": _chunk_case(
        14, [100, 9, 70], [17, 1, 20], 2, 4, 16, 10_000, fp8=True
    ),
    "backend_chunks_with_prefixes_gathered": _backend_case([20, 6, 33], [4, 6, 2], chunk_kernel=False),
    # decodes gathered beside a fresh prompt alone: their group has no chunk, and keeps the gathered call
    "backend_decodes_gathered_beside_a_fresh_prompt": _backend_case(
        [9, 29, 7], [1, 1, 7], gather_decodes=True
    ),
    "backend_fp8_decodes_gathered_with_chunks": _backend_case(
        [9, 21, 20], [1, 1, 4], fp8=True, gather_decodes=True
    ),
    "fp8_activation_rows_quantize_as_torch": _case_quantize_rows,
    "fp8_cache_rows_gather_as_torch": _case_gather_fp8,
}


# --- pytest side --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict[str, object]]:
    return interpreted_cases(__file__)


@pytest.mark.parametrize("case", list(CASES))
def test_triton_kernel_matches_reference(interpreted: dict[str, dict[str, object]], case: str) -> None:
    result = interpreted[case]
    assert result["ok"], f"{case}: {result['detail']}"


def test_select_backend_by_device(monkeypatch: pytest.MonkeyPatch) -> None:
    from model_runtime.attention.select import make_attention_backend

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert make_attention_backend("auto", "cpu").name == "torch"
    assert make_attention_backend("torch", "cuda").name == "torch"
    with pytest.raises(ValueError, match="flash"):
        make_attention_backend("flash", "cpu")
    if HAVE_TRITON:
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            make_attention_backend("triton", "cpu")


if __name__ == "__main__":
    run_cases(CASES)
