"""Engine(emit_text=False), as the workers run it: no text on the engine thread, the same tokens and the same
token-rule verdicts (EOS, stop ids, max_tokens, the context) as the engine with text."""

from __future__ import annotations

import pytest

from model_runtime.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from model_runtime.engine import Engine, StepOutput
from model_runtime.request import SamplingParams
from tests.model.tiny_models import write_tiny_hf

pytestmark = pytest.mark.unit
PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> EngineConfig:
    return EngineConfig(
        model=str(write_tiny_hf(tmp_path_factory.mktemp("emit_text"))),
        cache=CacheConfig(block_size=4, num_blocks=256),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
        device=DeviceConfig(device="cpu"),
    )


@pytest.fixture(scope="module")
def engines(config: EngineConfig) -> tuple[Engine, Engine]:
    return Engine(config), Engine(config, emit_text=False)


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[StepOutput]]:
    outputs: dict[str, list[StepOutput]] = {rid: [] for rid in requests}
    for rid, (prompt, sampling) in requests.items():
        engine.add_request(rid, prompt, sampling)
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out)
    return outputs


def summary(outs: list[StepOutput]) -> tuple[list[int], str | None, int | str | None]:
    return [t for o in outs for t in o.token_ids], outs[-1].finish_reason, outs[-1].stop_reason


def test_token_rules_give_the_same_verdicts_without_text(engines: tuple[Engine, Engine]) -> None:
    with_text, ids_only = engines
    greedy = run(with_text, {"probe": (PROMPT, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))})
    first, second = summary(greedy["probe"])[0][:2]
    context = with_text.max_model_len
    requests = {
        "one": (PROMPT, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)),
        "stop_first": (PROMPT, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=(first,))),
        "stop_second": (
            PROMPT,
            SamplingParams(temperature=0, max_tokens=8, stop_token_ids=(second,), ignore_eos=True),
        ),
        "eos_first": (PROMPT, SamplingParams(temperature=0, max_tokens=8)),
        "length": (PROMPT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)),
        "context": ([5] * (context - 3), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)),
        "seeded": (PROMPT, SamplingParams(temperature=0.8, seed=3, max_tokens=7)),
    }
    # EOS as the first token: the tiny model's EOS is made the token greedy decoding picks first.
    saved = with_text.eos_token_ids
    with_text.eos_token_ids = ids_only.eos_token_ids = (first,)
    try:
        want, got = run(with_text, requests), run(ids_only, requests)
    finally:
        with_text.eos_token_ids = ids_only.eos_token_ids = saved
    for rid in requests:
        assert summary(got[rid]) == summary(want[rid]), rid
        assert all(o.text == "" for o in got[rid]), rid
    assert summary(want["one"])[1:] == ("length", None)
    assert summary(want["stop_first"])[1:] == ("stop", first)
    assert summary(want["stop_second"]) == ([first, second], "stop", second)
    assert summary(want["eos_first"]) == ([first], "stop", first)
    tokens, reason, _ = summary(want["context"])
    assert (len(tokens), reason) == (3, "length")  # the context ends it before max_tokens
    assert "".join(o.text for o in want["length"])  # the engine with text still makes text


def test_a_prefilled_first_token_that_ends_the_request_says_why(engines: tuple[Engine, Engine]) -> None:
    _, ids_only = engines
    blocks = tuple(ids_only.pool.allocate(2))
    done = ids_only.add_prefilled("pre", PROMPT, SamplingParams(max_tokens=1), blocks, first_token=11)
    assert done is not None and (done.token_ids, done.finish_reason, done.text) == ([11], "length", "")
    assert ids_only.pool.num_used == 0
