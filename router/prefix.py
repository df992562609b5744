"""The router's approximate prefix index: which prompt tokens each worker's prefix cache would serve.

Workers report the chained hashes of the full blocks their prefix cache holds (`WorkerInfo.cached_block_hashes`,
bounded, hottest first; refreshed only when `prefix_cache_version` changes). The router hashes a prompt the
same way (`model_runtime.block_pool`, the one owner of the hash) and counts, per worker, the leading blocks the
worker holds. Approximate by design: a report is up to one poll old, a bounded report may miss a cold prefix,
and an eviction since the last poll makes the estimate high; placement only weighs it against queued work, and
the engine's own match decides what is really reused (`usage.cached_prompt_tokens` reports that).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence, Set

from model_runtime.block_pool import extend_block_hashes


class PromptHashes:
    """One prompt's chained block hashes per block size, computed on first use."""

    def __init__(self, token_ids: Sequence[int]) -> None:
        self.token_ids = token_ids
        self._by_block_size: dict[int, list[bytes]] = {}

    def matchable(self, block_size: int) -> list[bytes]:
        """Hashes of the full blocks an engine could take from its cache: those before the last prompt token
        (one token must run to sample from; Scheduler._admit matches the same blocks)."""
        hashes = self._by_block_size.get(block_size)
        if hashes is None:
            end = max(0, (len(self.token_ids) - 1) // block_size * block_size)
            hashes = extend_block_hashes([], self.token_ids, block_size, end)
            self._by_block_size[block_size] = hashes
        return hashes


def cached_prefix_tokens(hashes: Iterable[bytes], held: Set[bytes], block_size: int) -> int:
    """Tokens of the longest prefix whose every block is in `held`."""
    blocks = 0
    for block_hash in hashes:
        if block_hash not in held:
            break
        blocks += 1
    return blocks * block_size
