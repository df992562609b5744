"""Which prefill rank sends which KV heads to which decode rank, when both workers are tensor-parallel and their
sizes may differ (issue 18's heterogeneous handoff: prefill TP=a -> decode TP=b, a, b in 1, 2, 4, 8).

Each rank's cache holds a run of the model's KV heads (model_runtime.parallel.shard.kv_head_range: an equal run
when there are at least as many heads as ranks, else one head replicated on several ranks). A decode rank must
receive exactly its heads, GPU to GPU from the prefill ranks that hold them; nothing is gathered on one rank.

    prefill TP=2 (8 heads: 0-3 | 4-7)  ->  decode TP=4 (0-1 | 2-3 | 4-5 | 6-7)
        prefill 0 heads 0-1 -> decode 0,  prefill 0 heads 2-3 -> decode 1,
        prefill 1 heads 0-1 (its local 0-1, model 4-5) -> decode 2,  prefill 1 heads 2-3 -> decode 3

A piece is one contiguous run of heads from one source rank to one target rank, in each side's local head
indices. A head that several source ranks hold (fewer KV heads than prefill ranks) comes from one of them,
chosen by the target rank (target_rank mod holders) so that the replicas share the sending. Equal sizes give
one piece per rank, rank r to rank r, whole cache to whole cache: today's fast path.
"""

from __future__ import annotations

from dataclasses import dataclass

from model_runtime.config import ConfigError
from model_runtime.parallel.shard import kv_head_range

TP_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True)
class HeadPiece:
    source_rank: int  # the prefill rank that sends it
    target_rank: int  # the decode rank that receives it
    source_head: int  # its first head among the source rank's cache heads
    target_head: int  # its first head among the target rank's cache heads
    num_heads: int


def _check(side: str, tp_size: int, model_kv_heads: int) -> None:
    if tp_size not in TP_SIZES:
        raise ConfigError(f"{side} tensor_parallel_size: must be one of {TP_SIZES}, got {tp_size}")
    if model_kv_heads % tp_size and tp_size % model_kv_heads:
        raise ConfigError(
            f"{side} tensor_parallel_size {tp_size} does not divide the model's {model_kv_heads} KV heads "
            "(nor they it)"
        )


def handoff_plan(source_tp: int, target_tp: int, model_kv_heads: int) -> tuple[HeadPiece, ...]:
    """Every piece that moves one request's KV from a prefill worker of `source_tp` ranks to a decode worker
    of `target_tp` ranks, ordered by target rank then head. Each target head is covered exactly once."""
    if model_kv_heads <= 0:  # before _check divides by it
        raise ConfigError(f"model KV heads must be positive, got {model_kv_heads}")
    _check("prefill", source_tp, model_kv_heads)
    _check("decode", target_tp, model_kv_heads)
    holders: dict[int, list[int]] = {}
    for rank in range(source_tp):
        for head in kv_head_range(model_kv_heads, source_tp, rank):
            holders.setdefault(head, []).append(rank)
    pieces: list[HeadPiece] = []
    for target in range(target_tp):
        heads = kv_head_range(model_kv_heads, target_tp, target)
        for offset, head in enumerate(heads):
            ranks = holders[head]
            source = ranks[target % len(ranks)]
            source_head = head - kv_head_range(model_kv_heads, source_tp, source).start
            last = pieces[-1] if pieces else None
            if (
                last is not None
                and last.target_rank == target
                and last.source_rank == source
                and last.source_head + last.num_heads == source_head
                and last.target_head + last.num_heads == offset
            ):
                pieces[-1] = HeadPiece(source, target, last.source_head, last.target_head, last.num_heads + 1)
            else:
                pieces.append(HeadPiece(source, target, source_head, offset, 1))
    return tuple(pieces)


def pieces_from(plan: tuple[HeadPiece, ...], source_rank: int) -> tuple[HeadPiece, ...]:
    """What one prefill rank sends (to every decode rank it feeds)."""
    return tuple(piece for piece in plan if piece.source_rank == source_rank)


def pieces_to(plan: tuple[HeadPiece, ...], target_rank: int) -> tuple[HeadPiece, ...]:
    """What one decode rank receives (from every prefill rank that feeds it)."""
    return tuple(piece for piece in plan if piece.target_rank == target_rank)
