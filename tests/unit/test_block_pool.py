"""BlockPool: accounting, ref counts, prefix hashes, revival and eviction order."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from model_runtime.block_pool import ROOT_HASH, BlockPool, NoFreeBlocks, extend_block_hashes, hash_block

pytestmark = pytest.mark.unit

BS = 4


def check_invariants(pool: BlockPool) -> None:
    assert pool.num_free + pool.num_used == pool.usable
    free = pool.free_block_ids()
    assert 0 not in free
    assert len(set(free)) == len(free)
    assert all(pool.ref_count(b) == 0 for b in free)
    assert sum(1 for b in range(1, pool.num_blocks) if pool.ref_count(b) > 0) == pool.num_used


def test_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(1, BS)
    with pytest.raises(ValueError, match="block_size"):
        BlockPool(8, 0)


def test_allocate_hands_out_distinct_non_null_blocks() -> None:
    pool = BlockPool(8, BS)
    ids = pool.allocate(7)
    assert sorted(ids) == list(range(1, 8))
    assert pool.num_free == 0 and pool.num_used == 7 and pool.usable == 7
    assert pool.allocate(0) == []
    check_invariants(pool)


def test_allocate_too_many_allocates_nothing() -> None:
    pool = BlockPool(8, BS)
    pool.allocate(5)
    with pytest.raises(NoFreeBlocks, match="asked for 3 blocks, only 2"):
        pool.allocate(3)
    assert pool.num_free == 2
    with pytest.raises(ValueError, match="non-negative"):
        pool.allocate(-1)


def test_free_rejects_double_free_null_and_out_of_range_atomically() -> None:
    pool = BlockPool(8, BS)
    a, b = pool.allocate(2)
    pool.free([a])
    with pytest.raises(ValueError, match="double free"):
        pool.free([b, a])
    assert pool.ref_count(b) == 1  # nothing was freed by the failed call
    with pytest.raises(ValueError, match="double free"):
        pool.free([b, b])
    with pytest.raises(ValueError, match="null block"):
        pool.free([0])
    with pytest.raises(ValueError, match="out of range"):
        pool.free([8])
    pool.free([b])
    assert pool.num_free == pool.usable
    check_invariants(pool)


def test_hash_is_stable_and_chained() -> None:
    # A fixed digest: prefill and decode processes (and restarts) must agree on it.
    assert hash_block(ROOT_HASH, [1, 2, 3, 4]).hex() == "9f806370602e97a98600072b724a40eb"
    h = extend_block_hashes([], [1, 2, 3, 4, 5, 6, 7, 8, 9], BS)
    assert len(h) == 2  # the partial third block has no hash
    other_parent = extend_block_hashes([], [0, 2, 3, 4, 5, 6, 7, 8], BS)
    assert h[1] != other_parent[1]  # same tokens in block 1, different prefix
    assert extend_block_hashes(h[:1], [1, 2, 3, 4, 5, 6, 7, 8], BS) == h


def test_a_long_prompt_hashes_as_its_blocks_chained_one_by_one() -> None:
    """extend_block_hashes packs all new blocks at once: the same hashes as hash_block block after block, from
    nothing, from a prefix of them, and up to num_tokens (large token ids included)."""
    tokens = [(i * 7919 + 3) % 128_256 for i in range(1000)] + [2**40, 0]
    chain, parent = [], ROOT_HASH
    for i in range(len(tokens) // 16):
        parent = hash_block(parent, tokens[i * 16 : (i + 1) * 16])
        chain.append(parent)
    assert extend_block_hashes([], tokens, 16) == chain
    assert extend_block_hashes(chain[:5], tokens, 16) == chain
    assert extend_block_hashes([], tokens, 16, 999) == chain[: 999 // 16]
    assert extend_block_hashes(chain[:3], tokens, 16, 40) == chain[:3]  # nothing new: returned as given


def commit(pool: BlockPool, tokens: list[int]) -> list[int]:
    """Allocate blocks for `tokens` and register its full blocks, as the scheduler does after compute."""
    ids = pool.allocate(-(-len(tokens) // BS))
    pool.commit_full_blocks(ids, tokens, len(tokens))
    return ids


def test_shared_prefix_reuses_block_ids_and_takes_refs() -> None:
    pool = BlockPool(16, BS)
    ids = commit(pool, list(range(10)))  # 2 full blocks + 2 tokens
    hit = pool.match_prefix([*range(8), 99, 98, 97, 96])
    assert hit == ids[:2]
    assert [pool.ref_count(b) for b in ids] == [2, 2, 1]
    assert pool.match_prefix([5, *range(1, 8)]) == []  # first block differs
    pool.free(hit)
    pool.free(ids)
    assert pool.num_free == pool.usable
    check_invariants(pool)


def test_cached_free_block_is_revived_by_a_match() -> None:
    pool = BlockPool(16, BS)
    ids = commit(pool, list(range(8)))
    pool.free(ids)
    assert pool.num_free == pool.usable and pool.num_cached == 2
    assert pool.match_prefix(list(range(9))) == ids
    assert pool.num_free == pool.usable - 2
    assert all(b not in pool.free_block_ids() for b in ids)
    check_invariants(pool)


def test_eviction_reuses_uncached_first_then_least_recently_freed() -> None:
    pool = BlockPool(7, BS)  # 6 usable
    a = commit(pool, [1] * 8)  # 2 cached blocks
    b = commit(pool, [2] * 8)  # 2 cached blocks
    c = commit(pool, [3] * 3)  # 1 partial, uncached block
    pool.free(b)
    pool.free(a)
    pool.free(c)
    # Free order: the never-used block and c's partial block first, then b (freed first), then a;
    # within one free() the tail block goes first.
    fresh = pool.allocate(2)
    assert c[0] in fresh
    assert pool.allocate(1) == [b[1]]
    assert not pool.is_cached(b[1])
    assert pool.match_prefix([2] * 8) == [b[0]]  # b's head survives; its evicted tail is gone
    assert pool.match_prefix([1] * 8) == a
    check_invariants(pool)


def test_duplicate_content_keeps_the_first_cached_copy() -> None:
    pool = BlockPool(8, BS)
    first = commit(pool, [7] * 4)
    second = commit(pool, [7] * 4)
    assert pool.is_cached(first[0]) and not pool.is_cached(second[0])
    with pytest.raises(ValueError, match="another hash"):
        pool.cache_full_blocks(first, [hash_block(ROOT_HASH, [8] * 4)])


def test_caching_disabled_never_matches() -> None:
    pool = BlockPool(8, BS, enable_prefix_caching=False)
    ids = commit(pool, list(range(8)))
    assert pool.num_cached == 0
    assert pool.match_prefix(list(range(8))) == []
    pool.free(ids)
    assert pool.num_free == pool.usable


def test_cannot_cache_a_free_block() -> None:
    pool = BlockPool(8, BS)
    with pytest.raises(ValueError, match="is free"):
        pool.cache_full_blocks([1], [hash_block(ROOT_HASH, [1] * 4)])


ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "free", "match", "commit"]), st.integers(0, 6), st.integers(0, 2)),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops=ops, num_blocks=st.integers(2, 12))
def test_random_ops_keep_refs_consistent(ops: list[tuple[str, int, int]], num_blocks: int) -> None:
    """A model of who holds which block must match the pool's ref counts after every operation."""
    pool = BlockPool(num_blocks, BS)
    held: list[list[int]] = []  # each entry: one owner's block ids (one reference each)
    for op, n, seed in ops:
        tokens = [seed] * (n * BS)  # few distinct prefixes, so matches happen
        if op == "alloc":
            if n <= pool.num_free:
                held.append(pool.allocate(n))
            else:
                with pytest.raises(NoFreeBlocks):
                    pool.allocate(n)
        elif op == "free" and held:
            pool.free(held.pop(n % len(held)))
        elif op == "match":
            held.append(pool.match_prefix(tokens))
        elif op == "commit" and n <= pool.num_free:
            held.append(commit(pool, tokens))
        check_invariants(pool)
        for block in range(1, num_blocks):
            assert pool.ref_count(block) == sum(ids.count(block) for ids in held)
    for ids in held:
        pool.free(ids)
    assert pool.num_free == pool.usable


