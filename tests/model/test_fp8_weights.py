"""FP8 weights (DeviceConfig.quantization="fp8") on CPU, where the matmul dequantizes the stored e4m3 weights:
a tiny random model's logits near its float32 logits (and not equal to them: the weights really are FP8), and
the same at TP=2, and the embedded SmolLM2-135M close to its float32 self in next-token choices and in
perplexity on a fixed text.

Measured (torch 2.13 CPU, float32 activations): SmolLM2's perplexity on TEXT 23.53 (float32) -> 23.76 (fp8),
+0.99%; next-token argmax agreement with float32 0.917 over TEXT's 205 tokens and 0.958 (23 of 24) teacher forced
on fp8's greedy continuations; the tiny model's logits off by 0.026 with the largest at 0.571 (4.5%); at TP=2
0.015 from TP=1 fp8's, 0.022 from float32's.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from model_runtime.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from model_runtime.llm import LLM
from model_runtime.model_runner import ModelRunner
from model_runtime.quantization.fp8 import emulate_scaled_mm
from model_runtime.request import Completion, PromptInput, SamplingParams
from model_runtime.runner_setup import build_runner
from model_runtime.startup import StartupProgress
from model_runtime.weights import load_model_config, resolve_model
from tests.model import tp_ranks
from tests.model.tiny_models import tiny_vocab_size, write_tiny_hf

pytestmark = pytest.mark.model

# A fixed text for perplexity (about 200 SmolLM2 tokens).
TEXT = (
    "The river begins in the mountains, where snow melts each spring and runs down through narrow valleys of "
    "pine and stone. By the time it reaches the plain it is wide and slow, and the towns along its banks have "
    "grown up around the bridges that cross it. For centuries the river carried timber, grain and wool to the "
    "coast, and the merchants who owned the boats built tall houses with warehouses on the ground floor. Today "
    "most goods travel by road and rail, but the old quays are still there. In summer, families walk along the "
    "water in the evening, children feed the ducks, and small boats take visitors past the mills and the "
    "church towers. Scientists who study the river measure its temperature, its flow and the fish that live in "
    "it. They have found that the water is cleaner than it was fifty years ago, when factories poured their "
    "waste into it without a second thought. Salmon, which had vanished, have begun to return, swimming "
    "upstream each autumn to lay their eggs in the gravel beds where they were born.\n"
)
PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "List three colors:"]
MAX_NEW = 8  # each CPU decode step dequantizes every projection: the engine run is the test's cost
TINY_LOGITS_RTOL = 0.10  # of the largest float32 logit; measured 0.045
PERPLEXITY_RTOL = 0.015  # weights alone (emulation); the goal is 1%; measured 0.99%
# What a Hopper GPU computes (fp8.emulate_scaled_mm: the activations rounded per token too): measured 2.8%, the
# issue's 1% not met. Which inputs cost it (measured by leaving one projection's activations unrounded): the
# RMSNorm outputs feeding qkv (+0.3% without them) and gate_up (+1.0%); o_proj's and down's barely matter. On an
# AMD EPYC with AVX2 and no AVX-512 (2026-11-29; the float32 reference and the weights-alone 0.99% the same) 4.3%,
# and 2.4% there with the rows divided by their scale as before 321d529 (now multiplied by its reciprocal): on 205
# tokens, which codes land one e4m3 step apart moves this by two points, with the CPU and with the rounding.
SCALED_MM_PERPLEXITY_RTOL = 0.05
MIN_TEXT_AGREEMENT = 0.90
MIN_GREEDY_AGREEMENT = 0.85


def _config(model: str, quantization: str) -> EngineConfig:
    return EngineConfig(
        model=model,
        cache=CacheConfig(block_size=tp_ranks.BLOCK_SIZE, num_blocks=256, enable_prefix_caching=False),
        # The torch attention gathers whole block tables: keep them short.
        scheduler=SchedulerConfig(max_model_len=512),
        device=DeviceConfig(device="cpu", dtype="float32", quantization=quantization),
    )


def _logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """Logits at every position of one sequence (blocks 1.., on an idle runner)."""
    return runner.execute_batch(tp_ranks.prefill_then_decode([ids])[0])


@pytest.mark.parametrize("method", ["fp8", "fp8_group"])
def test_a_tiny_model_with_fp8_weights_stays_near_float32(tmp_path, method: str) -> None:
    path = str(write_tiny_hf(tmp_path, "llama"))
    source = resolve_model(path)
    model = load_model_config(source)
    batches = tp_ranks.prefill_then_decode([[5, 9, 14, 3, 7, 21, 8], [11, 4, 30]])
    logits, runners = {}, {}
    for quantization in ("none", method):
        rank = build_runner(_config(path, quantization), source, model, StartupProgress(None))
        runners[quantization] = rank.runner
        logits[quantization] = torch.cat([rank.runner.execute_batch(batch) for batch in batches])
    assert logits["none"].shape[-1] == tiny_vocab_size()
    qkv = runners[method].model.get_submodule("layers.0.attn.qkv")
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.weight_scale.dtype == torch.float32
    groups = -(-qkv.weight.shape[1] // 64)
    expect_scale = (qkv.weight.shape[0], groups) if method == "fp8_group" else (qkv.weight.shape[0],)
    assert tuple(qkv.weight_scale.shape) == expect_scale
    assert runners[method].model.embed_tokens.weight.dtype == torch.float32
    err = (logits[method] - logits["none"]).abs().max().item()
    scale = logits["none"].abs().max().item()
    print(f"tiny model: {method} logits off by {err:.4f}, largest float32 logit {scale:.4f}")
    assert err <= TINY_LOGITS_RTOL * scale, f"{method} logits off by {err:.4f} (largest logit {scale:.3f})"
    assert err > 1e-3 * scale, f"{method} logits equal float32's: the weights were not quantized"


@pytest.mark.parametrize("fast_accum", [True, False])
def test_device_fp8_fast_accum_reaches_every_fp8_projection(tmp_path, fast_accum: bool) -> None:
    """The setting is the matmuls' (tests/gpu/test_fp8_weights_gpu.py measures what it does on Hopper): every
    FP8 projection the runner builds carries it; on CPU they emulate, in float32, either way."""
    import dataclasses

    from model_runtime.quantization.fp8 import FP8Linear

    path = str(write_tiny_hf(tmp_path, "llama"))
    source = resolve_model(path)
    config = _config(path, "fp8")
    config = dataclasses.replace(config, device=dataclasses.replace(config.device, fp8_fast_accum=fast_accum))
    runner = build_runner(config, source, load_model_config(source), StartupProgress(None)).runner
    fp8 = [m for m in runner.model.modules() if isinstance(m, FP8Linear)]
    assert len(fp8) == 4 * runner.config.num_layers
    assert {m.fast_accum for m in fp8} == {fast_accum}
    assert not any(m.scaled_mm for m in fp8)


def test_fp8_under_tensor_parallelism_stays_near_one_device(tmp_path) -> None:
    """TP=2 (gloo, two processes): each rank quantizes its own slice after the load. The column-parallel qkv
    and gate_up rows get the scales they get on one device; a row-parallel o_proj or down row is scaled over
    the rank's own columns, which changes its rounding a little: the logits stay within fp8's error of one
    device's, the same on both ranks."""
    path = str(write_tiny_hf(tmp_path, "llama"))
    batches = tp_ranks.prefill_then_decode([[5, 9, 14, 3, 7, 21, 8], [11, 4, 30]])
    one_fp8 = np.concatenate([logits for _, logits in tp_ranks.step_outputs(None, path, batches, "fp8")[0]])
    one_fp32 = np.concatenate([logits for _, logits in tp_ranks.step_outputs(None, path, batches)[0]])
    ranks = tp_ranks.run_ranks(tp_ranks.step_outputs, 2, path, batches, "fp8")
    two = [np.concatenate([logits for _, logits in steps]) for steps, _, _ in ranks]
    np.testing.assert_array_equal(two[0], two[1])
    scale = np.abs(one_fp32).max()
    off_one, off_fp32 = np.abs(two[0] - one_fp8).max(), np.abs(two[0] - one_fp32).max()
    print(
        f"TP=2 fp8 logits off by {off_one:.4f} from TP=1 fp8, {off_fp32:.4f} from float32 (largest {scale:.4f})"
    )
    assert off_fp32 <= TINY_LOGITS_RTOL * scale and off_one <= TINY_LOGITS_RTOL * scale
    assert off_fp32 > 1e-3 * scale, "TP=2 fp8 logits equal float32's: the weights were not quantized"


