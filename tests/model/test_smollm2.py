"""The embedded SmolLM2-135M-Instruct GGUF: our greedy tokens equal transformers' (which dequantizes the same
GGUF itself), raw and with the chat template."""

from __future__ import annotations

import pytest

from model_runtime.config import DeviceConfig, EngineConfig
from model_runtime.llm import LLM
from model_runtime.request import ChatMessage, PromptInput, SamplingParams
from tests.model.reference import assert_greedy_match, hf_greedy
from tests.model.tiny_models import transformers_smollm2, transformers_smollm2_tokenizer

pytestmark = pytest.mark.model

MAX_NEW = 16
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "Water boils at",
    "List three colors:",
    "日本の首都は",
    "The best way to learn programming is",
    "Translate to French: good morning",
]


@pytest.fixture(scope="module")
def reference():
    """transformers' model and tokenizer of the GGUF, loaded once per process (test_weights and test_tokenizer
    compare against the same objects)."""
    return transformers_smollm2(), transformers_smollm2_tokenizer()


@pytest.fixture(scope="module")
def llm():
    return LLM(config=EngineConfig(device=DeviceConfig(device="cpu")))


@pytest.mark.parametrize("chat", [False, True], ids=["raw", "chat"])
def test_embedded_model_greedy_matches_transformers(reference, llm, chat):
    model, tokenizer = reference
    if chat:
        inputs = [PromptInput(messages=(ChatMessage("user", p),)) for p in PROMPTS]
    else:
        inputs = [PromptInput(text=p) for p in PROMPTS]
    completions = llm.generate(inputs, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    for prompt, completion in zip(PROMPTS, completions):
        if chat:
            ref_ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True
            )
            ref_ids = list(
                ref_ids["input_ids"] if isinstance(ref_ids, dict) or hasattr(ref_ids, "keys") else ref_ids
            )
        else:
            ref_ids = tokenizer(prompt)["input_ids"]
        assert completion.prompt_token_ids == ref_ids, f"prompt tokens differ for {prompt!r}"
        ref = hf_greedy(model, ref_ids, MAX_NEW, tokenizer.eos_token_id)
        assert_greedy_match(completion.token_ids, ref, repr(prompt))
        assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)
