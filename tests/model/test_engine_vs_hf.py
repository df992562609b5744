"""The engine's greedy tokens equal Hugging Face transformers' on the same weights (float32, CPU)."""

from __future__ import annotations

import random

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

from model_runtime.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from model_runtime.llm import LLM
from model_runtime.request import PromptInput, SamplingParams
from tests.model.reference import assert_greedy_match, hf_greedy
from tests.model.tiny_models import EOS_ID, tiny_vocab_size, write_tiny_gguf, write_tiny_hf

pytestmark = pytest.mark.model

MAX_NEW = 24
SHARP_INIT = 0.4


def cpu_config(model: str, **scheduler: int | bool) -> EngineConfig:
    return EngineConfig(
        model=model,
        cache=CacheConfig(block_size=4, num_blocks=256),
        scheduler=SchedulerConfig(**scheduler) if scheduler else SchedulerConfig(),
        device=DeviceConfig(device="cpu"),
    )


def random_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Lengths straddle block boundaries (block_size 4) and include a single-token prompt.
    lengths = [1, 3, 4, 5, 9, 16, 23, 40][:n]
    return [[rng.randrange(3, vocab) for _ in range(length)] for length in lengths]


def run_ours(llm: LLM, prompts: list[list[int]], max_new: int = MAX_NEW) -> list[list[int]]:
    inputs = [PromptInput(token_ids=tuple(p)) for p in prompts]
    return [c.token_ids for c in llm.generate(inputs, SamplingParams(temperature=0, max_tokens=max_new))]


def check_against_hf(ref_model, llm: LLM, prompts: list[list[int]], label: str) -> None:
    ours = run_ours(llm, prompts)
    for i, (prompt, tokens) in enumerate(zip(prompts, ours)):
        ref = hf_greedy(ref_model, prompt, MAX_NEW, EOS_ID)
        assert_greedy_match(tokens, ref, f"{label} prompt {i}")


HF_VARIANTS = [
    ("llama", {}),
    ("llama", {"llama3_rope": True}),
    ("llama", {"tie": True, "sharded": True}),
    ("qwen2", {}),
    ("qwen2", {"tie": True}),
    ("mistral", {}),
]


@pytest.mark.parametrize(
    ("arch", "flags"), HF_VARIANTS, ids=[f"{a}-{'-'.join(f) or 'plain'}" for a, f in HF_VARIANTS]
)
def test_tiny_hf_models_match_transformers(tmp_path, arch, flags):
    # A large init makes attention peaky, so position handling (rope, masks, paging) decides the tokens.
    path = write_tiny_hf(tmp_path, arch, initializer_range=SHARP_INIT, **flags)
    ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), cpu_config(str(path)))
    check_against_hf(ref_model, llm, random_prompts(8, tiny_vocab_size(), seed=hash(arch) % 1000), arch)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_q8_q4_1_matches_transformers(tmp_path, arch):
    qtypes = (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1)
    path = write_tiny_gguf(tmp_path, arch, qtypes=qtypes)
    ref_model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    llm = LLM(str(path), cpu_config(str(path)))
    check_against_hf(ref_model, llm, random_prompts(6, tiny_vocab_size(), seed=7), f"gguf-{arch}")


def test_logit_bias_matches_transformers_sequence_bias(tmp_path):
    """Greedy with a logit_bias per request equals transformers' generate with the same biases as
    single-token sequence_bias, in one batch with requests that have none; and the bias changes the tokens."""
    path = write_tiny_hf(tmp_path, "llama", initializer_range=SHARP_INIT)
    ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), cpu_config(str(path)))
    vocab = tiny_vocab_size()
    prompts = random_prompts(6, vocab, seed=21)
    plain = run_ours(llm, prompts)
    rng = random.Random(5)
    biases: list[dict[int, float]] = []
    for i, tokens in enumerate(plain):
        if i % 3 == 2:
            biases.append({})  # rows without a bias share the batch
            continue
        # Ban the unbiased run's first two tokens, push two random ones up and one down by a few logits.
        bias = {tokens[0]: -100.0, tokens[1]: -100.0}
        bias.update({rng.randrange(3, vocab): rng.choice((2.5, 4.0)) for _ in range(2)})
        bias[rng.randrange(3, vocab)] = -3.0
        biases.append(bias)
    params = [
        SamplingParams(temperature=0, max_tokens=MAX_NEW, logit_bias=tuple(sorted(b.items()))) for b in biases
    ]
    ours = [c.token_ids for c in llm.generate([PromptInput(token_ids=tuple(p)) for p in prompts], params)]
    for i, (prompt, bias, tokens) in enumerate(zip(prompts, biases, ours)):
        extra = {"sequence_bias": {(t,): b for t, b in bias.items()}} if bias else {}
        ref = hf_greedy(ref_model, prompt, MAX_NEW, EOS_ID, **extra)
        assert_greedy_match(tokens, ref, f"logit_bias prompt {i}")
        if bias:
            banned = [t for t, b in bias.items() if b == -100.0]
            assert not set(banned) & set(tokens), f"prompt {i}: a banned token was chosen: {tokens}"
            assert tokens != plain[i]
        else:
            assert tokens == plain[i]


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties as its API reference states them, over the tokens generated so
    far (not the prompt's): logit[t] -= c(t) * frequency_penalty + (c(t) > 0) * presence_penalty."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        counts = torch.zeros_like(scores)
        generated = input_ids[:, self.prompt_len :]
        counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - counts * self.frequency - (counts > 0).to(scores.dtype) * self.presence


@pytest.mark.parametrize("ahead", [False, True], ids=["synchronous", "ahead"])
def test_presence_and_frequency_penalties_match_the_formula_on_transformers_logits(tmp_path, ahead):
    """Greedy with penalties equals transformers' greedy with OpenAI's formula applied to its logits, in one batch
    with an unpenalized request (unchanged); a step-ahead engine counts the token still pending on the device.
    The default initialisation's logits are close enough for a penalty of 2 to turn the unpenalized runs'
    repeats into other tokens."""
    path = write_tiny_hf(tmp_path, "llama")
    ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), cpu_config(str(path), async_scheduling=ahead))
    prompts = random_prompts(4, tiny_vocab_size(), seed=31)
    plain = run_ours(llm, prompts)
    settings = [(0.0, 2.0), (1.5, 0.0), (0.0, 0.0), (-0.5, 1.0)]  # (presence, frequency); row 2: none
    params = [
        SamplingParams(temperature=0, max_tokens=MAX_NEW, presence_penalty=pres, frequency_penalty=freq)
        for pres, freq in settings
    ]
    ours = [c.token_ids for c in llm.generate([PromptInput(token_ids=tuple(p)) for p in prompts], params)]
    for i, (prompt, (pres, freq), tokens) in enumerate(zip(prompts, settings, ours)):
        if not (pres or freq):
            assert tokens == plain[i]
            continue
        processors = LogitsProcessorList([OpenAIPenalties(len(prompt), pres, freq)])
        ref = hf_greedy(ref_model, prompt, MAX_NEW, EOS_ID, logits_processor=processors)
        assert_greedy_match(tokens, ref, f"penalties {pres}/{freq} prompt {i}")
    # the penalties had something to act on: the unpenalized runs repeat tokens, the frequency-penalized differ
    assert any(len(set(t)) < len(t) for t in plain)
    assert ours[0] != plain[0]


