"""Step-ahead scheduling on the GPU (scheduler.async_scheduling): the decode steps replay CUDA graphs with their
pending input ids fed on the device, the sampled ids and logprobs come back through pinned buffers, and the
tokens and logprobs are the synchronous engine's, in bf16 and with FP8 weights and cache. The CPU test (tests/model/test_step_ahead.py)
covers the scheduling cases; this covers what only a GPU runs."""

from __future__ import annotations

import pytest
import torch

from model_runtime.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from model_runtime.engine import Engine
from model_runtime.request import SamplingParams
from tests.model.tiny_models import write_tiny_hf

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def _tokens(path: str, ahead: bool, quantization: str) -> tuple[dict[str, list], Engine]:
    fp8 = quantization == "fp8"
    engine = Engine(
        EngineConfig(
            model=path,
            cache=CacheConfig(num_blocks=512, dtype="fp8_e4m3" if fp8 else None),
            scheduler=SchedulerConfig(max_num_seqs=16, max_model_len=512, async_scheduling=ahead),
            device=DeviceConfig(device="cuda", dtype="bfloat16", quantization=quantization),
        ),
        emit_text=False,
    )
    prompts = [[(7 * i + j) % 90 + 5 for i in range(11 + 5 * j)] for j in range(12)]
    out: dict[str, list] = {f"r{j}": [] for j in range(len(prompts))}
    for j, prompt in enumerate(prompts):
        logprobs = 2 if j % 3 == 0 else None  # their copies to the host run beside the next step too
        params = SamplingParams(temperature=0, max_tokens=8 + 3 * j, ignore_eos=True, logprobs=logprobs)
        engine.add_request(f"r{j}", prompt, params)
    while engine.has_unfinished():
        for step in engine.step():
            out[step.request_id] += list(zip(step.token_ids, step.logprobs or [None] * len(step.token_ids)))
    return out, engine


@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_steps_scheduled_ahead_replay_graphs_and_give_the_synchronous_tokens(tmp_path, quantization) -> None:
    if quantization == "fp8" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("FP8 projections need sm_90+")
    path = str(write_tiny_hf(tmp_path, "llama"))
    sync, _ = _tokens(path, False, quantization)
    ahead, engine = _tokens(path, True, quantization)
    assert ahead == sync
    assert (
        engine.steps_ahead > 10 and engine.runner.graphs is not None and engine.runner.graphs.num_replays > 0
    )
    assert engine.pool.num_free == engine.pool.usable


def _decode_tokens(path: str, ahead: bool) -> tuple[dict[str, list[int]], Engine]:
    """A decode worker's engine (kv_receiver=True): prompts admitted as landed KV (fresh, zeroed blocks for
    both engines) with add_prefilled; requests end at different steps, so blocks are freed, and fenced when
    ahead, while later steps run."""
    engine = Engine(
        EngineConfig(
            model=path,
            cache=CacheConfig(num_blocks=512),
            scheduler=SchedulerConfig(max_num_seqs=16, max_model_len=512, async_scheduling=ahead),
            device=DeviceConfig(device="cuda", dtype="bfloat16"),
        ),
        emit_text=False,
        kv_receiver=True,
    )
    out: dict[str, list[int]] = {}
    for j in range(12):
        prompt = [(5 * i + j) % 90 + 5 for i in range(9 + 4 * j)]
        blocks = engine.pool.allocate(-(-len(prompt) // engine.config.cache.block_size))
        params = SamplingParams(temperature=0, max_tokens=6 + 3 * j, ignore_eos=True)
        engine.add_prefilled(f"r{j}", prompt, params, tuple(blocks), 11 + j)
        out[f"r{j}"] = [11 + j]
    while engine.has_unfinished():
        for step in engine.step():
            out[step.request_id] += step.token_ids
    return out, engine


def test_a_decode_workers_engine_runs_ahead_on_graphs_and_gives_back_every_fenced_block(tmp_path) -> None:
    path = str(write_tiny_hf(tmp_path, "llama"))
    sync, _ = _decode_tokens(path, False)
    ahead, engine = _decode_tokens(path, True)
    assert ahead == sync
    assert (
        engine.steps_ahead > 10 and engine.runner.graphs is not None and engine.runner.graphs.num_replays > 0
    )
    assert engine.pool.fence is None and engine.pool.num_fenced == 0
    assert engine.pool.num_free == engine.pool.usable
