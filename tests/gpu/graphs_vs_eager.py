"""One tiny Llama engine run twice on the GPU, decode steps in CUDA graphs and then eager, on the same greedy
prompts: the FP8 tests' check that a graph captured their kernels faithfully."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from model_runtime.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from model_runtime.engine import Engine
from model_runtime.request import SamplingParams
from tests.model.tiny_models import write_tiny_hf

MAX_TOKENS = 24


def graphs_and_eager_tokens(
    tmp_path: Path, cache: CacheConfig, quantization: str, check: Callable[[Engine], None]
) -> list[dict[str, list[int]]]:
    """[graph run's tokens, eager run's tokens] by request; `check` inspects each engine before it runs."""
    path = str(write_tiny_hf(tmp_path, "llama"))
    return [engine_tokens(path, cache, quantization, eager, check) for eager in (False, True)]


def engine_tokens(
    path: str, cache: CacheConfig, quantization: str, eager: bool, prepare: Callable[[Engine], None]
) -> dict[str, list[int]]:
    """The greedy tokens of the model at `path` by request; `prepare` sees (and may change) the engine first."""
    prompts = [[(7 * i + j) % 90 + 5 for i in range(11 + 5 * j)] for j in range(4)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    config = EngineConfig(
        model=path,
        cache=cache,
        scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=512),
        device=DeviceConfig(device="cuda", dtype="bfloat16", enforce_eager=eager, quantization=quantization),
    )
    engine = Engine(config, emit_text=False)
    try:
        assert (engine.runner.graphs is None) == eager
        prepare(engine)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
        out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        while engine.has_unfinished():
            for step in engine.step():
                out[step.request_id] += step.token_ids
    finally:
        engine.close()
    assert all(len(t) == MAX_TOKENS for t in out.values())
    return out