@pytest.mark.parametrize("ahead", [False, True], ids=["synchronous", "ahead"])
def test_repetition_penalty_matches_transformers(tmp_path, ahead):
    """Greedy with a repetition penalty (over the prompt and the output) equals transformers' generate with the
    same repetition_penalty, beside an unpenalized request; a step-ahead engine counts its pending token."""
    path = write_tiny_hf(tmp_path, "llama")
    ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), cpu_config(str(path), async_scheduling=ahead))
    prompts = random_prompts(4, tiny_vocab_size(), seed=31)
    plain = run_ours(llm, prompts)
    penalties = [1.3, 1.0, 1.8, 0.8]  # 1.0: none; below 1 favours repeats
    params = [SamplingParams(temperature=0, max_tokens=MAX_NEW, repetition_penalty=p) for p in penalties]
    ours = [c.token_ids for c in llm.generate([PromptInput(token_ids=tuple(p)) for p in prompts], params)]
    for i, (prompt, penalty, tokens) in enumerate(zip(prompts, penalties, ours)):
        if penalty == 1.0:
            assert tokens == plain[i]
            continue
        ref = hf_greedy(ref_model, prompt, MAX_NEW, EOS_ID, repetition_penalty=penalty)
        assert_greedy_match(tokens, ref, f"repetition_penalty {penalty} prompt {i}")
    assert ours[2] != plain[2]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = write_tiny_hf(tmp_path_factory.mktemp("batch"), "llama", initializer_range=SHARP_INIT)
    return str(path)


def test_batch_composition_changes_nothing(tiny_llama):
    """Alone, all together, chunked prefill and forced preemption give the same greedy tokens."""
    prompts = random_prompts(8, tiny_vocab_size(), seed=3)
    alone = [run_ours(LLM(tiny_llama, cpu_config(tiny_llama)), [p])[0] for p in prompts[:3]]
    together = run_ours(LLM(tiny_llama, cpu_config(tiny_llama)), prompts)
    assert together[:3] == alone
    chunked = run_ours(LLM(tiny_llama, cpu_config(tiny_llama, max_num_batched_tokens=7)), prompts)
    assert chunked == together
    # 24 usable blocks of 4 tokens cannot hold 8 sequences of up to 64 tokens: the scheduler must preempt.
    tight = EngineConfig(
        model=tiny_llama,
        cache=CacheConfig(block_size=4, num_blocks=25, enable_prefix_caching=False),
        device=DeviceConfig(device="cpu"),
    )
    llm = LLM(tiny_llama, tight)
    preempted = run_ours(llm, prompts)
    assert preempted == together
    assert llm.engine.num_free_blocks == 24


def test_prefix_cache_hits_give_same_tokens(tiny_llama):
    base = random_prompts(8, tiny_vocab_size(), seed=11)[-1]  # 40 tokens
    prompts = [base, base[:37] + [5, 6, 7], base]
    llm = LLM(tiny_llama, cpu_config(tiny_llama))
    first = run_ours(llm, prompts[:1])
    again = run_ours(llm, prompts)  # the shared prefix now comes from the cache
    fresh = run_ours(LLM(tiny_llama, cpu_config(tiny_llama)), prompts[1:2])
    assert again[0] == first[0] == again[2]
    assert again[1] == fresh[0]
