"""model_runtime.heap: an engine's long-lived objects kept out of Python's full collections while it runs (on one
H200 such collections stalled a decode step for 137-163 ms; frozen, 3.6-4.3 ms)."""

from __future__ import annotations

import gc

import pytest

from model_runtime.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from model_runtime.heap import freeze_startup_objects, frozen_while_running, thaw
from model_runtime.llm import LLM
from model_runtime.request import PromptInput, SamplingParams

pytestmark = pytest.mark.unit


def test_a_run_freezes_what_exists_and_thaws_it_after_unless_it_was_frozen_already() -> None:
    thaw()  # whatever an earlier test of this process left frozen
    assert gc.get_freeze_count() == 0
    with frozen_while_running():
        assert gc.get_freeze_count() > 1000  # everything imported and built so far
    assert gc.get_freeze_count() == 0
    freeze_startup_objects()  # a worker, once started
    try:
        frozen = gc.get_freeze_count()
        with frozen_while_running():
            pass
        # The worker's freeze is left as it was: not thawed (0) nor frozen again (more). A frozen object may still
        # die meanwhile (another thread of the test process drops its last reference), so the count may fall a
        # little: a clean clone's run saw 605,374 of 605,376.
        assert 0.99 * frozen <= gc.get_freeze_count() <= frozen
    finally:
        thaw()
    assert gc.get_freeze_count() == 0


def test_llm_generate_runs_its_steps_with_the_engine_frozen_and_thaws_it_after() -> None:
    llm = LLM(
        config=EngineConfig(
            model="dummy:tiny-llama",
            cache=CacheConfig(block_size=4, num_blocks=64),
            scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
            device=DeviceConfig(device="cpu"),
        )
    )
    step, seen = llm.engine.step, []

    def counting_step():
        seen.append(gc.get_freeze_count())
        return step()

    llm.engine.step = counting_step  # type: ignore[method-assign]
    thaw()  # nothing frozen before the run, so the run's own freeze is what the steps see
    prompts = [PromptInput(token_ids=[1, 2, 3, 4, 5]), PromptInput(token_ids=[6, 7, 8])]
    done = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert [len(c.token_ids) for c in done] == [4, 4]
    assert len(seen) >= 4 and min(seen) > 0  # every step ran with the engine's objects frozen
    assert gc.get_freeze_count() == 0
