"""The FP8 KV cache on a CUDA GPU: the Triton store's codes and per-row scales against the torch store (byte for
byte), the decode kernel and a mixed step against the torch reference reading the same codes and scales, and an
engine whose decode steps run in CUDA graphs producing the tokens its eager twin produces.

The CPU interpreter cannot check the store's rounding (tests/unit/test_triton_interpret.py says why); this can.
"""

from __future__ import annotations

import pytest
import torch

from model_runtime.attention.base import store_kv
from model_runtime.attention.torch_ref import TorchAttention, paged_attention_ref
from model_runtime.config import CacheConfig
from model_runtime.engine import Engine
from model_runtime.kv_quant import fp8_pages
from tests.gpu.graphs_vs_eager import graphs_and_eager_tokens
from tests.gpu.test_attention_gpu import TOL, paged_inputs, rel_err
from tests.unit.paged_inputs import step_meta

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_store_writes_the_codes_and_scales_of_the_torch_store() -> None:
    """Rows of every magnitude (1e-4 .. 1e4, one all zero), not on the FP8 grid: the kernel's rounding, scale
    and clamping are the torch store's, byte for byte, and every written row reaches 448 in its largest code."""
    from model_runtime.attention.triton_store import store_kv_triton

    _, k, v, kc, vc, meta = paged_inputs(0, [40, 0, 9], [40, 1, 9], 8, 4, 128, 16, torch.bfloat16)
    kc, vc, scales = fp8_pages(kc, vc)
    magnitude = torch.logspace(-4, 4, k.shape[0], device="cuda", dtype=torch.float32)[:, None, None]
    k, v = (k.float() * magnitude).to(torch.bfloat16), (v.float() * magnitude.flip(0)).to(torch.bfloat16)
    k[3, 2] = 0.0
    ref_k, ref_v, ref_scales = kc.clone(), vc.clone(), scales.clone()
    store_kv(k, v, ref_k, ref_v, meta.slot_mapping, ref_scales)
    store_kv_triton(k, v, kc, vc, meta.slot_mapping, scales)
    assert torch.equal(kc.view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), ref_v.view(torch.uint8))
    assert torch.equal(scales, ref_scales)
    slots = meta.slot_mapping[meta.slot_mapping >= 0]
    peaks = vc.flatten(0, 1)[slots].float().abs().amax(-1)
    assert not kc.float().isnan().any() and bool((peaks == 448.0).all())


