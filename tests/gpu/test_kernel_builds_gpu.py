"""No Triton kernel is built in the middle of a run (model_runtime.kernel_builds).

An engine builds its kernels while it starts (the decode graphs' capture runs each decode kernel first); a
variant first met mid-run holds up that step for a compile of 0.4-1.0 s (one H200, docs/performance.md). This
drives an engine through what varies from step to step once it serves: a single sequence and 16 of them (the
lm_head's row count), mixed prefill-and-decode steps on the eager path whose block tables grow past 16 columns
(256 tokens), prompts of every length from 17 to 300 tokens, two arriving together beyond the step budget (the
second's rest attends over its cached first chunk: with an FP8 cache, attention.triton_gather's kernel),
logprobs on some, in bf16 and with FP8 weights and cache. The first request alone is counted apart from the
rest: it is the first prefill a started worker runs.
"""

from __future__ import annotations

import pytest
import torch

from model_runtime import kernel_builds
from model_runtime.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from model_runtime.engine import Engine
from model_runtime.request import SamplingParams
from tests.model.tiny_models import write_tiny_hf

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def _built_since(before: kernel_builds.KernelBuilds) -> int:
    now = kernel_builds.counts()
    return now.startup + now.after_start - before.startup - before.after_start


def _run(engine: Engine) -> None:
    while engine.has_unfinished():
        engine.step()


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "ahead"])
@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_an_engine_builds_no_kernel_once_it_has_started(tmp_path, quantization, ahead) -> None:
    if quantization == "fp8" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("FP8 projections need sm_90+")
    assert kernel_builds.watch(), "this Triton has no compile hooks"
    fp8 = quantization == "fp8"
    engine = Engine(
        EngineConfig(
            model=str(write_tiny_hf(tmp_path, "llama")),
            cache=CacheConfig(num_blocks=1024, dtype="fp8_e4m3" if fp8 else None),
            scheduler=SchedulerConfig(
                max_num_seqs=32, max_model_len=1024, max_num_batched_tokens=512, async_scheduling=ahead
            ),
            device=DeviceConfig(device="cuda", dtype="bfloat16", quantization=quantization),
        ),
        emit_text=False,
    )
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    before = kernel_builds.counts()
    engine.add_request("first", [(3 * i) % 90 + 5 for i in range(40)], greedy)
    _run(engine)
    first = _built_since(before)

    before = kernel_builds.counts()
    lengths = list(range(17, 301, 17)) + [250, 255, 256, 257, 270]
    for j, n in enumerate(lengths):
        params = SamplingParams(
            temperature=0 if j % 2 else 0.8,
            max_tokens=1 + (7 * j) % 40,
            ignore_eos=True,
            logprobs=2 if j % 4 == 0 else None,
            seed=j,
        )
        engine.add_request(f"r{j}", [(5 * i + j) % 90 + 5 for i in range(n)], params)
        engine.step()  # arrivals between steps: prefill chunks share eager steps with running decodes
    _run(engine)
    for j in range(2):  # 800 tokens arrive at once for a 512-token step: the second prompt's rest is a chunk
        engine.add_request(f"split-{j}", [(7 * i + j) % 90 + 5 for i in range(400)], greedy)
    _run(engine)
    for batch in (16, 17, 1):
        for j in range(batch):
            engine.add_request(f"b{batch}-{j}", [(11 * i + j) % 90 + 5 for i in range(30 + j)], greedy)
        _run(engine)
    rest = _built_since(before)

    names = kernel_builds.counts().recent
    assert (first, rest) == (0, 0), f"kernels built: {first} by the first request, {rest} after it; {names}"
    assert engine.pool.num_free == engine.pool.usable
