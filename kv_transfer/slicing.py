"""How the nccl transport cuts one part into slices: each slice is one NCCL send/recv of a contiguous staging
buffer, so gathering slice i+1 (sender) and scattering slice i-1 (receiver) overlap the link moving slice i.

Both sides compute the same slices from what both know (the part's layers, the lease's block count and the
layout), so the wire carries no slice descriptors and the n-th send always matches the n-th receive.

    a slice = layers [layer_begin, layer_end) x the request's blocks [block_begin, block_end)

Whole layers of all blocks when a layer is small; one layer and a run of blocks when one layer alone exceeds
SLICE_BYTES (long prompts).
"""

from __future__ import annotations

from dataclasses import dataclass

from model_runtime.kv_layout import KVLayout

# One NCCL send/recv between two H200s moved 225-250 GB/s at 16 MiB, 285-320 at 64 MiB and 340-365 at 256 MiB
# to 1 GiB (bench/kv_transfer.py raw baselines): slices must be large for the link and small enough that the
# gather and scatter of one slice (HBM speed, about ten times the link) hide behind the others.
SLICE_BYTES = 64 * 2**20


@dataclass(frozen=True)
class Slice:
    layer_begin: int
    layer_end: int
    block_begin: int  # index into the request's block list, not a block id
    block_end: int

    def num_bytes(self, layout: KVLayout) -> int:
        return (
            (self.layer_end - self.layer_begin)
            * (self.block_end - self.block_begin)
            * layout.bytes_per_block_layer
        )

    def shape(self, layout: KVLayout) -> tuple[int, ...]:
        return layout.staging_shape(self.block_end - self.block_begin, (self.layer_begin, self.layer_end))


def slices(
    layout: KVLayout, layer_begin: int, layer_end: int, num_blocks: int, limit: int = SLICE_BYTES
) -> list[Slice]:
    """The slices of layers [layer_begin, layer_end) of a request with num_blocks blocks, in wire order; each
    at most `limit` bytes (default SLICE_BYTES) unless a single block of a single layer is larger."""
    limit = SLICE_BYTES if limit is None else limit
    if not 0 <= layer_begin < layer_end or num_blocks < 1:
        raise ValueError(f"slices: empty part (layers [{layer_begin}, {layer_end}), {num_blocks} blocks)")
    per_layer = layout.bytes_per_block_layer * num_blocks
    if per_layer <= limit:
        step = max(1, limit // per_layer)
        return [
            Slice(layer, min(layer + step, layer_end), 0, num_blocks)
            for layer in range(layer_begin, layer_end, step)
        ]
    blocks = max(1, limit // layout.bytes_per_block_layer)
    return [
        Slice(layer, layer + 1, first, min(first + blocks, num_blocks))
        for layer in range(layer_begin, layer_end)
        for first in range(0, num_blocks, blocks)
    ]


def ring_bytes(layout: KVLayout, limit: int | None = None) -> int:
    """The size of one staging buffer: the largest slice `slices` can make."""
    limit = SLICE_BYTES if limit is None else limit
    return max(limit - limit % layout.bytes_per_block_layer, layout.bytes_per_block_layer)