def test_cached_hashes_report_the_hottest_blocks_first_and_the_version_tracks_changes() -> None:
    pool = BlockPool(6, BS)
    a, b = [1] * (2 * BS), [2] * BS
    ids_a, ids_b = commit(pool, a), commit(pool, b)
    hashes_a, hashes_b = pool.hash_blocks(a), pool.hash_blocks(b)
    assert pool.cached_hashes(10) == [hashes_b[0], hashes_a[1], hashes_a[0]]  # last registered first
    version = pool.cache_version
    pool.free(pool.match_prefix(a))  # a match makes a's blocks the hottest; the set is unchanged
    assert pool.cached_hashes(2) == [hashes_a[1], hashes_a[0]] and pool.cache_version == version
    pool.free(ids_a + ids_b)
    pool.allocate(pool.num_free)  # reuses (evicts) every cached block
    assert pool.cached_hashes(10) == [] and pool.cache_version > version


def test_a_fence_holds_freed_blocks_back_until_their_step_is_released():
    pool = BlockPool(num_blocks=8, block_size=2)
    a, b = pool.allocate(2), pool.allocate(2)
    pool.fence = 1
    pool.free(a)  # freed while step 1 may run
    pool.fence = 2
    pool.free(b)  # freed while step 2 may run
    assert pool.num_fenced == 4 and pool.num_free == 3 and pool.num_used == 4  # held back: not allocatable
    assert not set(a + b) & set(pool.free_block_ids())
    pool.release_fenced(1)  # step 1 is done: its blocks are free, step 2's still held
    assert set(a) <= set(pool.free_block_ids()) and pool.num_fenced == 2
    pool.fence = None
    pool.release_fenced()  # nothing in flight: all of them
    assert pool.num_fenced == 0 and pool.num_free == pool.usable
    c = pool.allocate(1)
    pool.free(c)  # no fence: straight to the free list
    assert pool.num_fenced == 0 and pool.num_free == pool.usable


def test_a_fenced_cached_block_can_be_revived_and_its_stale_entry_is_skipped():
    pool = BlockPool(num_blocks=8, block_size=2)
    tokens = [1, 2, 3, 4]
    blocks = pool.allocate(2)
    pool.commit_full_blocks(blocks, tokens, 4)
    pool.fence = 5
    pool.free(blocks)
    assert pool.num_fenced == 2
    assert pool.match_prefix(tokens) == blocks  # revived from the fence: full, computed KV
    assert pool.num_fenced == 0 and all(pool.ref_count(b) == 1 for b in blocks)
    pool.fence = 7
    pool.free(blocks)  # fenced again, under a later tag
    pool.release_fenced(5)  # the first entries are stale: nothing is freed early
    assert pool.num_fenced == 2 and not set(blocks) & set(pool.free_block_ids())
    pool.release_fenced(7)
    assert pool.num_fenced == 0 and set(blocks) <= set(pool.free_block_ids())