def test_triton_gather_of_fp8_rows_is_torchs_bit_for_bit() -> None:
    """The gather a chunk over a cached prefix attends to (attention.triton_gather): cached rows of every
    magnitude, by slots in any order and repeated, dequantized into bfloat16 exactly as the torch gather
    (base.read_kv by slot) rounds them, on the Llama-3-8B head shape."""
    from model_runtime.attention.base import read_kv, slot_rows
    from model_runtime.attention.triton_gather import gather_fp8_kv

    gen = torch.Generator(device="cuda").manual_seed(3)
    n, b, h, d = 40, 16, 8, 128
    magnitude = torch.logspace(-4, 4, n * b, device="cuda").view(n, b, 1, 1)
    pages = [torch.randn(n, b, h, d, device="cuda", generator=gen) * magnitude for _ in range(2)]
    kc, vc, scales = fp8_pages(pages[0].to(torch.bfloat16), pages[1].to(torch.bfloat16))
    slots = torch.randint(0, n * b, (3000,), device="cuda", generator=gen)
    got = gather_fp8_kv(kc, vc, scales, slots, torch.bfloat16)
    for i, (cache, rows) in enumerate(zip((kc, vc), got)):
        want = read_kv(cache, scales, i, torch.bfloat16, lambda p: slot_rows(p, slots))
        assert rows.dtype == torch.bfloat16 and torch.equal(rows.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("max_registers", [168, None], ids=["regs168", "regs-free"])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("segments", [1, 8])
@pytest.mark.parametrize("v_magnitude", [1.0, 1e-3])
def test_decode_reads_codes_times_scales(
    segments: int, v_magnitude: float, group: int, max_registers: int | None
) -> None:
    """Against the reference reading the same codes, with the register cap and without; values of 1e-3 (scales
    near 2e-6) check that the scaled probabilities stay clear of float16's subnormals
    (triton_decode.V_SCALE_LIFT)."""
    from model_runtime.attention.decode_plan import DecodeTuning, DecodeWorkspace
    from model_runtime.attention.triton_decode import decode_attention

    seq_lens = [3000, 0, 17, 1200]
    q, _, _, kc, vc, meta = paged_inputs(3, seq_lens, [1] * 4, 8, group, 128, 16, torch.bfloat16)
    kc, vc, scales = fp8_pages(kc, vc * v_magnitude)
    out = torch.full_like(q, float("nan"))
    decode_attention(
        q, kc, vc, meta.block_tables, meta.seq_lens, 0.088, out, DecodeWorkspace(), segments,
        DecodeTuning(fp8_max_registers=max_registers), kv_scale=scales,
    )  # fmt: skip
    safe = step_meta([max(1, s) for s in seq_lens], [1] * 4, meta.block_tables, meta.slot_mapping)
    ref = paged_attention_ref(q.float(), kc, vc, safe, 0.088, scales)
    live = torch.tensor([s > 0 for s in seq_lens], device="cuda")
    assert not out.isnan().any() and bool((out[~live] == 0).all())
    assert rel_err(out[live], ref[live]) < TOL[torch.bfloat16]


def test_a_mixed_step_over_cached_prefixes_matches_the_reference() -> None:
    """Chunks over cached prefixes (their context gathered from the FP8 cache) and decode tokens in one step.
    (A fresh prompt's Triton prefill attends to its own unquantized rows, the torch reference to the cache: the
    test below puts the rows on the FP8 grid for that.)"""
    _fp8_step_matches_the_reference(11, [700, 129, 5000, 0, 64], [64, 1, 1, 0, 17])


def _fp8_step_matches_the_reference(
    seed: int, seq_lens: list[int], query_lens: list[int], decode_gather_tokens: int = 0
) -> None:
    """One step's Triton attention over an FP8 cache against the torch reference reading the same codes and
    scales; every chunk reads its keys from the cache (no fresh prompt: see the test below for those)."""
    from model_runtime.attention.triton_backend import TritonAttention

    q, k, v, kc, vc, meta = paged_inputs(
        seed, seq_lens, query_lens, 8, 4, 128, 16, torch.bfloat16, decode_gather_tokens
    )
    if decode_gather_tokens:
        assert meta.mixed is not None and meta.mixed.decode_rows is None, "the decodes were gathered"
    kc, vc, scales = fp8_pages(kc, vc)
    ref_kc, ref_vc, ref_scales = kc.clone(), vc.clone(), scales.clone()
    ref = TorchAttention().forward(q.float(), k.float(), v.float(), ref_kc, ref_vc, meta, 0.088, ref_scales)
    out = TritonAttention().forward(q, k, v, kc, vc, meta, 0.088, scales)
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL[torch.bfloat16]


def test_an_fp8_cache_engine_decodes_the_same_in_cuda_graphs_as_eager(tmp_path) -> None:
    def check(engine: Engine) -> None:
        runner = engine.runner
        assert runner.kv_pages.dtype == torch.float8_e4m3fn and runner.kv_scales is not None
        assert runner.kv_pages.data_ptr() == runner.kv_cache.data_ptr()

    graphs, eager = graphs_and_eager_tokens(
        tmp_path, CacheConfig(num_blocks=512, dtype="fp8_e4m3"), "none", check
    )
    assert graphs == eager


def test_a_step_with_fresh_prompts_beside_a_cached_chunk_matches_the_reference() -> None:
    """Fresh prompts (their own rows: one long through cuDNN, one short through varlen) in the same step as a
    chunk over a cached prefix (gathered and dequantized) and decode tokens. The new rows are moved onto the
    FP8 grid first, so that the reference, which reads every key back from the cache, reads what the fresh
    prompts' own rows hold: the comparison then checks the grouping, not the quantization."""
    from model_runtime.attention.triton_backend import TritonAttention
    from model_runtime.kv_quant import dequantize_kv, quantize_kv

    seq_lens, query_lens = [700, 129, 2048, 300, 5000], [64, 1, 2048, 300, 1]
    q, k, v, kc, vc, meta = paged_inputs(17, seq_lens, query_lens, 8, 4, 128, 16, torch.bfloat16)
    k, v = (dequantize_kv(*quantize_kv(x), x.dtype) for x in (k, v))
    kc, vc, scales = fp8_pages(kc, vc)
    plan = meta.mixed
    assert (
        plan is not None
        and plan.long_fresh is not None
        and plan.fresh is not None
        and plan.cached is not None
    )
    ref_kc, ref_vc, ref_scales = kc.clone(), vc.clone(), scales.clone()
    ref = TorchAttention().forward(q.float(), k.float(), v.float(), ref_kc, ref_vc, meta, 0.088, ref_scales)
    out = TritonAttention().forward(q, k, v, kc, vc, meta, 0.088, scales)
    assert torch.equal(kc.view(torch.uint8), ref_kc.view(torch.uint8)) and torch.equal(scales, ref_scales)
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL[torch.bfloat16]


def test_decode_rows_gathered_from_the_fp8_cache_match_the_reference() -> None:
    """Decodes beside a chunk over a cached prefix, the decodes attended in the chunk's call over contexts
    gathered and dequantized from the FP8 cache (device.decode_gather_tokens), as the reference reads them."""
    _fp8_step_matches_the_reference(19, [2300, 129, 2048 + 128], [1, 1, 128], decode_gather_tokens=8192)


@pytest.mark.parametrize(
    ("seq_lens", "query_lens"),
    [
        ([2048 + 128, 2300, 129], [128, 1, 1]),
        ([8192 + 64, 700], [64, 1]),
        ([1000 + 100, 5000 + 150], [100, 150]),
    ],
    ids=["128-over-2k", "64-over-8k", "250-rows"],
)
def test_the_chunk_kernel_reads_the_fp8_cache_in_place(seq_lens: list[int], query_lens: list[int]) -> None:
    """A cached group over an FP8 cache through the split-KV chunk kernel (codes and scales read in place,
    device.chunk_attention_tokens) against the reference reading the same codes and scales, and against the
    same step gathered and dequantized for FlashAttention-2."""
    from model_runtime.attention.triton_backend import TritonAttention

    q, k, v, kc, vc, meta = paged_inputs(23, seq_lens, query_lens, 8, 4, 128, 16, torch.bfloat16, 8192)
    gathered_meta = step_meta(seq_lens, query_lens, meta.block_tables, meta.slot_mapping, 16, 8192)
    assert meta.mixed is not None and meta.mixed.cached is not None and meta.mixed.decode_rows is None
    kc, vc, scales = fp8_pages(kc, vc)
    ref_kc, ref_vc, ref_scales = kc.clone(), vc.clone(), scales.clone()
    ref = TorchAttention().forward(q.float(), k.float(), v.float(), ref_kc, ref_vc, meta, 0.088, ref_scales)
    gathered = TritonAttention(chunk_attention_tokens=0).forward(
        q, k, v, kc.clone(), vc.clone(), gathered_meta, 0.088, scales.clone()
    )
    out = TritonAttention().forward(q, k, v, kc, vc, meta, 0.088, scales)
    assert meta.mixed.cached.chunk_work is not None, "the chunk kernel did not run"
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL[torch.bfloat16]
    assert rel_err(out, gathered) < TOL[torch.bfloat16]


def test_an_fp8_cached_group_past_the_fp8_limit_keeps_the_gather() -> None:
    """More rows than config.CHUNK_ATTENTION_FP8_MAX_TOKENS over an FP8 cache: gathered and dequantized for
    FlashAttention-2 (the kernel lost there), still matching the reference."""
    from model_runtime.attention.triton_backend import TritonAttention
    from model_runtime.config import CHUNK_ATTENTION_FP8_MAX_TOKENS

    seq_lens, query_lens = [1000 + 200, 5000 + 300], [200, 300]
    assert sum(query_lens) > CHUNK_ATTENTION_FP8_MAX_TOKENS
    q, k, v, kc, vc, meta = paged_inputs(29, seq_lens, query_lens, 8, 4, 128, 16, torch.bfloat16, 8192)
    kc, vc, scales = fp8_pages(kc, vc)
    ref = TorchAttention().forward(
        q.float(), k.float(), v.float(), kc.clone(), vc.clone(), meta, 0.088, scales
    )
    out = TritonAttention(chunk_attention_tokens=1024).forward(q, k, v, kc, vc, meta, 0.088, scales)
    assert meta.mixed is not None and meta.mixed.cached is not None
    assert meta.mixed.cached.chunk_work is None, "the chunk kernel ran past the FP8 limit"
    assert rel_err(out, ref) < TOL[torch.bfloat16]
