"""The FP8 KV cache on a CUDA GPU: the Triton store's rounding and saturation against the torch store (byte for
byte), the decode kernel and a mixed step against the torch reference reading the same codes, and an engine
whose decode steps run in CUDA graphs producing the tokens its eager twin produces.

The CPU interpreter cannot check the store's rounding (tests/unit/test_triton_interpret.py says why); this can.
"""

from __future__ import annotations

import pytest
import torch

from model_runtime.attention.base import store_kv
from model_runtime.attention.torch_ref import TorchAttention, paged_attention_ref
from model_runtime.config import CacheConfig
from model_runtime.engine import Engine
from model_runtime.kv_quant import quantize_kv
from tests.gpu.graphs_vs_eager import graphs_and_eager_tokens
from tests.gpu.test_attention_gpu import TOL, make_meta, paged_inputs, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _scales(seed: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.exp2(torch.randint(-4, 2, (2, kv_heads, head_dim), generator=gen).float()).cuda()


def _fp8(kc: torch.Tensor, vc: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_kv(kc, scales[0]), quantize_kv(vc, scales[1])


def test_store_rounds_and_saturates_as_the_torch_store() -> None:
    from model_runtime.attention.triton_store import store_kv_triton

    _, k, v, kc, vc, meta = paged_inputs(0, [40, 0, 9], [40, 1, 9], 8, 4, 128, 16, torch.bfloat16)
    scales = _scales(0, 8, 128)
    kc, vc = _fp8(kc, vc, scales)
    k, v = k * 64, v * 64  # many values past 448 * scale: they saturate
    ref_k, ref_v = kc.clone(), vc.clone()
    store_kv(k, v, ref_k, ref_v, meta.slot_mapping, scales)
    store_kv_triton(k, v, kc, vc, meta.slot_mapping, scales)
    assert torch.equal(kc.view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), ref_v.view(torch.uint8))
    assert not kc.float().isnan().any() and kc.float().abs().max().item() == 448.0


@pytest.mark.parametrize("segments", [1, 8])
def test_decode_reads_codes_times_scales(segments: int) -> None:
    from model_runtime.attention.triton_decode import DecodeWorkspace, decode_attention

    seq_lens = [3000, 0, 17, 1200]
    q, _, _, kc, vc, meta = paged_inputs(3, seq_lens, [1] * 4, 8, 4, 128, 16, torch.bfloat16)
    scales = _scales(3, 8, 128)
    kc, vc = _fp8(kc, vc, scales)
    out = torch.full_like(q, float("nan"))
    decode_attention(
        q, kc, vc, meta.block_tables, meta.seq_lens, 0.088, out, DecodeWorkspace(), segments, kv_scale=scales
    )
    safe = make_meta([max(1, s) for s in seq_lens], [1] * 4, meta.block_tables, meta.slot_mapping)
    ref = paged_attention_ref(q.float(), kc, vc, safe, 0.088, scales)
    live = torch.tensor([s > 0 for s in seq_lens], device="cuda")
    assert not out.isnan().any() and bool((out[~live] == 0).all())
    assert rel_err(out[live], ref[live]) < TOL[torch.bfloat16]


def test_a_mixed_step_over_cached_prefixes_matches_the_reference() -> None:
    """Chunks over cached prefixes (their context gathered from the FP8 cache) and decode tokens in one step.
    (A fresh prompt's Triton prefill attends to its own unquantized rows, the torch reference to the cache.)"""
    seq_lens, query_lens = [700, 129, 5000, 0, 64], [64, 1, 1, 0, 17]
    q, k, v, kc, vc, meta = paged_inputs(11, seq_lens, query_lens, 8, 4, 128, 16, torch.bfloat16)
    scales = _scales(11, 8, 128)
    kc, vc = _fp8(kc, vc, scales)
    from model_runtime.attention.triton_backend import TritonAttention

    ref_kc, ref_vc = kc.clone(), vc.clone()
    ref = TorchAttention().forward(q.float(), k.float(), v.float(), ref_kc, ref_vc, meta, 0.088, scales)
    out = TritonAttention().forward(q, k, v, kc, vc, meta, 0.088, scales)
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL[torch.bfloat16]


def test_an_fp8_cache_engine_decodes_the_same_in_cuda_graphs_as_eager(tmp_path) -> None:
    def check(engine: Engine) -> None:
        assert engine.runner.kv_cache.dtype == torch.float8_e4m3fn

    graphs, eager = graphs_and_eager_tokens(
        tmp_path, CacheConfig(num_blocks=512, dtype="fp8_e4m3"), "none", check
    )
    assert graphs == eager
