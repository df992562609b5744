"""The FP8 KV cache (cache.dtype fp8_e4m3) on CPU, where the torch attention reads every key and value back from
the cache (code * scale): each row is stored as e4m3 codes and a bfloat16 scale inside its block, a tiny random
model's logits stay near float32, a prompt prefilled on one engine decodes on another from the moved bytes, and
the embedded SmolLM2-135M stays within the issue's 1% of its float32 perplexity.

Measured (torch 2.13 CPU, float32 activations, this file's prints; see KV_PERPLEXITY_RTOL): with the previous
static per-channel power-of-two scales SmolLM2's perplexity on TEXT rose 1.5% (23.53 -> 23.89); with a scale per
token and head it moves by under 0.5%.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from model_runtime.attention.base import store_kv
from model_runtime.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from model_runtime.engine import Engine
from model_runtime.kv_layout import BLOCK_ALIGN, FP8_KV_DTYPE, KVLayout
from model_runtime.kv_quant import dequantize_kv, quantize_kv, split_fp8_cache
from model_runtime.llm import LLM
from model_runtime.quantization.fp8 import emulate_scaled_mm
from model_runtime.request import PromptInput, SamplingParams
from model_runtime.runner_setup import build_runner
from model_runtime.startup import StartupProgress
from model_runtime.weights import load_model_config, resolve_model
from tests.model import tp_ranks
from tests.model.test_fp8_weights import PROMPTS, TEXT, _choices, _logits
from tests.model.tiny_models import write_tiny_hf

pytestmark = pytest.mark.model

TINY_LOGITS_RTOL = 0.10  # of the largest float32 logit
KV_PERPLEXITY_RTOL = 0.01  # the goal; measured -0.37% (23.53 -> 23.44)
# FP8 weights and cache, computed as a Hopper GPU computes them (fp8.emulate_scaled_mm: activations rounded per
# token): measured +1.2% on this text, where the weights with rounded activations alone measure +2.8% and the
# cache alone -0.4%; errors of this size do not add up on 205 tokens. On another CPU (an AMD EPYC with AVX2 and no
# AVX-512, 2026-11-29; the float32 reference the same to 6 digits) +2.0%: which FP8 codes a rounding puts one step
# apart moves with the CPU's float32 arithmetic, and on 205 tokens that moves perplexity by a point.
BOTH_PERPLEXITY_RTOL = 0.03
LONG_TEXT = (Path(__file__).parent / "lighthouse.txt").read_text()
LONG_BOTH_PERPLEXITY_RTOL = 0.06  # FP8 weights and cache on LONG_TEXT: measured 4.6% (the 1% not met)
# quantization: fp8_group (a scale per 64 input channels for weights and activations), Hopper numerics, on
# LONG_TEXT: measured +0.86% alone and +0.99% with the FP8 cache (the 1%); on TEXT +3.2% and +1.9%.
# On the AVX2 CPU above: +0.85% and +1.63%.
LONG_GROUP_PERPLEXITY_RTOL = 0.011
LONG_GROUP_BOTH_PERPLEXITY_RTOL = 0.02
GROUP_PERPLEXITY_RTOL = 0.04
MIN_KV_AGREEMENT = 0.93  # measured 0.976
MIN_BOTH_AGREEMENT = 0.80  # measured 0.863 (Hopper numerics, see above)
MAX_NEW = 8
NEAR_TIE = 0.1  # logits; see test_smollm2_with_an_fp8_cache_generates_greedily_through_the_engine


def _config(model: str, kv_dtype: str | None, quantization: str = "none") -> EngineConfig:
    return EngineConfig(
        model=model,
        cache=CacheConfig(
            block_size=tp_ranks.BLOCK_SIZE, num_blocks=256, enable_prefix_caching=False, dtype=kv_dtype
        ),
        scheduler=SchedulerConfig(max_model_len=512),  # the torch attention gathers whole block tables
        device=DeviceConfig(device="cpu", dtype="float32", quantization=quantization),
    )


def test_each_written_row_is_codes_and_a_scale_whose_largest_code_is_448(tmp_path) -> None:
    """After a tiny model's prefill and decode steps, every row the FP8 cache holds (one token, one KV head, K or
    V) has a bfloat16 scale beside its codes and reaches 448 in its largest code: the row's largest value is
    stored (nearly) exactly, which is what keeps attention scores right. Unwritten slots stay zero."""
    path = str(write_tiny_hf(tmp_path, "llama"))
    source = resolve_model(path)
    model = load_model_config(source)
    prompts = [[5, 9, 14, 3, 7, 21, 8, 40, 2, 19, 33], [11, 4, 30, 30, 30, 2]]
    rank = build_runner(_config(path, "fp8_e4m3"), source, model, StartupProgress(None))
    for batch in tp_ranks.prefill_then_decode(prompts):
        rank.runner.execute_batch(batch)
    layout, runner = rank.layout, rank.runner
    assert runner.kv_cache.shape == layout.cache_shape == (*runner.kv_cache.shape[:3], layout.block_bytes)
    codes, scales = runner.kv_pages, runner.kv_scales
    assert codes is not None and scales is not None
    assert codes.data_ptr() == runner.kv_cache.data_ptr() and scales.dtype == torch.bfloat16
    b = layout.block_size
    rows = []  # (block, offset) of every token written: prompt + 1 decoded each, blocks handed out in order
    block = 1
    for prompt in prompts:
        n = len(prompt) + 1
        rows += [(block + t // b, t % b) for t in range(n)]
        block += -(-n // b)
    peaks = torch.stack([codes[:, :, blk, off].float().abs().amax(-1) for blk, off in rows])  # [T, L, 2, H]
    assert bool((peaks == 448).all()), f"rows whose largest code is not 448: {int((peaks != 448).sum())}"
    written = torch.stack([scales[:, :, blk, off] for blk, off in rows])
    assert bool((written > 0).all())
    assert not runner.kv_cache.view(torch.uint8)[:, :, block:].any(), "bytes past the written blocks"


def test_quantize_and_store_agree_byte_for_byte_with_the_block_layout() -> None:
    """The torch store writes each row's codes and its scale where KVLayout says an FP8 block keeps them (codes
    [B, H, D], then scales [H, B]), and reading back gives each value within e4m3's rounding of its row's scale
    (the row's largest value exactly up to the scale's bfloat16 rounding)."""
    heads, dim, block = 3, 16, 4
    layout = KVLayout(1, heads, dim, block, 6, FP8_KV_DTYPE)
    storage = torch.zeros(layout.cache_shape, dtype=torch.float8_e4m3fn)
    codes, scales = split_fp8_cache(storage, block, heads, dim)
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(6, heads, dim, generator=gen) * torch.tensor([0.01, 1.0, 300.0])[:, None]
    v = torch.randn(6, heads, dim, generator=gen)
    k[2, 1] = 0.0  # an all-zero row
    slots = torch.tensor([4, 5, 9, -1, 13, 19])
    store_kv(k, v, codes[0, 0], codes[0, 1], slots, scales[0])
    want_codes, want_scales = quantize_kv(k)
    raw = storage.view(torch.uint8)[0, 0]  # [N, block_bytes]
    codes_end = block * heads * dim
    for row, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        b, off = divmod(slot, block)
        row_codes = raw[b, off * heads * dim : (off + 1) * heads * dim]
        assert torch.equal(row_codes, want_codes[row].view(torch.uint8).flatten())
        head_major = raw[b, codes_end : codes_end + 2 * heads * block].view(torch.bfloat16).view(heads, block)
        assert torch.equal(head_major[:, off], want_scales[row])
    written = {divmod(s, block) for s in slots.tolist() if s >= 0}
    untouched = [(b, o) for b in range(6) for o in range(block) if (b, o) not in written]
    assert all(
        not codes[0, 0, b, o].view(torch.uint8).any() and not scales[0, 0, b, o].any() for b, o in untouched
    )
    back = dequantize_kv(want_codes, want_scales, torch.float32)
    top = k.abs().amax(-1, keepdim=True)
    assert bool(((back - k).abs() <= top / 16 + 1e-30).all()), "a value off by more than e4m3's rounding"
    assert torch.allclose(back.abs().amax(-1), top.squeeze(-1), rtol=2**-8), "a row's largest value moved"
    assert bool((back[2, 1] == 0).all())


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
    block = fp8.block_size * model.num_kv_heads * (model.head_dim + 2)  # codes and bf16 scales
    assert (
        fp8.quantized and fp8.bytes_per_block == 2 * fp8.num_layers * -(-block // BLOCK_ALIGN) * BLOCK_ALIGN
    )
    assert fp8.bytes_per_block < fp32.bytes_per_block // 2
    assert fp8.fingerprint() != fp32.fingerprint()
    err = (logits["fp8_e4m3"] - logits[None]).abs().max().item()
    scale = logits[None].abs().max().item()
    print(f"tiny model: FP8-cache logits off by {err:.4f}, largest float32 logit {scale:.4f}")
    assert err <= TINY_LOGITS_RTOL * scale
    assert err > 1e-4 * scale, "FP8-cache logits equal float32's: the cache was not quantized"


def test_a_prompt_prefilled_on_one_engine_decodes_on_another_from_its_fp8_codes(tmp_path) -> None:
    """Disaggregated at the engine level: a prefill-only engine computes the prompt into its FP8 cache, the
    blocks' bytes move as a transport moves them (codes and the scales inside the blocks, byte for byte:
    test_kv_transfer_tcp checks that for FP8), and a decode engine admitted with them generates exactly the
    tokens one colocated FP8 engine generates."""
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


def test_an_fp8_layout_names_its_block_format() -> None:
    """FP8 blocks are block_bytes bytes (codes, scales, padding to 16) and pair only with FP8 blocks."""
    fp8, bf16 = KVLayout(2, 2, 8, 4, 16, FP8_KV_DTYPE), KVLayout(2, 2, 8, 4, 16, "bfloat16")
    assert fp8.block_bytes == 4 * 2 * 8 + 2 * 2 * 4 == 80 and fp8.block_shape == (80,)
    assert fp8.cache_shape == (2, 2, 16, 80) and fp8.staging_shape(3, (0, 1)) == (1, 2, 3, 80)
    assert bf16.block_shape == (4, 2, 8) and bf16.block_bytes == 128
    assert KVLayout(2, 3, 8, 4, 16, FP8_KV_DTYPE).block_bytes == 128  # 96 + 24, padded to 16
    assert KVLayout(32, 8, 128, 16, 2, FP8_KV_DTYPE).block_bytes == 16640  # Llama-3-8B: bf16 32768
    assert fp8.fingerprint() != bf16.fingerprint()
    assert "dtype" in (bf16.mismatch(fp8.format_dict()) or "")


@pytest.fixture(scope="module")
def smollm2() -> dict[str, LLM]:
    variants = {
        "float32": (None, "none"),
        "fp8 kv": ("fp8_e4m3", "none"),
        "fp8 both": ("fp8_e4m3", "fp8"),
        "fp8 group": (None, "fp8_group"),
        "fp8 group both": ("fp8_e4m3", "fp8_group"),
    }
    llms = {name: LLM(config=_config("smollm2-135m-instruct", kv, q)) for name, (kv, q) in variants.items()}
    for name in ("fp8 both", "fp8 group", "fp8 group both"):  # what a Hopper GPU computes
        assert emulate_scaled_mm(llms[name].engine.runner.model) == 4 * 30, name
    return llms


def test_smollm2_with_an_fp8_cache_perplexity_and_next_tokens(smollm2) -> None:
    ids = smollm2["float32"].tokenizer.encode(TEXT)
    target = torch.tensor(ids[1:])
    logits = {name: _logits(llm.engine.runner, ids)[:-1] for name, llm in smollm2.items()}
    ppl = {name: math.exp(F.cross_entropy(row, target).item()) for name, row in logits.items()}
    agree = {
        name: (row.argmax(-1) == logits["float32"].argmax(-1)).float().mean().item()
        for name, row in logits.items()
    }
    print(f"perplexity {ppl}, next-token agreement {agree} over {len(target)} tokens")
    assert ppl["float32"] < 60, f"float32 perplexity {ppl['float32']}: the reference itself is broken"
    assert abs(ppl["fp8 kv"] / ppl["float32"] - 1) <= KV_PERPLEXITY_RTOL, ppl
    assert abs(ppl["fp8 both"] / ppl["float32"] - 1) <= BOTH_PERPLEXITY_RTOL, ppl
    assert abs(ppl["fp8 group"] / ppl["float32"] - 1) <= GROUP_PERPLEXITY_RTOL, ppl
    assert agree["fp8 kv"] >= MIN_KV_AGREEMENT and agree["fp8 both"] >= MIN_BOTH_AGREEMENT, agree
    assert not torch.equal(logits["fp8 kv"], logits["float32"])


def _windowed_perplexity(llm: LLM, text: str, window: int = 480) -> tuple[float, int]:
    """Perplexity of `text` read in windows of `window` predicted tokens, each window prefilled on its own (the
    engine's max_model_len here is 512); returns it and the number of tokens predicted."""
    ids = llm.tokenizer.encode(text)
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window + 1]
        logits = _logits(llm.engine.runner, chunk)[:-1]
        nll += F.cross_entropy(logits, torch.tensor(chunk[1:]), reduction="sum").item()
        count += len(chunk) - 1
    return math.exp(nll / count), count


