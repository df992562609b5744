"""kv_transfer.shard_plan: the heterogeneous TP handoff's map. Every (prefill TP, decode TP, KV heads) the issue
names is simulated: each prefill rank's cache is cut from a model-wide KV tensor by the ranks' own rule
(model_runtime.parallel.shard.TPShard, as the engine builds them), the plan's pieces are copied into empty decode
rank caches, and every decode rank must end up holding exactly what TPShard says its cache holds."""

from __future__ import annotations

import itertools

import pytest
import torch

from kv_transfer.shard_plan import TP_SIZES, handoff_plan, pieces_from, pieces_to
from model_runtime.config import ConfigError, ModelConfig, ParallelConfig
from model_runtime.parallel.shard import TPShard

pytestmark = pytest.mark.unit

HEAD_COUNTS = (1, 2, 4, 8, 16)


def _model(kv_heads: int) -> ModelConfig:
    return ModelConfig(
        architecture="llama", vocab_size=64, hidden_size=512, intermediate_size=1024, num_layers=1,
        num_heads=16, num_kv_heads=kv_heads, head_dim=32, max_position_embeddings=128,
    )  # fmt: skip


def _caches(model_kv: torch.Tensor, model: ModelConfig, tp: int) -> list[torch.Tensor]:
    """Each rank's cache [its heads, ...] as the engine's shard rule cuts it."""
    ranks = [TPShard.plan(model, ParallelConfig(tensor_parallel_size=tp), r) for r in range(tp)]
    return [model_kv[shard.kv_heads.start : shard.kv_heads.stop].clone() for shard in ranks]


def _valid(tp: int, heads: int) -> bool:
    return heads % tp == 0 or tp % heads == 0


@pytest.mark.parametrize("heads", HEAD_COUNTS)
def test_every_decode_rank_ends_up_with_exactly_its_heads(heads: int) -> None:
    model = _model(heads)
    model_kv = torch.randn(heads, 5, 3)  # a stand-in for [heads, blocks, ...]: each head's values distinct
    for source_tp, target_tp in itertools.product(TP_SIZES, TP_SIZES):
        if not (_valid(source_tp, heads) and _valid(target_tp, heads)):
            continue
        sources = _caches(model_kv, model, source_tp)
        want = _caches(model_kv, model, target_tp)
        got = [torch.full_like(w, float("nan")) for w in want]
        plan = handoff_plan(source_tp, target_tp, heads)
        for p in plan:
            dst = got[p.target_rank][p.target_head : p.target_head + p.num_heads]
            assert bool(dst.isnan().all()), f"{source_tp}->{target_tp}: a head written twice: {p}"
            dst.copy_(sources[p.source_rank][p.source_head : p.source_head + p.num_heads])
        for rank, (g, w) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(g, w), f"{source_tp}->{target_tp} with {heads} heads: decode rank {rank}"
        by_source = [p for r in range(source_tp) for p in pieces_from(plan, r)]
        by_target = [p for r in range(target_tp) for p in pieces_to(plan, r)]
        assert sorted(by_source, key=repr) == sorted(plan, key=repr) and by_target == list(plan)


def test_equal_layouts_pair_rank_to_rank_whole_cache() -> None:
    for tp, heads in ((1, 8), (2, 8), (4, 8), (8, 8), (8, 2), (4, 1)):
        plan = handoff_plan(tp, tp, heads)
        local = max(1, heads // tp)
        assert [(p.source_rank, p.target_rank, p.source_head, p.target_head, p.num_heads) for p in plan] == [
            (r, r, 0, 0, local) for r in range(tp)
        ]


def test_a_replicated_head_is_sent_by_different_replicas_and_runs_are_merged() -> None:
    # 2 KV heads on 8 prefill ranks: head 0 on ranks 0-3, head 1 on ranks 4-7; a TP=2 decode worker takes each
    # from the replica its rank picks. A TP=1 decode worker gets both heads, one piece per source rank.
    assert [(p.source_rank, p.target_rank) for p in handoff_plan(8, 2, 2)] == [(0, 0), (5, 1)]
    assert [(p.source_rank, p.source_head, p.target_head) for p in handoff_plan(8, 1, 2)] == [
        (0, 0, 0),
        (4, 0, 1),
    ]
    # 8 heads from TP=1 to TP=2: one merged run of 4 heads per decode rank, not 4 single heads.
    assert [(p.source_head, p.target_head, p.num_heads) for p in handoff_plan(1, 2, 8)] == [
        (0, 0, 4),
        (4, 0, 4),
    ]


def test_sizes_that_do_not_split_the_heads_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="decode tensor_parallel_size: must be one of"):
        handoff_plan(2, 3, 8)
    with pytest.raises(
        ConfigError, match="prefill tensor_parallel_size 8 does not divide the model's 12 KV heads"
    ):
        handoff_plan(8, 2, 12)
