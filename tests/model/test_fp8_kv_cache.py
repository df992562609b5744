"""The FP8 KV cache (cache.dtype fp8_e4m3) on CPU, where the torch attention reads every key and value back from
the cache (code * scale): the scales bound what the layers write, a tiny random model's logits stay near float32,
a tensor-parallel rank derives the scales of its heads that one device derives, and the embedded SmolLM2-135M
stays close to its float32 self in perplexity and greedy choices.

Measured (torch 2.13 CPU, float32 activations, this file's prints): SmolLM2's perplexity on TEXT 23.53 -> 23.89
with the FP8 cache (+1.5%), 24.18 (+2.8%) with FP8 weights as well; next-token agreement with float32 0.956 and
0.902. The issue's goal (within 1% of 16-bit) is not met with these static per-channel power-of-two scales
(the largest code a text writes is 56-112 of 448; under 0.03% of the codes are subnormal). A scale per token and
head would meet it: emulated in bench/diag/fp8_kv_scale_schemes.py, +0.05%.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from model_runtime.config import CacheConfig, DeviceConfig, EngineConfig, ParallelConfig, SchedulerConfig
from model_runtime.engine import Engine
from model_runtime.kv_layout import KVLayout
from model_runtime.kv_quant import FP8_MAX, MARGIN, fp8_kv_scales
from model_runtime.llm import LLM
from model_runtime.parallel.shard import TPShard
from model_runtime.parallel.weights import load_weight_shard
from model_runtime.request import PromptInput, SamplingParams
from model_runtime.runner_setup import build_runner
from model_runtime.startup import StartupProgress
from model_runtime.weights import load_model_config, load_weights, resolve_model
from tests.model import tp_ranks
from tests.model.test_fp8_weights import PROMPTS, TEXT, _choices
from tests.model.tiny_models import write_tiny_hf

pytestmark = pytest.mark.model

TINY_LOGITS_RTOL = 0.10  # of the largest float32 logit
KV_PERPLEXITY_RTOL = 0.025  # measured 1.5%; the goal is 1% (see the module docstring)
BOTH_PERPLEXITY_RTOL = 0.04  # FP8 weights and cache: measured 2.8%
MIN_KV_AGREEMENT = 0.93  # measured 0.956
MIN_BOTH_AGREEMENT = 0.85  # measured 0.902
MAX_NEW = 8


def _config(model: str, kv_dtype: str | None, quantization: str = "none") -> EngineConfig:
    return EngineConfig(
        model=model,
        cache=CacheConfig(
            block_size=tp_ranks.BLOCK_SIZE, num_blocks=256, enable_prefix_caching=False, dtype=kv_dtype
        ),
        scheduler=SchedulerConfig(max_model_len=512),  # the torch attention gathers whole block tables
        device=DeviceConfig(device="cpu", dtype="float32", quantization=quantization),
    )


def test_the_scales_bound_every_key_and_value_a_tiny_model_writes(tmp_path) -> None:
    """Keys (after rotation) and values of a float32 run, read from its cache, stay within 448 * scale /
    MARGIN for every channel: nothing an FP8 cache stores saturates. The scales are powers of two, and not
    absurdly loose: the largest value of each layer uses more than 1/64 of its range."""
    path = str(write_tiny_hf(tmp_path, "llama"))
    source = resolve_model(path)
    model = load_model_config(source)
    prompts = [[5, 9, 14, 3, 7, 21, 8, 40, 2, 19, 33], [11, 4, 30, 30, 30, 2]]
    rank = build_runner(_config(path, None), source, model, StartupProgress(None))
    for batch in tp_ranks.prefill_then_decode(prompts):
        rank.runner.execute_batch(batch)
    weights = load_weights(source, model, torch.float32, "cpu")
    scales = fp8_kv_scales(weights, model)
    assert scales.shape == (model.num_layers, 2, model.num_kv_heads, model.head_dim)
    assert torch.equal(torch.exp2(torch.log2(scales).round()), scales), "scales are not powers of two"
    used = sum(-(-(len(p) + 1) // tp_ranks.BLOCK_SIZE) for p in prompts)
    written = rank.runner.kv_cache[:, :, 1 : 1 + used]  # [L, 2, blocks, B, H, D]
    peak = written.abs().amax(dim=(2, 3))  # [L, 2, H, D]
    limit = FP8_MAX * scales / MARGIN
    fill = (peak.amax(dim=(1, 2, 3)) / limit.amax(dim=(1, 2, 3))).tolist()
    print(f"largest value per layer / its FP8 limit: {[round(f, 3) for f in fill]}")
    assert bool((peak <= limit).all()), f"a value past its scale's range: {(peak / limit).max().item():.3f}"
    assert min(fill) > 1 / 64, fill


def test_a_tiny_model_with_an_fp8_cache_stays_near_float32(tmp_path) -> None:
    path = str(write_tiny_hf(tmp_path, "llama"))
    source = resolve_model(path)
    model = load_model_config(source)
    batches = tp_ranks.prefill_then_decode([[5, 9, 14, 3, 7, 21, 8], [11, 4, 30]])
    logits, layouts = {}, {}
    for kv in (None, "fp8_e4m3"):
        rank = build_runner(_config(path, kv), source, model, StartupProgress(None))
        layouts[kv] = rank.layout
        logits[kv] = torch.cat([rank.runner.execute_batch(batch) for batch in batches])
        if kv is not None:
            assert rank.runner.kv_cache.dtype == torch.float8_e4m3fn
    fp8, fp32 = layouts["fp8_e4m3"], layouts[None]
    assert fp8.quantized and fp8.bytes_per_block * 4 == fp32.bytes_per_block
    assert fp8.fingerprint() != fp32.fingerprint() and fp8.scale_digest
    err = (logits["fp8_e4m3"] - logits[None]).abs().max().item()
    scale = logits[None].abs().max().item()
    print(f"tiny model: FP8-cache logits off by {err:.4f}, largest float32 logit {scale:.4f}")
    assert err <= TINY_LOGITS_RTOL * scale
    assert err > 1e-4 * scale, "FP8-cache logits equal float32's: the cache was not quantized"


def test_a_prompt_prefilled_on_one_engine_decodes_on_another_from_its_fp8_codes(tmp_path) -> None:
    """Disaggregated at the engine level: a prefill-only engine computes the prompt into its FP8 cache, the
    blocks' bytes move as a transport moves them (codes, byte for byte: test_kv_transfer_tcp checks that for
    FP8), and a decode engine admitted with them generates exactly the tokens one colocated FP8 engine
    generates. Both engines derive the same scales from the same weights (equal fingerprints)."""
    path = str(write_tiny_hf(tmp_path, "llama"))
    config = _config(path, "fp8_e4m3")
    prompt = [(7 * i) % 90 + 5 for i in range(13)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    colocated = Engine(config, emit_text=False)
    prefill = Engine(config, prefill_only=True, emit_text=False)
    decode = Engine(config, emit_text=False)
    try:
        assert prefill.layout.fingerprint() == decode.layout.fingerprint()
        colocated.add_request("c", prompt, params)
        expected = _tokens(colocated, "c")
        prefill.add_request("p", prompt, params)
        first = next(o for o in prefill.step() if o.request_id == "p")
        src = list(first.kv_block_ids)
        dst = decode.pool.allocate(len(src))
        decode.runner.kv_cache.view(torch.uint8)[:, :, dst] = prefill.runner.kv_cache.view(torch.uint8)[
            :, :, src
        ]
        prefill.release_blocks(first.kv_block_ids)
        assert decode.add_prefilled("d", prompt, params, tuple(dst), first.token_ids[0]) is None
        got = first.token_ids + _tokens(decode, "d")
    finally:
        for engine in (colocated, prefill, decode):
            engine.close()
    assert len(expected) == 10 and got == expected


def _tokens(engine: Engine, request_id: str) -> list[int]:
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request_id:
                tokens += out.token_ids
    return tokens


def test_an_fp8_layout_pairs_only_with_the_same_scales() -> None:
    def layout(dtype: str, digest: str) -> KVLayout:
        return KVLayout(2, 2, 8, 4, 16, dtype, scale_digest=digest)

    a, b = layout("float8_e4m3fn", "aaaa"), layout("float8_e4m3fn", "bbbb")
    assert a.fingerprint() != b.fingerprint() and a.mismatch(b.format_dict()) is None
    assert "dtype" in (layout("bfloat16", "").mismatch(a.format_dict()) or "")
    with pytest.raises(ValueError, match="scale_digest"):
        layout("float8_e4m3fn", "")
    with pytest.raises(ValueError, match="scale_digest"):
        layout("bfloat16", "aaaa")


def _rank_scales(path: str, size: int) -> list[np.ndarray]:
    """Each rank's scales from its own weight shard (no processes needed: a shard is a plan and a load)."""
    source = resolve_model(path)
    model = load_model_config(source)
    out = []
    for rank in range(size):
        shard = TPShard.plan(model, ParallelConfig(tensor_parallel_size=size), rank)
        weights = load_weight_shard(source, model, shard, torch.float32, "cpu")
        out.append(fp8_kv_scales(weights, shard.local_model(model)).numpy())
    return out


