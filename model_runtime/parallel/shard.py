"""TPShard: what one tensor-parallel rank holds of a model, and the one rule that cuts checkpoint tensors for it.

Rank r of N, for a model with Hq query heads, Hkv KV heads of D dims, MLP width I and vocabulary V:

    query heads   [r*Hq/N, (r+1)*Hq/N)
    KV heads      Hkv >= N: [r*Hkv/N, (r+1)*Hkv/N)
                  Hkv <  N: the single head r // (N/Hkv)     (N/Hkv ranks hold a copy of each KV head)
    MLP           gate/up rows and down's input columns [r*I/N, (r+1)*I/N)
    vocabulary    embedding and lm_head rows [r*Vs, min((r+1)*Vs, V)), Vs = ceil(V/N); a rank short of Vs rows
                  is padded with zero rows (never looked up; their logits are cut off after the gather)

Query head h reads KV head h // (Hq/Hkv); with these ranges that head always lives on h's rank, so attention
needs no communication. Column-parallel projections (q/k/v, gate/up) take rows of their weight, row-parallel
ones (o_proj, down) take input columns and their partial outputs are summed across ranks (layers.py).
Norms are replicated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from model_runtime.config import ModelConfig, ParallelConfig
from model_runtime.kv_layout import KVShard


@dataclass(frozen=True)
class PieceSlice:
    """Take [start, stop) along `dim` of a checkpoint tensor, then pad that dim with zeros to `size`."""

    dim: int
    start: int
    stop: int
    size: int


def kv_head_range(model_kv_heads: int, tp_size: int, rank: int) -> range:
    """The model's KV heads that rank `rank` of `tp_size` holds: an equal run of them when there are at least as
    many heads as ranks, else the one head `rank // (tp_size / heads)` (replicated on tp_size / heads ranks).
    The sizes must divide one another (ParallelConfig.check_model)."""
    if model_kv_heads >= tp_size:
        per_rank = model_kv_heads // tp_size
        return range(rank * per_rank, (rank + 1) * per_rank)
    head = rank // (tp_size // model_kv_heads)
    return range(head, head + 1)


@dataclass(frozen=True)
class TPShard:
    tp_size: int
    rank: int
    head_dim: int
    q_heads: range
    kv_heads: range
    mlp: range
    vocab: range  # the rows of the model's vocabulary this rank holds
    vocab_rows: int  # Vs: every rank's embedding and lm_head have this many rows (padded)

    @classmethod
    def plan(cls, model: ModelConfig, parallel: ParallelConfig, rank: int) -> TPShard:
        """Rank `rank`'s share; raises ConfigError naming parallel.tensor_parallel_size when the model's shape
        cannot be split that many ways."""
        parallel.check_model(model)
        n = parallel.tensor_parallel_size
        if not 0 <= rank < n:
            raise ValueError(f"TPShard.plan: rank must be in [0, {n}), got {rank}")
        q, i = model.num_heads // n, model.intermediate_size // n
        kv = kv_head_range(model.num_kv_heads, n, rank)
        rows = -(-model.vocab_size // n)
        return cls(
            tp_size=n,
            rank=rank,
            head_dim=model.head_dim,
            q_heads=range(rank * q, (rank + 1) * q),
            kv_heads=kv,
            mlp=range(rank * i, (rank + 1) * i),
            vocab=range(min(rank * rows, model.vocab_size), min((rank + 1) * rows, model.vocab_size)),
            vocab_rows=rows,
        )

    def local_model(self, model: ModelConfig) -> ModelConfig:
        """The shape this rank's model is built with: its heads, MLP width and (padded) vocabulary rows."""
        return dataclasses.replace(
            model,
            num_heads=len(self.q_heads),
            num_kv_heads=len(self.kv_heads),
            intermediate_size=len(self.mlp),
            vocab_size=self.vocab_rows,
        )

    def kv_shard(self, model: ModelConfig) -> KVShard:
        return KVShard(self.tp_size, self.rank, self.kv_heads.start, model.num_kv_heads)

    def piece_slice(self, hf_name: str) -> PieceSlice | None:
        """How to cut the checkpoint tensor `hf_name` (Hugging Face name, torch layout) for this rank; None
        for a tensor every rank holds whole (norms)."""
        if hf_name.endswith(".weight_scale"):
            # An FP8 weight's scales, one per output row: cut with its rows; a column cut keeps every row.
            cut = self.piece_slice(hf_name.removesuffix("_scale"))
            return cut if cut is not None and cut.dim == 0 else None
        d = self.head_dim
        for suffix, dim, span, scale in (
            ("self_attn.q_proj", 0, self.q_heads, d),
            ("self_attn.k_proj", 0, self.kv_heads, d),
            ("self_attn.v_proj", 0, self.kv_heads, d),
            ("self_attn.o_proj", 1, self.q_heads, d),
            ("mlp.gate_proj", 0, self.mlp, 1),
            ("mlp.up_proj", 0, self.mlp, 1),
            ("mlp.down_proj", 1, self.mlp, 1),
        ):
            if hf_name.rpartition(".")[0].endswith(suffix):
                return PieceSlice(dim, span.start * scale, span.stop * scale, len(span) * scale)
        if hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
            return PieceSlice(0, self.vocab.start, self.vocab.stop, self.vocab_rows)
        return None
