"""Prompt logprobs (SamplingParams.prompt_logprobs) equal transformers' log_softmax over the same prompt (float32,
CPU): one chunk or many, synchronous or scheduled ahead, beside requests that ask for other top-n or nothing,
after the prompt's prefix entered the cache, and under preemption."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from model_runtime.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from model_runtime.engine import Engine
from model_runtime.llm import LLM
from model_runtime.request import PromptInput, SamplingError, SamplingParams
from model_runtime.request_rules import InvalidRequest
from tests.model.test_engine_vs_hf import SHARP_INIT, cpu_config, random_prompts
from tests.model.tiny_models import tiny_vocab_size, write_tiny_hf

pytestmark = pytest.mark.model

ATOL = 2e-4  # float32 on both sides; our attention and matmuls sum in another order


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_tiny_hf(tmp_path_factory.mktemp("scores"), "llama", initializer_range=SHARP_INIT)
    return str(path), AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_logprobs(ref_model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row i is the distribution over prompt token i + 1."""
    logits = ref_model(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt))).logits[0]
    return logits[:-1].float().log_softmax(-1)


def assert_scores(scores, ref: torch.Tensor, prompt: list[int], top_n: int, label: str) -> None:
    assert scores is not None, label
    assert len(scores) == len(prompt), label
    assert scores[0] is None, f"{label}: the first prompt token has no logprob"
    for i in range(1, len(prompt)):
        assert scores[i] is not None, f"{label}: token {i} was not scored"
        chosen, top = scores[i]
        expect = ref[i - 1]
        assert chosen == pytest.approx(float(expect[prompt[i]]), abs=ATOL), f"{label}: token {i}"
        assert len(top) == top_n, f"{label}: token {i} has {len(top)} alternatives, asked {top_n}"
        if top_n:
            values, ids = expect.topk(top_n)
            assert [t for t, _ in top] == ids.tolist(), f"{label}: token {i}'s top {top_n}"
            assert [v for _, v in top] == pytest.approx(values.tolist(), abs=ATOL), label


@pytest.mark.parametrize("ahead", [False, True], ids=["synchronous", "ahead"])
@pytest.mark.parametrize("budget", [None, 7], ids=["one-chunk", "chunks-of-7"])
def test_prompt_logprobs_match_transformers(model, ahead, budget):
    """Four requests in one batch: top 3, top 0 (the token's own logprob only), none asked, top 5; with a step
    budget of 7 tokens every prompt but the shortest runs in several chunks, some beside others' decodes."""
    path, ref_model = model
    scheduler: dict[str, int | bool] = {"async_scheduling": ahead}
    if budget is not None:
        scheduler["max_num_batched_tokens"] = budget
    llm = LLM(path, cpu_config(path, **scheduler))
    prompts = random_prompts(8, tiny_vocab_size(), seed=5)[3:7]  # 5, 9, 16, 23 tokens
    asked = [3, 0, None, 5]
    params = [SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=n) for n in asked]
    done = llm.generate([PromptInput(token_ids=tuple(p)) for p in prompts], params)
    for prompt, n, completion in zip(prompts, asked, done):
        if n is None:
            assert completion.prompt_logprobs is None
            continue
        assert_scores(completion.prompt_logprobs, hf_logprobs(ref_model, prompt), prompt, n, f"top {n}")
    # scoring changes nothing else: the same greedy tokens as without
    plain = llm.generate(
        [PromptInput(token_ids=tuple(p)) for p in prompts], SamplingParams(temperature=0, max_tokens=4)
    )
    assert [c.token_ids for c in done] == [c.token_ids for c in plain]


def test_a_cached_prefix_is_scored_all_the_same(model):
    """The prompt's blocks are in the prefix cache, yet a request that scores it runs every position (and a
    plain request right after still hits the cache)."""
    path, ref_model = model
    engine = Engine(cpu_config(path))
    prompt = random_prompts(8, tiny_vocab_size(), seed=13)[-1]  # 40 tokens: 9 full blocks of 4 cached

    def run(request_id: str, sampling: SamplingParams):
        engine.add_request(request_id, prompt, sampling)
        outs = []
        while engine.has_unfinished():
            outs.extend(o for o in engine.step() if o.request_id == request_id)
        return outs

    run("warm", SamplingParams(temperature=0, max_tokens=2))
    scored = run("scored", SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2))
    assert scored[0].num_cached_tokens == 0
    assert_scores(scored[0].prompt_logprobs, hf_logprobs(ref_model, prompt), prompt, 2, "after the cache")
    assert all(o.prompt_logprobs is None for o in scored[1:]), "only the first output carries them"
    again = run("plain", SamplingParams(temperature=0, max_tokens=2))
    assert again[0].num_cached_tokens == 36


def test_preempted_requests_keep_their_scores(model):
    """A cache too small for the batch preempts and recomputes, prompts run in chunks of at most 7 tokens; the
    scores are still each prompt's own, and complete."""
    path, ref_model = model
    tight = EngineConfig(
        model=path,
        cache=CacheConfig(block_size=4, num_blocks=25, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=7),
        device=DeviceConfig(device="cpu"),
    )
    engine = Engine(tight)
    prompts = random_prompts(8, tiny_vocab_size(), seed=3)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=24, prompt_logprobs=1))
    scores, preempted = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.prompt_logprobs is not None:
                assert out.request_id not in scores, "the scores go out once"
                scores[out.request_id] = out.prompt_logprobs
        preempted += engine.last_step.num_preempted if engine.last_step else 0
    assert preempted > 0
    for i, prompt in enumerate(prompts):
        assert_scores(scores[str(i)], hf_logprobs(ref_model, prompt), prompt, 1, f"prompt {i}")


@pytest.mark.parametrize("bad", [-1, 21, True, 1.5])
def test_prompt_logprobs_out_of_range_is_refused(bad):
    with pytest.raises(SamplingError, match=r"^prompt_logprobs: must be an integer in \[0, 20\]"):
        SamplingParams(prompt_logprobs=bad)


def test_a_resumed_request_cannot_score_its_prompt(model):
    engine = Engine(cpu_config(model[0]))
    with pytest.raises(
        InvalidRequest, match=r"^prompt_logprobs: not for a resumed request \(output_offset > 0\)"
    ):
        engine.add_request("r", [5, 6, 7, 8], SamplingParams(prompt_logprobs=0), output_offset=2)
