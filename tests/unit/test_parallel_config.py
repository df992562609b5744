"""Tensor-parallel configuration and sharding from plain values: the config's errors, each rank's share of a
model, the KV layout's fingerprint per shard, and the step record the lead broadcasts."""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest
import torch

from deploy.config import HANDOFF_TP_SIZES, parse_config
from kv_transfer.shard_plan import TP_SIZES
from model_runtime.config import ConfigError, EngineConfig, ModelConfig, ParallelConfig
from model_runtime.kv_layout import KVLayout, KVShard
from model_runtime.parallel.fast_all_reduce import FastAllReduce
from model_runtime.parallel.shard import TPShard
from model_runtime.parallel.step_sync import decode, encode
from model_runtime.roles import WorkerRole
from tests.model.tp_ranks import prefill_then_decode

pytestmark = pytest.mark.unit

FIELD = "parallel.tensor_parallel_size"


def model(heads: int = 4, kv: int = 2, intermediate: int = 128, vocab: int = 515) -> ModelConfig:
    return ModelConfig(
        architecture="llama",
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=intermediate,
        num_layers=2,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=16,
        max_position_embeddings=128,
    )


@pytest.mark.parametrize("size", [0, -2, "2", 1.0, True])
def test_tensor_parallel_size_must_be_a_positive_integer(size: object) -> None:
    with pytest.raises(ConfigError, match=f"^{FIELD}: must be a positive integer"):
        ParallelConfig(tensor_parallel_size=size)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("shape", "tp", "what"),
    [
        ({}, 3, r"3 must divide model.num_heads \(4\)"),
        ({}, 8, r"8 must divide model.num_heads \(4\)"),  # more ranks than heads
        ({"heads": 6, "kv": 3}, 2, r"2 and model.num_kv_heads \(3\) must divide one another"),
        ({"intermediate": 126}, 4, r"4 must divide model.intermediate_size \(126\)"),
    ],
)
def test_a_shape_that_cannot_be_split_names_the_field(shape: dict, tp: int, what: str) -> None:
    with pytest.raises(ConfigError, match=f"^{FIELD}: {what}"):
        TPShard.plan(model(**shape), ParallelConfig(tp), rank=0)


def test_the_all_reduce_path_is_auto_or_nccl_and_a_cpu_tensor_never_takes_symmetric_memory() -> None:
    assert ParallelConfig().all_reduce == "auto"
    assert EngineConfig.from_dict({"parallel": {"all_reduce": "nccl"}}).parallel.all_reduce == "nccl"
    with pytest.raises(
        ConfigError, match=r"^engine\.parallel\.all_reduce: must be one of auto, nccl, got 'mpi'"
    ):
        EngineConfig.from_dict({"parallel": {"all_reduce": "mpi"}})
    # The fast path declines what it cannot sum (the caller then runs NCCL or gloo): a CPU tensor here.
    fast = FastAllReduce(torch.zeros(1 << 20, dtype=torch.uint8), "unused")
    assert fast(torch.ones(4, 64)) is None


def test_engine_and_deploy_yaml_map_onto_the_parallel_section() -> None:
    engine = EngineConfig.from_dict({"parallel": {"tensor_parallel_size": 4}})
    assert engine.parallel == ParallelConfig(tensor_parallel_size=4)
    assert EngineConfig().parallel.tensor_parallel_size == 1
    with pytest.raises(ConfigError, match=r"^engine\.parallel\.tensor_parallel_size: must be a positive"):
        EngineConfig.from_dict({"parallel": {"tensor_parallel_size": 0}})
    with pytest.raises(ConfigError, match=r"^engine\.parallel\.ranks: unknown key"):
        EngineConfig.from_dict({"parallel": {"ranks": 2}})
    # Every pool takes workers of several devices (deploy.ranks); a disaggregated pool's sizes are those the
    # handoff splits heads between (kv_transfer.shard_plan), and another is refused at parse time, naming the key.
    for pool in ("prefill", "decode"):
        parsed = parse_config({pool: {"engine": {"parallel": {"tensor_parallel_size": 4}}}}, "test")
        assert parsed.pools()[WorkerRole(pool)].engine.parallel.tensor_parallel_size == 4
        with pytest.raises(
            ConfigError,
            match=rf"^{pool}\.engine\.parallel\.tensor_parallel_size: a {pool} worker hands its KV over between "
            r"workers of 1, 2, 4, 8 devices, got 3",
        ):
            parse_config({pool: {"engine": {"parallel": {"tensor_parallel_size": 3}}}}, "test")
    assert HANDOFF_TP_SIZES == TP_SIZES
    colocated = {
        "mode": "colocated",
        "colocated": {"replicas": 1, "engine": {"parallel": {"tensor_parallel_size": 2}}},
    }
    assert (
        parse_config(colocated, "test").pools()[WorkerRole.COLOCATED].engine.parallel.tensor_parallel_size
        == 2
    )


