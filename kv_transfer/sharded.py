"""A handoff between tensor-parallel workers: which transfers one prefill rank makes for a request.

A decode worker of N ranks hands the router one KVTarget: rank 0's lease, and in `rank_targets` the lease each
other rank holds over the same block ids (deploy.rank_agents makes them). Each prefill rank sends the heads it
holds to the decode ranks that hold them (kv_transfer.shard_plan): one ordinary transfer per piece, naming its
head window, over that pair's own connection and transport. Equal sizes are one whole-cache transfer per rank,
rank r to rank r, as between two one-device workers.
"""

from __future__ import annotations

from kv_transfer.contracts import FailureReason, HeadWindow, TransferFailed
from kv_transfer.shard_plan import handoff_plan, pieces_from
from model_runtime.config import ConfigError
from model_runtime.kv_layout import KVLayout
from tandem_api.tandem.v1 import kv_pb2


def rank_target(target: kv_pb2.KVTarget, rank: int) -> kv_pb2.KVTarget:
    """The KVTarget of decode rank `rank` (0: `target` itself)."""
    if rank == 0:
        return target
    other = target.rank_targets[rank - 1]
    out = kv_pb2.KVTarget()
    out.CopyFrom(target)
    del out.rank_targets[:]
    out.port, out.handle, out.receiver_id = other.port, other.handle, other.receiver_id
    out.layout_fingerprint = other.layout_fingerprint
    out.format.CopyFrom(other.format)
    return out


def decode_size(target: kv_pb2.KVTarget) -> int:
    return 1 + len(target.rank_targets)


def pieces(target: kv_pb2.KVTarget, layout: KVLayout) -> list[tuple[kv_pb2.KVTarget, HeadWindow | None]]:
    """What the prefill rank whose cache `layout` describes sends for one request: (the decode rank's target,
    the head window, or None for a whole cache into a whole cache), in decode-rank order. Raises
    TransferFailed(LAYOUT_MISMATCH) when the two workers cannot split the model's heads between them."""
    source_size = layout.shard.tp_size if layout.shard is not None else 1
    source_rank = layout.shard.tp_rank if layout.shard is not None else 0
    target_size = decode_size(target)
    model_heads = target.format.model_kv_heads or target.format.num_kv_heads
    if model_heads != layout.model_kv_heads:
        raise TransferFailed(
            FailureReason.LAYOUT_MISMATCH,
            f"KV layouts differ: model KV heads: ours={layout.model_kv_heads} theirs={model_heads}",
        )
    declared = target.format.tp_size or 1
    if declared != target_size:
        raise TransferFailed(
            FailureReason.DESCRIPTOR_MISMATCH,
            f"the target names {target_size} decode ranks, its format says tp_size {declared}",
        )
    try:
        plan = handoff_plan(source_size, target_size, model_heads)
    except ConfigError as exc:
        raise TransferFailed(FailureReason.LAYOUT_MISMATCH, str(exc)) from None
    out: list[tuple[kv_pb2.KVTarget, HeadWindow | None]] = []
    for piece in pieces_from(plan, source_rank):
        whole = source_size == target_size
        window = None if whole else HeadWindow(piece.source_head, piece.target_head, piece.num_heads)
        out.append((rank_target(target, piece.target_rank), window))
    return out


def splits(target: kv_pb2.KVTarget, layout: KVLayout) -> bool:
    """Whether a handoff to `target` from a cache of `layout` is several transfers: the decode worker spans
    several ranks, or its cache holds other heads than ours."""
    return bool(target.rank_targets) or target.format.num_kv_heads != layout.num_kv_heads