def test_smollm2_fp8_perplexity_on_a_longer_text(smollm2) -> None:
    """The same measures on LONG_TEXT (about 890 tokens, an original story written for this test): TEXT's 205
    tokens are too few to resolve 1%. Measured (torch 2.13 CPU): float32 25.01; FP8 cache -0.15%; FP8 weights and
    cache as a Hopper computes them +4.6% (on TEXT +1.2%: luck; the weights alone +2.5%, with their activations
    rounded +3.7%). fp8_group, a scale per 64 input channels on both sides: +0.86%, and +0.99% with the cache."""
    ppl = {name: _windowed_perplexity(llm, LONG_TEXT) for name, llm in smollm2.items()}
    base, tokens = ppl["float32"]
    change = {name: value / base - 1 for name, (value, _) in ppl.items()}
    print(f"perplexity over {tokens} tokens: float32 {base:.3f}, change {change}")
    assert tokens > 800 and base < 60, ppl
    assert abs(change["fp8 kv"]) <= KV_PERPLEXITY_RTOL, change
    assert abs(change["fp8 both"]) <= LONG_BOTH_PERPLEXITY_RTOL, change
    assert abs(change["fp8 group"]) <= LONG_GROUP_PERPLEXITY_RTOL, change
    assert abs(change["fp8 group both"]) <= LONG_GROUP_BOTH_PERPLEXITY_RTOL, change
    assert change["fp8 group"] < change["fp8 both"] - 0.02, "groups must beat per-row scales by a wide margin"


