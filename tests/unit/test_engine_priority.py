"""The engine passes a request's priority class to its scheduler (add_request): with one sequence slot, an
interactive prompt added after a batch one runs first, on a real (tiny, CPU) model."""

from __future__ import annotations

import pytest

from model_runtime.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from model_runtime.engine import Engine
from model_runtime.request import Priority, SamplingParams
from tests.model.tiny_models import write_tiny_hf

pytestmark = pytest.mark.unit


def test_an_interactive_prompt_added_after_a_batch_one_runs_first(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    config = EngineConfig(
        model=str(write_tiny_hf(tmp_path_factory.mktemp("priority"))),
        cache=CacheConfig(block_size=4, num_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64),
        device=DeviceConfig(device="cpu"),
    )
    engine = Engine(config, emit_text=False)
    sampling = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("b", [5, 6, 7, 8], sampling, priority=Priority.BATCH)
    engine.add_request("i", [9, 10, 11, 12], sampling, priority=Priority.INTERACTIVE)
    engine.add_request("n", [13, 14, 15], sampling)  # no class given: interactive, behind "i"
    order: list[str] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id not in order:
                order.append(out.request_id)
    assert order == ["i", "n", "b"]
