"""Piecewise prefill CUDA graphs (model_runtime.prefill_graphs) on a GPU: every piece of every bucket is
captured at start-up; a step with prompt chunks replays them, with attention eager between, and computes what
the eager forward computes (padding rows write no KV), prompts alone, beside decodes and over a cached prefix,
with the KV store eager or inside the pieces' graphs (device.prefill_graph_kv_store, an FP8 cache too);
an engine on graphs generates the eager engine's greedy tokens; a step larger than the largest bucket runs
eagerly."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from model_runtime.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from model_runtime.engine import Engine
from model_runtime.prefill_graphs import prefill_graph_sizes
from model_runtime.request import SamplingParams
from tests.gpu.graphs_vs_eager import graphs_and_eager_tokens
from tests.gpu.test_engine_gpu import written_slots
from tests.model.tiny_models import write_tiny_hf

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BUDGET = 256  # tokens per step: graphs up to 256 (the default 1024 capped by the scheduler's budget)


def make_engine(
    path: Path,
    dtype: str,
    budget: int = BUDGET,
    graph_tokens: int = 1024,
    kv_store: bool = False,
    cache_dtype: str | None = None,
) -> Engine:
    config = EngineConfig(
        model=str(path),
        cache=CacheConfig(block_size=16, num_blocks=512, dtype=cache_dtype),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=16, max_model_len=1024),
        device=DeviceConfig(
            device="cuda", dtype=dtype, prefill_graph_tokens=graph_tokens, prefill_graph_kv_store=kv_store
        ),
    )
    return Engine(config, emit_text=False)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    return write_tiny_hf(tmp_path_factory.mktemp("prefill-graphs-gpu"), "llama", initializer_range=0.4)


@pytest.mark.parametrize(
    ("dtype", "kv_store", "cache_dtype"),
    [
        ("float32", False, None),
        ("bfloat16", False, None),
        ("float32", True, None),  # the pieces' graphs store each layer's K/V (device.prefill_graph_kv_store)
        ("bfloat16", True, None),
        ("bfloat16", True, "fp8_e4m3"),
    ],
    ids=[
        "float32",
        "bfloat16",
        "float32-store-in-graphs",
        "bfloat16-store-in-graphs",
        "fp8-cache-store-in-graphs",
    ],
)
def test_replayed_pieces_equal_the_eager_forward(
    tiny_path: Path, dtype: str, kv_store: bool, cache_dtype: str | None
) -> None:
    engine = make_engine(tiny_path, dtype, kv_store=kv_store, cache_dtype=cache_dtype)
    try:
        runner, sched = engine.runner, engine.scheduler
        pieces = runner.prefill_graphs
        assert pieces is not None and pieces.sizes == prefill_graph_sizes(BUDGET)
        assert pieces.use_graphs and pieces.can_run(BUDGET) and not pieces.can_run(BUDGET + 1)
        rng = random.Random(7)
        vocab = engine.model_config.vocab_size
        system = [rng.randrange(3, vocab) for _ in range(48)]
        params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        engine.add_request("system", system, params)
        waves = [[5, 37, 100], [19], [9]]
        tol = 2e-5 if dtype == "float32" else 2e-2
        mixed = cached = 0
        for w, lengths in enumerate(waves):
            for i, n in enumerate(lengths):
                prefix = system if w == 2 else []
                engine.add_request(f"w{w}-{i}", prefix + [rng.randrange(3, vocab) for _ in range(n)], params)
            for _ in range(2):
                out = sched.schedule()
                live = {
                    engine.layout.slot(c.request.block_ids, c.request.num_computed_tokens + j)
                    for c in out.chunks
                    for j in range(c.num_tokens)
                }
                before = runner.kv_cache.clone()
                eager = runner.execute(out, use_graphs=False)
                eager_cache = runner.kv_cache.clone()
                runner.kv_cache.copy_(before)
                runs = pieces.num_runs
                graph = runner.execute(out)
                if any(c.num_tokens > 1 for c in out.chunks):
                    assert pieces.num_runs == runs + 1, "a step with a prompt chunk did not replay the pieces"
                    mixed += any(c.num_tokens == 1 for c in out.chunks)
                    cached += any(c.request.num_cached_tokens for c in out.chunks)
                assert written_slots(engine, before) <= live, "padding rows wrote KV"
                if cache_dtype is None:
                    torch.testing.assert_close(
                        runner.kv_cache.float(), eager_cache.float(), atol=tol, rtol=tol
                    )
                else:  # codes and scales: a bucket's GEMM shape may round a value across a code boundary
                    differ = runner.kv_cache.view(torch.uint8) != eager_cache.view(torch.uint8)
                    assert differ.float().mean().item() <= 0.01, f"{int(differ.sum())} cache bytes differ"
                scale = max(1.0, eager.abs().max().item())
                assert (graph - eager).abs().max().item() <= tol * 50 * scale
                sched.advance(out)
                for chunk, token in zip(out.chunks, eager.argmax(-1).tolist()):
                    if chunk.sample:
                        sched.append_token(chunk.request, token)
        assert mixed and cached, f"mixed steps {mixed}, steps over a cached prefix {cached}"
    finally:
        engine.close()


def test_a_step_past_the_largest_bucket_runs_eagerly(tiny_path: Path) -> None:
    engine = make_engine(tiny_path, "bfloat16", budget=512, graph_tokens=128)
    try:
        pieces = engine.runner.prefill_graphs
        assert pieces is not None and pieces.max_tokens == 128
        engine.add_request("long", list(range(3, 303)), SamplingParams(temperature=0, max_tokens=2))
        runs = pieces.num_runs
        engine.step()  # 300 prompt tokens: eager
        assert pieces.num_runs == runs
    finally:
        engine.close()


def test_an_engine_on_graphs_generates_the_eager_engines_tokens(tmp_path: Path) -> None:
    def check(engine: Engine) -> None:
        assert (engine.runner.prefill_graphs is None) == (engine.runner.graphs is None)

    graphs, eager = graphs_and_eager_tokens(
        tmp_path, CacheConfig(block_size=16, num_blocks=256), "none", check
    )
    assert graphs == eager
