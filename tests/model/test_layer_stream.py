"""model_runtime.layer_stream with a real (tiny, CPU) prefill-only engine: a listened-to prompt's KV is handed
over in layer groups during the step that completes it, the listener holds its own reference on the blocks, and
what it is handed is the prompt's final KV."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from model_runtime.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from model_runtime.engine import Engine
from model_runtime.layer_stream import group_ends
from model_runtime.request import SamplingParams
from model_runtime.request_rules import InvalidRequest
from tests.model.tiny_models import write_tiny_hf

pytestmark = pytest.mark.model
LAYERS = 6


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    path = write_tiny_hf(tmp_path_factory.mktemp("layer-stream"), "llama", num_hidden_layers=LAYERS)
    config = EngineConfig(
        model=str(path),
        cache=CacheConfig(block_size=4, num_blocks=128, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4),
        device=DeviceConfig(device="cpu", dtype="float32"),
    )
    return Engine(config, prefill_only=True, emit_text=False)


@dataclass
class Recorder:
    """Copies what it is handed at the moment it is handed (as a transfer thread would read it)."""

    engine: Engine
    accept: bool = True
    calls: list[tuple[tuple[int, ...], int, int, int]] = field(default_factory=list)
    copies: list[torch.Tensor] = field(default_factory=list)
    refs_seen: list[int] = field(default_factory=list)

    def layers_written(self, block_ids, num_tokens, layer_begin, layer_end, ready) -> bool:
        assert ready is None  # CPU: the layers' kernels already ran
        self.calls.append((block_ids, num_tokens, layer_begin, layer_end))
        cache = self.engine.runner.kv_cache
        self.copies.append(cache[layer_begin:layer_end, :, list(block_ids)].clone())
        self.refs_seen.append(self.engine.pool.ref_count(block_ids[0]))
        return self.accept


def _run(engine: Engine, rid: str) -> list:
    outputs = []
    while engine.has_unfinished():
        outputs += [o for o in engine.step() if o.request_id == rid]
    return outputs


def test_group_ends_keep_the_last_layer_alone_and_split_the_rest_evenly() -> None:
    assert group_ends(32, 4) == (10, 21, 31, 32)  # the tail after the forward pass moves one layer's KV
    assert group_ends(6, 4) == (2, 3, 5, 6)
    assert group_ends(3, 8) == (1, 2, 3)  # never more groups than layers
    assert group_ends(5, 1) == (5,)
    assert group_ends(5, 2) == (4, 5)
    for layers in range(1, 40):
        for groups in range(1, 9):
            ends = group_ends(layers, groups)
            assert ends[-1] == layers and len(ends) == min(groups, layers)
            assert list(ends) == sorted(set(ends)) and ends[0] >= 1
            if len(ends) > 1:
                assert ends[-2] == layers - 1
    with pytest.raises(ValueError):
        group_ends(4, 0)


def test_a_prompt_is_handed_over_in_groups_during_its_last_step(engine: Engine) -> None:
    prompt = [(7 * i) % 90 + 5 for i in range(37)]  # 3 chunks of at most 16 tokens
    recorder = Recorder(engine)
    engine.add_request("a", prompt, SamplingParams(max_tokens=4))
    engine.stream_layers("a", recorder, groups=3)
    first = _run(engine, "a")[0]
    assert [c[2:] for c in recorder.calls] == [(0, 2), (2, 5), (5, 6)]  # one step, every layer once
    assert all(c[0] == first.kv_block_ids and c[1] == len(prompt) for c in recorder.calls)
    cache = engine.runner.kv_cache
    final = cache[:, :, list(first.kv_block_ids)]
    for (_, _, begin, end), copy in zip(recorder.calls, recorder.copies):
        assert torch.equal(copy, final[begin:end])  # what was handed over is the prompt's final KV
    # The engine detached its blocks to the caller; the listener holds one more reference on each.
    assert recorder.refs_seen[0] == 1 and recorder.refs_seen[1] == 2
    assert all(engine.pool.ref_count(b) == 2 for b in first.kv_block_ids)
    engine.release_blocks(first.kv_block_ids)  # the caller's
    engine.release_blocks(first.kv_block_ids)  # the listener's (a transfer's on_release)
    assert engine.pool.num_used == 0


def test_a_listener_that_declines_is_not_called_again_and_holds_nothing(engine: Engine) -> None:
    recorder = Recorder(engine, accept=False)
    engine.add_request("b", list(range(5, 30)), SamplingParams(max_tokens=4))
    engine.stream_layers("b", recorder, groups=6)
    first = _run(engine, "b")[0]
    assert len(recorder.calls) == 1
    assert all(engine.pool.ref_count(b) == 1 for b in first.kv_block_ids)
    engine.release_blocks(first.kv_block_ids)
    assert engine.pool.num_used == 0


class Broken:
    def layers_written(self, *args) -> bool:
        raise RuntimeError("a listener bug")


def test_a_failing_listener_does_not_fail_the_step(engine: Engine) -> None:
    engine.add_request("d", list(range(5, 30)), SamplingParams(max_tokens=4))
    engine.stream_layers("d", Broken(), groups=3)
    first = _run(engine, "d")[0]
    assert len(first.token_ids) == 1 and all(engine.pool.ref_count(b) == 1 for b in first.kv_block_ids)
    engine.release_blocks(first.kv_block_ids)
    assert engine.pool.num_used == 0


def test_an_aborted_prompt_hands_nothing_over(engine: Engine) -> None:
    recorder = Recorder(engine)
    engine.add_request("c", list(range(5, 60)), SamplingParams(max_tokens=4))
    engine.stream_layers("c", recorder, groups=2)
    engine.step()  # its first chunk
    engine.abort("c")
    while engine.has_unfinished():
        engine.step()
    assert recorder.calls == [] and engine.pool.num_used == 0
    with pytest.raises(InvalidRequest, match="not running"):
        engine.stream_layers("c", recorder, groups=2)