def test_smollm2_with_an_fp8_cache_generates_greedily_through_the_engine(smollm2) -> None:
    """Prefill, decode steps reading the FP8 cache, sampler: fp8's own picks recomputed in one prefill are the
    tokens it generated, and float32 teacher forced on them picks mostly the same.

    A recomputation computes the generated tokens' K/V rows in one batch instead of one per step, and float32
    rounding of that order can move a code by one e4m3 step: a pick whose two best logits were closer than
    NEAR_TIE may flip (seen once: 0.045 apart). Every generated token must be within NEAR_TIE of the recomputed
    best, and most must be it."""
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = smollm2["fp8 kv"].generate([PromptInput(text=p) for p in PROMPTS], params)
    assert all(len(out.token_ids) == MAX_NEW for out in outs)
    sequences = [out.prompt_token_ids + out.token_ids for out in outs]
    logits = smollm2["fp8 kv"].engine.runner.execute_batch(tp_ranks.prefill_then_decode(sequences)[0])
    row, behind = 0, []
    for ids, out in zip(sequences, outs):
        start = row + len(out.prompt_token_ids) - 1
        picked = logits[start : start + MAX_NEW]
        behind += (picked.amax(-1) - picked[torch.arange(MAX_NEW), out.token_ids]).tolist()
        row += len(ids)
    exact = sum(gap == 0 for gap in behind) / len(behind)
    print(f"generated tokens behind the recomputed best by up to {max(behind):.4f}; {exact:.3f} exactly it")
    assert max(behind) <= NEAR_TIE and exact >= 0.9, behind
    chosen = {name: _choices(smollm2[name].engine.runner, sequences, outs) for name in ("float32", "fp8 kv")}
    pairs = [(a, b) for ref, got in zip(chosen["float32"], chosen["fp8 kv"]) for a, b in zip(ref, got)]
    agreement = sum(a == b for a, b in pairs) / len(pairs)
    print(f"teacher-forced agreement {agreement:.3f}")
    assert agreement >= MIN_KV_AGREEMENT