@pytest.fixture(scope="module")
def smollm2() -> dict[str, LLM]:
    variants = {"none": "none", "fp8": "fp8", "fp8 scaled_mm": "fp8"}
    llms = {name: LLM(config=_config("smollm2-135m-instruct", q)) for name, q in variants.items()}
    assert emulate_scaled_mm(llms["fp8 scaled_mm"].engine.runner.model) == 4 * 30  # qkv, o, gate_up, down
    return llms


def test_smollm2_fp8_perplexity_and_next_tokens_on_a_fixed_text(smollm2) -> None:
    ids = smollm2["none"].tokenizer.encode(TEXT)
    target = torch.tensor(ids[1:])
    logits = {q: _logits(llm.engine.runner, ids)[:-1] for q, llm in smollm2.items()}
    ppl = {q: math.exp(F.cross_entropy(row, target).item()) for q, row in logits.items()}
    agreement = (logits["fp8"].argmax(-1) == logits["none"].argmax(-1)).float().mean().item()
    print(f"perplexity {ppl}, next-token agreement {agreement:.3f} over {len(target)} tokens")
    assert ppl["none"] < 60, f"float32 perplexity {ppl['none']}: the reference itself is broken"
    assert abs(ppl["fp8"] / ppl["none"] - 1) <= PERPLEXITY_RTOL, ppl
    assert abs(ppl["fp8 scaled_mm"] / ppl["none"] - 1) <= SCALED_MM_PERPLEXITY_RTOL, ppl
    assert agreement >= MIN_TEXT_AGREEMENT
    assert not torch.equal(logits["fp8"], logits["none"])
    assert not torch.equal(logits["fp8 scaled_mm"], logits["fp8"]), "the activations were not rounded"