def test_heads_mlp_and_vocabulary_are_split_and_every_query_head_finds_its_kv_head() -> None:
    m = model(heads=4, kv=2, vocab=515)
    for tp in (1, 2, 4):
        shards = [TPShard.plan(m, ParallelConfig(tp), r) for r in range(tp)]
        assert [h for s in shards for h in s.q_heads] == list(range(4))
        assert [i for s in shards for i in s.mlp] == list(range(128))
        assert [v for s in shards for v in s.vocab] == list(range(515))  # each id on exactly one rank
        assert {s.vocab_rows for s in shards} == {-(-515 // tp)}
        for s in shards:
            for h in s.q_heads:
                assert h // (m.num_heads // m.num_kv_heads) in s.kv_heads
    # Fewer KV heads than ranks: each KV head is held by tp / kv ranks.
    four = [TPShard.plan(m, ParallelConfig(4), r).kv_heads for r in range(4)]
    assert four == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    local = TPShard.plan(m, ParallelConfig(4), 3).local_model(m)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.vocab_size) == (1, 1, 32, 129)


def test_checkpoint_tensors_are_cut_rows_for_column_parallel_and_columns_for_row_parallel() -> None:
    shard = TPShard.plan(model(heads=4, kv=2), ParallelConfig(2), rank=1)
    cut = shard.piece_slice
    layer = "model.layers.0."
    assert dataclasses.astuple(cut(layer + "self_attn.q_proj.weight")) == (0, 32, 64, 32)  # type: ignore[arg-type]
    assert dataclasses.astuple(cut(layer + "self_attn.k_proj.bias")) == (0, 16, 32, 16)  # type: ignore[arg-type]
    assert dataclasses.astuple(cut(layer + "self_attn.o_proj.weight")) == (1, 32, 64, 32)  # type: ignore[arg-type]
    assert dataclasses.astuple(cut(layer + "mlp.up_proj.weight")) == (0, 64, 128, 64)  # type: ignore[arg-type]
    assert dataclasses.astuple(cut(layer + "mlp.down_proj.weight")) == (1, 64, 128, 64)  # type: ignore[arg-type]
    assert dataclasses.astuple(cut("lm_head.weight")) == (0, 258, 515, 258)  # type: ignore[arg-type]
    assert cut(layer + "input_layernorm.weight") is None and cut("model.norm.weight") is None


def test_fingerprint_names_the_shard_and_is_unchanged_without_one() -> None:
    base = KVLayout(2, 1, 16, 4, 64, "float32")
    old_text = "num_layers=2;num_kv_heads=1;head_dim=16;block_size=4;dtype=float32"
    assert base.fingerprint() == hashlib.sha256(old_text.encode()).hexdigest()[:32]
    # Ranks 0 of TP=2 and of TP=4 both hold model head 0 in one-head caches; the fingerprints still differ.
    layouts = [
        dataclasses.replace(base, shard=KVShard(tp, rank, head, 2))
        for tp, rank, head in ((2, 0, 0), (2, 1, 1), (4, 0, 0), (4, 1, 0), (4, 2, 1))
    ]
    prints = [base.fingerprint(), *(layout.fingerprint() for layout in layouts)]
    assert len(set(prints)) == len(prints)
    with pytest.raises(ConfigError, match=r"KVLayout\.shard: heads"):
        KVLayout(2, 2, 16, 4, 64, "float32", KVShard(2, 1, 1, 2))  # heads [1, 3) of 2


def test_the_step_record_decodes_to_the_batch_it_encodes() -> None:
    """Every field the other ranks run on, the prompt-scoring rows included (prompt_logprobs: their logits are
    gathered across the ranks); the spans that map those rows to requests stay on the lead."""
    prefill, decode_step = prefill_then_decode([[5, 6, 7, 8, 9], [3], [10, 11]])
    scoring = dataclasses.replace(
        prefill,
        prompt_rows=np.array([0, 1, 2, 3, 6]),
        prompt_targets=np.array([6, 7, 8, 9, 11]),
        prompt_top_n=3,
    )
    for batch in (prefill, decode_step, scoring):
        header, payload = encode(batch)
        assert header.dtype == payload.dtype and payload.dim() == 1  # raw int64 only: nothing pickled
        back = decode(header, payload)
        for field in dataclasses.fields(batch):
            ours, theirs = getattr(back, field.name), getattr(batch, field.name)
            if isinstance(theirs, np.ndarray):
                assert ours.dtype == theirs.dtype and np.array_equal(ours, theirs), field.name
            else:
                assert ours == theirs, field.name
