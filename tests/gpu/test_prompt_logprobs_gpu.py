"""Prompt logprobs on the GPU: scored rows are read out of the piecewise prefill graphs' and the decode graphs'
outputs, their lm_head runs in slices, and a step-ahead engine copies them to the host through pinned memory
behind an event. In bf16 against transformers in float32 on the same weights, synchronous, ahead and eager,
prompts run in chunks beside other requests' decodes. The CPU tests (tests/model/test_prompt_logprobs.py) cover
the scheduling cases exactly; this covers what only a GPU runs."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from model_runtime.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from model_runtime.engine import Engine
from model_runtime.request import SamplingParams
from tests.model.tiny_models import write_tiny_hf

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]
BF16_ATOL = 0.05  # bf16 weights and activations against float32


def _scores(path: str, ahead: bool, eager: bool) -> tuple[dict[str, list], Engine]:
    engine = Engine(
        EngineConfig(
            model=path,
            cache=CacheConfig(num_blocks=512),
            scheduler=SchedulerConfig(
                max_num_seqs=16, max_model_len=1024, max_num_batched_tokens=128, async_scheduling=ahead
            ),
            device=DeviceConfig(device="cuda", dtype="bfloat16", enforce_eager=eager),
        ),
        emit_text=False,
    )
    # 12 prompts of 6..402 tokens: several chunks of at most 128 tokens each, some beside others' decodes
    prompts = {f"r{j}": [(7 * i + 3 * j) % 90 + 5 for i in range(6 + 36 * j)] for j in range(12)}
    for j, (rid, prompt) in enumerate(prompts.items()):
        scored = None if j % 4 == 3 else j % 3  # top 0, 1 or 2; every fourth asks for nothing
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=scored))
    out: dict[str, list] = {}
    while engine.has_unfinished():
        for step in engine.step():
            if step.prompt_logprobs is not None:
                assert step.request_id not in out
                out[step.request_id] = step.prompt_logprobs
    assert sorted(out) == sorted(r for j, r in enumerate(prompts) if j % 4 != 3)
    return {rid: [prompts[rid], scores] for rid, scores in out.items()}, engine


def test_prompt_logprobs_on_the_gpu_are_transformers_in_every_mode(tmp_path) -> None:
    path = str(write_tiny_hf(tmp_path, "llama"))
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    runs = {}
    for name, ahead, eager in (("sync", False, False), ("ahead", True, False), ("eager", False, True)):
        runs[name], engine = _scores(path, ahead, eager)
        if not eager:
            assert engine.runner.prefill_graphs is not None and engine.runner.graphs is not None
        assert engine.pool.num_free == engine.pool.usable
    for rid, (prompt, _) in runs["sync"].items():
        with torch.inference_mode():
            logits = ref(torch.tensor([prompt], device="cuda")).logits[0, :-1].float()
        expect = logits.log_softmax(-1).cpu()
        for name, run in runs.items():
            scores = run[rid][1]
            assert scores[0] is None and len(scores) == len(prompt), (name, rid)
            chosen = torch.tensor([scores[i][0] for i in range(1, len(prompt))])
            want = expect[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
            torch.testing.assert_close(chosen, want, atol=BF16_ATOL, rtol=0, msg=f"{name} {rid}")
            for i in range(1, len(prompt)):
                top = scores[i][1]
                n = len(top)
                assert n == int(rid[1:]) % 3, (name, rid, i)
                if n:  # the best alternative's logprob (its id may be a near tie in bf16)
                    assert top[0][1] == pytest.approx(float(expect[i - 1].max()), abs=BF16_ATOL)