def test_smollm2_fp8_greedy_through_the_engine(smollm2) -> None:
    """fp8 generates greedily through the engine (prefill, decode, sampler). Teacher forced on those
    continuations (so one early divergence does not decide the count), float32 picks the same next token
    for most of them, and fp8's own picks recomputed in one prefill are the tokens it generated."""
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = smollm2["fp8"].generate([PromptInput(text=p) for p in PROMPTS], params)
    assert all(len(out.token_ids) == MAX_NEW for out in outs)
    sequences = [out.prompt_token_ids + out.token_ids for out in outs]
    chosen = {q: _choices(smollm2[q].engine.runner, sequences, outs) for q in ("none", "fp8")}
    assert chosen["fp8"] == [out.token_ids for out in outs]
    pairs = [(a, b) for ref, fp8 in zip(chosen["none"], chosen["fp8"]) for a, b in zip(ref, fp8)]
    agreement = sum(a == b for a, b in pairs) / len(pairs)
    prefixes = [_same_prefix(ref, fp8) for ref, fp8 in zip(chosen["none"], chosen["fp8"])]
    print(f"teacher-forced agreement {agreement:.3f}; first disagreement at {prefixes} of {MAX_NEW}")
    assert agreement >= MIN_GREEDY_AGREEMENT


def _choices(runner: ModelRunner, sequences: list[list[int]], refs: list[Completion]) -> list[list[int]]:
    """The argmax after each prompt and each generated token but the last, all sequences in one prefill."""
    logits = runner.execute_batch(tp_ranks.prefill_then_decode(sequences)[0])
    out, row = [], 0
    for ids, ref in zip(sequences, refs):
        start = row + len(ref.prompt_token_ids) - 1
        out.append(logits[start : row + len(ids) - 1].argmax(-1).tolist())
        row += len(ids)
    return out


def _same_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