def test_a_tensor_parallel_rank_derives_the_scales_of_its_heads(tmp_path) -> None:
    """Rank r's scales are exactly one device's scales of the KV heads rank r holds: the two sides of a
    handoff agree however their workers are split."""
    path = str(write_tiny_hf(tmp_path, "llama"))
    source = resolve_model(path)
    model = load_model_config(source)
    whole = fp8_kv_scales(load_weights(source, model, torch.float32, "cpu"), model).numpy()
    for rank, scales in enumerate(_rank_scales(path, 2)):
        heads = TPShard.plan(model, ParallelConfig(tensor_parallel_size=2), rank).kv_heads
        np.testing.assert_array_equal(scales, whole[:, :, heads.start : heads.stop])


@pytest.fixture(scope="module")
def smollm2() -> dict[str, LLM]:
    variants = {"float32": (None, "none"), "fp8 kv": ("fp8_e4m3", "none"), "fp8 both": ("fp8_e4m3", "fp8")}
    return {name: LLM(config=_config("smollm2-135m-instruct", kv, q)) for name, (kv, q) in variants.items()}


def test_smollm2_with_an_fp8_cache_perplexity_and_next_tokens(smollm2) -> None:
    ids = smollm2["float32"].tokenizer.encode(TEXT)
    target = torch.tensor(ids[1:])
    logits = {
        name: llm.engine.runner.execute_batch(tp_ranks.prefill_then_decode([ids])[0])[:-1]
        for name, llm in smollm2.items()
    }
    ppl = {name: math.exp(F.cross_entropy(row, target).item()) for name, row in logits.items()}
    agree = {
        name: (row.argmax(-1) == logits["float32"].argmax(-1)).float().mean().item()
        for name, row in logits.items()
    }
    print(f"perplexity {ppl}, next-token agreement {agree} over {len(target)} tokens")
    assert ppl["float32"] < 60, f"float32 perplexity {ppl['float32']}: the reference itself is broken"
    assert abs(ppl["fp8 kv"] / ppl["float32"] - 1) <= KV_PERPLEXITY_RTOL, ppl
    assert abs(ppl["fp8 both"] / ppl["float32"] - 1) <= BOTH_PERPLEXITY_RTOL, ppl
    assert agree["fp8 kv"] >= MIN_KV_AGREEMENT and agree["fp8 both"] >= MIN_BOTH_AGREEMENT, agree
    assert not torch.equal(logits["fp8 kv"], logits["float32"])


def test_smollm2_with_an_fp8_cache_generates_greedily_through_the_engine(smollm2) -> None:
    """Prefill, decode steps reading the FP8 cache, sampler: fp8's own picks recomputed in one prefill are the
    tokens it generated, and float32 teacher forced on them picks mostly the same."""
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = smollm2["fp8 kv"].generate([PromptInput(text=p) for p in PROMPTS], params)
    assert all(len(out.token_ids) == MAX_NEW for out in outs)
    sequences = [out.prompt_token_ids + out.token_ids for out in outs]
    chosen = {name: _choices(smollm2[name].engine.runner, sequences, outs) for name in ("float32", "fp8 kv")}
    assert chosen["fp8 kv"] == [out.token_ids for out in outs]
    pairs = [(a, b) for ref, got in zip(chosen["float32"], chosen["fp8 kv"]) for a, b in zip(ref, got)]
    agreement = sum(a == b for a, b in pairs) / len(pairs)
    print(f"teacher-forced agreement {agreement:.3f}")
    assert agreement >= MIN_KV_AGREEMENT
