"""Tensor parallelism on CPU (gloo over 127.0.0.1, one spawned process per rank, float32): TP=2 and TP=4 give
TP=1's greedy tokens through the engine, and every rank's hidden states and gathered logits match TP=1's,
through the model's forward and through the piecewise prefill forward (prefill_graphs, its pieces run eagerly
with the all-reduces between them: what the GPU captures as graphs).

The models cover each way a shape is split: GQA with 2 KV heads (one per rank at TP=2, each replicated on two
ranks at TP=4), a vocabulary of 515 that no rank count divides (padded last shard), Qwen2 with q/k/v biases,
tied embeddings and a single KV head (replicated on every rank), a GGUF file (Q8_0, llama's Q/K row order) and
dummy weights. One set of rank processes per TP size runs every check (starting processes dominates).
"""

from __future__ import annotations

import functools
import random

import gguf
import pytest
import torch

from model_runtime.config import ConfigError, EngineConfig, ParallelConfig
from model_runtime.engine import Engine
from model_runtime.parallel.shard import TPShard
from model_runtime.parallel.weights import cut_fused, load_weight_shard
from model_runtime.weights import load_model_config, load_weights, resolve_model
from model_runtime.weights.canonical import canonical_layout
from model_runtime.weights.hf import SafetensorsSource
from tests.model import tp_ranks
from tests.model.tiny_models import tiny_vocab_size, write_tiny_gguf, write_tiny_hf

pytestmark = pytest.mark.model

SHARP_INIT = 0.4  # peaky attention and logits: position handling decides the tokens, near-ties are rare
MAX_NEW = 16
ATOL = 1e-4


def prompts() -> list[list[int]]:
    rng = random.Random(18)
    return [[rng.randrange(3, tiny_vocab_size()) for _ in range(n)] for n in (1, 3, 5, 9, 17)]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    where = tmp_path_factory.mktemp("tp-models")
    return {
        "llama": str(write_tiny_hf(where, "llama", initializer_range=SHARP_INIT, vocab_size=515)),
        "qwen2-mqa-tied": str(
            write_tiny_hf(where, "qwen2", tie=True, initializer_range=SHARP_INIT, num_key_value_heads=1)
        ),
        "gguf": str(write_tiny_gguf(where, "llama", qtypes=(gguf.GGMLQuantizationType.Q8_0,))),
        "dummy": "dummy:tiny-llama",
    }


CHECKS = {
    2: [
        ("greedy", "llama"),
        ("steps", "llama"),
        ("greedy", "qwen2-mqa-tied"),
        ("steps", "qwen2-mqa-tied"),
        ("greedy", "gguf"),
        ("steps", "dummy"),
        ("steps-pieces", "llama"),
        ("steps-pieces", "qwen2-mqa-tied"),
    ],
    4: [("greedy", "llama"), ("steps", "llama"), ("steps", "qwen2-mqa-tied"), ("steps-pieces", "llama")],
}


def _checks(tp: int, models: dict[str, str]) -> list[tuple[str, str, object]]:
    batches = tp_ranks.prefill_then_decode(prompts())
    return [
        (kind, models[name], (prompts(), MAX_NEW) if kind == "greedy" else batches)
        for kind, name in CHECKS[tp]
    ]


@pytest.fixture(scope="module")
def results(models: dict[str, str]):
    """results(tp) -> {(kind, model name): (TP=1's result, [each rank's result])}, computed once per tp."""

    @functools.cache
    def run(tp: int) -> dict:
        checks = _checks(tp, models)
        reference = tp_ranks.run_checks(None, checks)
        per_rank = tp_ranks.run_ranks(tp_ranks.run_checks, tp, checks, timeout_s=300)
        return {key: (reference[i], [ranks[i] for ranks in per_rank]) for i, key in enumerate(CHECKS[tp])}

    return run


CASES = [(tp, kind, name) for tp, checks in CHECKS.items() for kind, name in checks]


@pytest.mark.parametrize(("tp", "kind", "name"), CASES, ids=[f"tp{t}-{k}-{n}" for t, k, n in CASES])
def test_tensor_parallel_matches_one_device(results, tp: int, kind: str, name: str) -> None:
    reference, ranks = results(tp)[(kind, name)]
    tp_ranks.assert_matches_one_device(tp, kind, reference, ranks, len(prompts()), ATOL)


@pytest.mark.parametrize(
    ("tp", "message"),
    [
        (3, r"^parallel\.tensor_parallel_size: 3 must divide model\.num_heads \(4\)"),
        (8, r"^parallel\.tensor_parallel_size: 8 must divide model\.num_heads \(4\)"),
        (2, r"^parallel\.tensor_parallel_size: 2 ranks need a tensor-parallel group"),
    ],
)
def test_engine_refuses_a_tensor_parallel_size_it_cannot_run(tp: int, message: str) -> None:
    config = EngineConfig.from_dict(
        {"model": "dummy:tiny-llama", "device": {"device": "cpu"}, "parallel": {"tensor_parallel_size": tp}}
    )
    with pytest.raises(ConfigError, match=message):
        Engine(config)


def test_a_rank_reads_only_its_slices_of_a_safetensors_checkpoint(tmp_path, monkeypatch) -> None:
    """Sharded loading reads each sliced tensor by its slice (norms whole), and gives the rows of the whole
    model's canonical tensors that the rule assigns to the rank."""
    source = resolve_model(str(write_tiny_hf(tmp_path, "llama", vocab_size=515)))
    model = load_model_config(source)
    whole = load_weights(source, model, torch.float32)
    read_whole: list[str] = []
    get = SafetensorsSource.get
    monkeypatch.setattr(
        SafetensorsSource, "get", lambda self, name: read_whole.append(name) or get(self, name)
    )
    layout = canonical_layout(model)
    for rank in range(2):
        shard = TPShard.plan(model, ParallelConfig(2), rank)
        ours = load_weight_shard(source, model, shard, torch.float32)
        assert all("norm" in name for name in read_whole), read_whole
        for name, tensor in ours.items():
            torch.testing.assert_close(tensor, cut_fused(layout[name], whole[name], shard), rtol=0, atol=0)
        # 515 rows over 2 ranks: 258 each, the last rank's 258th a zero row (never sampled: cut after the gather).
        assert (ours["lm_head.weight"].shape[0], len(shard.vocab)) == (258, 258 - rank)
        assert not ours["lm_head.weight"][len(shard.vocab) :].any()
