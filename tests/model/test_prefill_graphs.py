"""model_runtime.prefill_graphs on CPU: the model cut at its attentions, run piece by piece over padded static
buffers (what the GPU captures as graphs), computes what the model's own forward computes, for prompt-only and
mixed steps, with and without a cached prefix, and writes the same KV; an engine using it generates the same
greedy tokens. The capture itself is checked on a GPU (tests/gpu/test_prefill_graphs_gpu.py)."""

from __future__ import annotations

import random

import pytest
import torch

from model_runtime.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from model_runtime.engine import Engine
from model_runtime.prefill_graphs import PiecewiseForward, PrefillGraphs, prefill_graph_sizes
from model_runtime.request import SamplingParams
from tests.model.tiny_models import write_tiny_hf

pytestmark = pytest.mark.model
MAX_TOKENS = 96


def make_engine(path: str, cache_dtype: str | None = None) -> Engine:
    config = EngineConfig(
        model=path,
        cache=CacheConfig(block_size=4, num_blocks=256, dtype=cache_dtype),
        scheduler=SchedulerConfig(max_num_batched_tokens=MAX_TOKENS, max_num_seqs=8, max_model_len=256),
        device=DeviceConfig(device="cpu", dtype="float32"),
    )
    return Engine(config, emit_text=False)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return str(write_tiny_hf(tmp_path_factory.mktemp("prefill-graphs"), "llama", num_hidden_layers=3))


def with_pieces(engine: Engine, kv_store: bool = False) -> PrefillGraphs:
    """The pieces, run directly (no graphs); `kv_store`: they store each layer's K/V into the engine's cache
    (device.prefill_graph_kv_store) and the eager attentions only attend."""
    kv_pages = engine.runner.kv_pages if kv_store else None
    pieces = PrefillGraphs(engine.runner.model, MAX_TOKENS, use_graphs=False, kv_pages=kv_pages)
    engine.runner.prefill_graphs = pieces
    return pieces


def prompts(seed: int, lengths: list[int], vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def test_sizes_cover_every_step_up_to_the_largest() -> None:
    assert prefill_graph_sizes(1) == (1,)
    assert prefill_graph_sizes(100) == (16, 32, 64, 100)
    assert prefill_graph_sizes(1024)[-1] == 1024 and prefill_graph_sizes(2048)[-1] == 2048
    with pytest.raises(ValueError, match="max_tokens"):
        prefill_graph_sizes(0)


def test_config_names_the_field_for_a_negative_size() -> None:
    with pytest.raises(ValueError, match=r"device\.prefill_graph_tokens"):
        DeviceConfig(prefill_graph_tokens=-1)


STORES = pytest.mark.parametrize("kv_store", [False, True], ids=["store-eager", "store-in-pieces"])


@pytest.mark.parametrize(
    ("kv_store", "cache_dtype"),
    [(False, None), (True, None), (True, "fp8_e4m3")],
    ids=["store-eager", "store-in-pieces", "store-in-pieces-fp8-cache"],
)
def test_each_piecewise_step_equals_the_eager_forward(
    tiny_path: str, kv_store: bool, cache_dtype: str | None
) -> None:
    """Steps of several shapes, each run both ways from the same cache: prompts alone (padded to a bucket),
    prompts beside decodes, a prompt over a cached prefix; logits and the written KV must agree (with the store
    in the pieces: the padding rows, whose slots are -1, write nothing, though earlier larger steps left
    real slots in those rows of the static buffer)."""
    engine = make_engine(tiny_path, cache_dtype)
    runner, sched = engine.runner, engine.scheduler
    pieces = with_pieces(engine, kv_store)
    vocab = engine.model_config.vocab_size
    system = prompts(1, [24], vocab)[0]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    waves = [
        prompts(2, [5, 37], vocab),
        prompts(3, [11], vocab),
        [system + p for p in prompts(4, [9], vocab)],
    ]
    engine.add_request("system", system, params)  # its blocks stay cached for the last wave
    shapes = []
    for w, wave in enumerate(waves):
        for i, prompt in enumerate(wave):
            engine.add_request(f"w{w}-{i}", prompt, params)
        for _ in range(2):  # the wave's prompts, then their first decode beside others' (mixed or not)
            out = sched.schedule()
            before = runner.kv_cache.clone()
            eager = runner.execute(out, use_graphs=False)
            eager_cache = runner.kv_cache.clone()
            runner.kv_cache.copy_(before)
            runs = pieces.num_runs
            cut = runner.execute(out)
            decodes = sum(c.num_tokens == 1 for c in out.chunks)
            if decodes < len(out.chunks):  # a step with a prompt chunk takes the pieces
                assert pieces.num_runs == runs + 1
                shapes.append((out.num_tokens, decodes, max(c.request.num_cached_tokens for c in out.chunks)))
            torch.testing.assert_close(cut, eager, atol=2e-5, rtol=2e-5)
            if cache_dtype is None:
                torch.testing.assert_close(runner.kv_cache, eager_cache, atol=2e-5, rtol=2e-5)
            else:  # codes and scales as bytes: the same rows quantized the same way
                assert torch.equal(runner.kv_cache.view(torch.uint8), eager_cache.view(torch.uint8))
            sched.advance(out)
            for chunk, token in zip(out.chunks, eager.argmax(-1).tolist()):
                if chunk.sample:
                    sched.append_token(chunk.request, token)
    assert any(decodes for _, decodes, _ in shapes), f"no mixed step among {shapes}"
    assert any(cached for _, _, cached in shapes), f"no step over a cached prefix among {shapes}"
    assert any(n not in pieces.sizes for n, _, _ in shapes), "no step was padded to a larger bucket"


@STORES
def test_an_engine_on_pieces_generates_the_eager_engines_tokens(tiny_path: str, kv_store: bool) -> None:
    batch = prompts(5, [3, 17, 40, 64, 8], 100)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = []
    for cut in (False, True):
        engine = make_engine(tiny_path)
        pieces = with_pieces(engine, kv_store) if cut else None
        for i, prompt in enumerate(batch):
            engine.add_request(f"r{i}", prompt, params)
        out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(batch))}
        while engine.has_unfinished():
            for step in engine.step():
                out[step.request_id] += step.token_ids
        tokens.append(out)
        if pieces is not None:
            assert pieces.num_runs > 0
    assert tokens[0] == tokens[1]
    assert all(len(t) == 12 for t in tokens[1].values())


def test_the_layer_hook_sees_every_layer_in_order(tiny_path: str) -> None:
    engine = make_engine(tiny_path)
    with_pieces(engine)
    seen: list[int] = []
    engine.runner.model.layer_hook = seen.append
    engine.add_request("hooked", list(range(3, 30)), SamplingParams(temperature=0, max_tokens=1))
    out = engine.scheduler.schedule()
    engine.runner.execute(out, layer_hook=seen.append)
    assert seen == [1, 2, 3]


def test_a_tensor_parallel_or_foreign_model_is_refused_with_the_reason() -> None:
    assert PiecewiseForward.unsupported(torch.nn.Linear(2, 2)) is not None
    with pytest.raises(ValueError, match="PiecewiseForward: needs a LlamaForCausalLM"):
        PiecewiseForward(torch.nn.Linear(2, 2), 16)  # type: ignore[arg-type]
