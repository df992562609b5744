"""Tensor parallelism applied to a built Llama model from outside: the model file knows nothing of it.

A rank's model is built with its local shape (TPShard.local_model) and adopts its weight slices, so the
column-parallel projections (qkv, gate_up) and attention over the rank's heads already compute the rank's
part. What is left is communication, added here by replacing submodules (never methods):

    layer i:  normed -> [attn: qkv -> rotary -> attention over own heads -> o_proj]  -> partial sum
                                                                          AllReduceOutput: sum over ranks
              normed -> [mlp: gate_up -> silu*up -> down]                          -> partial sum, summed
    embed:    VocabParallelEmbedding: rows of other ranks' ids are zero here; summed over ranks
    logits:   each rank's vocabulary rows; `gather_logits` concatenates them (outside the model)

o_proj and down are the row-parallel linears: their input columns are split, so each rank's output is a
partial sum. Summing after the whole attention / MLP block is that reduction (the block ends in them). All of
these run inside `model.forward`, so a captured CUDA graph holds the collectives too.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model_runtime.models.llama import LlamaForCausalLM
from model_runtime.parallel.group import TPGroup
from model_runtime.parallel.shard import TPShard


class AllReduceOutput(nn.Module):
    """Runs `inner` and sums its output over the ranks (the reduction of the row-parallel linear it ends in)."""

    def __init__(self, inner: nn.Module, group: TPGroup) -> None:
        super().__init__()
        self.inner = inner
        self.group = group

    def forward(self, *args: Any) -> torch.Tensor:
        out: torch.Tensor = self.inner(*args)
        return self.group.all_reduce(out)


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows [start, stop) of the vocabulary live here; other ids embed to zero locally and
    take their row from the rank that holds it through the sum. `weight` is the rank's (padded) rows, which a
    tied lm_head reads too."""

    def __init__(self, weight: torch.Tensor, vocab: range, group: TPGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # the loaded rows, not a copy
        self.start, self.stop = vocab.start, vocab.stop
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mine = (input_ids >= self.start) & (input_ids < self.stop)
        local = torch.where(mine, input_ids - self.start, 0)
        out = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.group.all_reduce(out)


def apply_tensor_parallel(model: LlamaForCausalLM, shard: TPShard, group: TPGroup) -> LlamaForCausalLM:
    """Turn a rank's model (built with shard.local_model, weights loaded) into its tensor-parallel part, in
    place, at build time; returns it."""
    # add_module replaces a registered submodule of that name (and keeps the model's declared types honest).
    model.add_module("embed_tokens", VocabParallelEmbedding(model.embed_tokens.weight, shard.vocab, group))
    for layer in model.layers:
        for block in ("attn", "mlp"):
            layer.add_module(block, AllReduceOutput(layer.get_submodule(block), group))
    return model


def gather_logits(local: torch.Tensor, group: TPGroup, vocab_size: int) -> torch.Tensor:
    """[T, Vs] logits of each rank's vocabulary rows -> [T, vocab_size] on every rank (padding rows cut off).

    Every rank gets the whole: on a ring that costs the lead no more time than a gather to it alone, and the
    logits mean the same on every rank (only the lead samples from them)."""
    return group.all_gather_last(local)[:, :vocab_size]
