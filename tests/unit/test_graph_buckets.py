"""CUDA-graph buckets and padding, and the host-side step inputs they are built from (pure logic, CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from model_runtime.attention.torch_ref import TorchAttention
from model_runtime.cuda_graphs import (
    PAD_SLOT,
    DecodeRows,
    StaticDecodeInputs,
    bucket_for,
    graph_batch_sizes,
    graph_memory_estimate,
    pad_decode_rows,
)
from model_runtime.host_batch import HostBlockTables, build_host_batch, chunk_tokens
from model_runtime.kv_layout import NULL_BLOCK, KVLayout
from model_runtime.model_runner import ModelRunner
from model_runtime.request import Request, SamplingParams, ScheduledChunk, SchedulerOutput
from model_runtime.weights.dummy import dummy_weights
from model_runtime.weights.shapes import dummy_shape

pytestmark = pytest.mark.unit

BS = 4  # block size of the host-batch tests


# --- buckets --------------------------------------------------------------------------------------------
def test_default_buckets() -> None:
    assert graph_batch_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)


def test_buckets_cap_at_512_and_step_16_past_256() -> None:
    sizes = graph_batch_sizes(4096)
    assert sizes[-1] == 512
    assert sizes[sizes.index(256) :] == tuple(range(256, 513, 16))
    assert sizes[:5] == (1, 2, 4, 8, 16)


@pytest.mark.parametrize(
    ("max_num_seqs", "expected"),
    [(1, (1,)), (3, (1, 2, 3)), (8, (1, 2, 4, 8)), (20, (1, 2, 4, 8, 16, 20)), (300, None)],
)
def test_cap_is_always_a_bucket(max_num_seqs: int, expected: tuple[int, ...] | None) -> None:
    sizes = graph_batch_sizes(max_num_seqs)
    if expected is not None:
        assert sizes == expected
    assert sizes[-1] == min(max_num_seqs, 512)
    assert list(sizes) == sorted(set(sizes)), "sizes must be strictly increasing"


def test_limit_lowers_the_cap() -> None:
    assert graph_batch_sizes(64, limit=10) == (1, 2, 4, 8, 10)


@pytest.mark.parametrize("bad", [0, -1])
def test_bad_max_num_seqs_is_refused(bad: int) -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        graph_batch_sizes(bad)


@pytest.mark.parametrize("max_num_seqs", [1, 7, 64, 300, 512])
def test_bucket_is_the_smallest_that_fits(max_num_seqs: int) -> None:
    sizes = graph_batch_sizes(max_num_seqs)
    for n in range(1, sizes[-1] + 1):
        b = bucket_for(n, sizes)
        assert b is not None and b >= n
        assert not [s for s in sizes if n <= s < b], f"batch {n}: a smaller bucket than {b} fits"
    assert bucket_for(sizes[-1] + 1, sizes) is None  # larger batches run eagerly
    with pytest.raises(ValueError, match="num_seqs"):
        bucket_for(0, sizes)


def test_graph_memory_estimate_grows_with_the_largest_bucket() -> None:
    shape = dummy_shape("llama-3-8b")
    small, large = graph_memory_estimate(shape, 8, 2), graph_memory_estimate(shape, 512, 2)
    assert 64 * 2**20 < small < large < 2**30
    assert graph_memory_estimate(shape, 4096, 2) == large  # capped with the buckets


# --- padding --------------------------------------------------------------------------------------------
def _rows(n: int, width: int) -> DecodeRows:
    rng = np.random.default_rng(n)
    return DecodeRows(
        token_ids=rng.integers(1, 100, n).astype(np.int64),
        positions=rng.integers(1, 50, n).astype(np.int64),
        slots=rng.integers(16, 400, n).astype(np.int64),
        seq_lens=rng.integers(1, 50, n).astype(np.int32),
        block_tables=rng.integers(1, 90, (n, width)).astype(np.int32),
    )


@pytest.mark.parametrize(("n", "size"), [(1, 1), (3, 4), (5, 8), (19, 24)])
def test_padding_rows_touch_nothing(n: int, size: int) -> None:
    rows = _rows(n, width=3)
    padded = pad_decode_rows(rows, size)
    assert padded.num_seqs == size and padded.block_tables.shape == (size, 3)
    for name in ("token_ids", "positions", "slots", "seq_lens", "block_tables"):
        live, pad = getattr(padded, name)[:n], getattr(padded, name)[n:]
        assert np.array_equal(live, getattr(rows, name)), f"{name}: live rows changed"
        assert live.dtype == getattr(rows, name).dtype
        expected = {"slots": PAD_SLOT, "block_tables": NULL_BLOCK}.get(name, 0)
        assert (pad == expected).all(), f"{name}: padding must be {expected}"


def test_padding_cannot_shrink() -> None:
    with pytest.raises(ValueError, match="cannot pad 5 rows down to 4"):
        pad_decode_rows(_rows(5, 2), 4)


# --- host batch -----------------------------------------------------------------------------------------
def _request(rid: str, prompt_len: int, outputs: int, computed: int, blocks: list[int]) -> Request:
    prompt = [1000 + 10 * len(rid) + i for i in range(prompt_len)]
    req = Request(rid, prompt, SamplingParams(), block_ids=list(blocks), num_computed_tokens=computed)
    req.output_token_ids.extend(2000 + i for i in range(outputs))
    return req


def _mixed_step() -> SchedulerOutput:
    """A first prefill chunk, a chunk after a cached prefix, two decodes (one with spare blocks)."""
    return SchedulerOutput(
        (
            ScheduledChunk(_request("a", 10, 0, 0, [7, 3, 9]), 6, sample=False),
            ScheduledChunk(_request("b", 9, 0, 4, [2, 8, 5]), 5, sample=True),
            ScheduledChunk(_request("c", 5, 3, 7, [4, 6]), 1, sample=True),
            ScheduledChunk(_request("d", 3, 1, 3, [11, 12, 13]), 1, sample=True),
        )
    )


@pytest.mark.parametrize("cached_tables", [False, True], ids=["fresh", "cached"])
def test_host_batch_follows_the_layout_slot_rule(cached_tables: bool) -> None:
    out = _mixed_step()
    layout = KVLayout(1, 1, 8, BS, 16, "float32")
    tables = HostBlockTables(max_blocks=4, rows=2) if cached_tables else None
    batch = build_host_batch(out, BS, tables)
    ids, positions, slots = [], [], []
    for c in out.chunks:
        start = c.request.num_computed_tokens
        ids += c.request.all_token_ids[start : start + c.num_tokens]
        positions += list(range(start, start + c.num_tokens))
        slots += layout.slots(c.request.block_ids, start, start + c.num_tokens)
    assert batch.token_ids.tolist() == ids
    assert batch.positions.tolist() == positions
    assert batch.slots.tolist() == slots
    assert batch.query_start.tolist() == [0, 6, 11, 12, 13]
    assert batch.seq_lens.tolist() == [6, 9, 8, 4]
    assert batch.logits_indices.tolist() == [10, 11, 12]  # chunk a does not sample
    assert not batch.decode_only and not batch.samples_every_row
    # Wide enough for the longest context (3 blocks); each row starts with its own blocks.
    assert batch.block_tables.shape == (4, 3)
    assert batch.block_tables[0].tolist() == [7, 3, 0] or cached_tables
    assert batch.block_tables[2, :2].tolist() == [4, 6] and batch.block_tables[2, 2] == NULL_BLOCK


def test_decode_only_batch_gives_decode_rows() -> None:
    out = SchedulerOutput(
        tuple(ScheduledChunk(_request(f"r{i}", 4 + i, 1, 4 + i, [i + 1, i + 20]), 1, True) for i in range(3))
    )
    batch = build_host_batch(out, BS)
    assert batch.decode_only and batch.samples_every_row
    rows = batch.decode_rows()
    assert rows.num_seqs == 3
    assert rows.token_ids.tolist() == [2000, 2000, 2000]  # each request's first output token
    assert rows.seq_lens.tolist() == [5, 6, 7]
    with pytest.raises(ValueError, match="more than one token"):
        build_host_batch(_mixed_step(), BS).decode_rows()


def test_missing_blocks_are_an_error() -> None:
    out = SchedulerOutput((ScheduledChunk(_request("x", 9, 0, 0, [1, 2]), 9, True),))
    with pytest.raises(ValueError, match="'x': 2 blocks cannot hold positions up to 9"):
        build_host_batch(out, BS)


@pytest.mark.parametrize(("start", "end"), [(0, 3), (2, 5), (5, 7), (4, 5), (6, 7)])
def test_chunk_tokens_spans_prompt_and_output(start: int, end: int) -> None:
    req = _request("t", 5, 2, 0, [1, 2])
    assert chunk_tokens(req, start, end) == req.all_token_ids[start:end]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 5), st.sampled_from(["grow", "replace", "same", "skip"])), max_size=40)
)
def test_cached_tables_equal_fresh_ones(ops: list[tuple[int, str]]) -> None:
    """Requests grow, get preempted (a new list) or sit out steps; the cache must always agree with a fresh
    conversion of their block lists, also after its rows are recycled or its store grows."""
    tables = HostBlockTables(max_blocks=2, rows=1)
    requests = [_request(f"q{i}", 1, 0, 0, [i + 1]) for i in range(6)]
    next_block = 100
    for which, op in ops:
        req = requests[which]
        if op == "grow":
            req.block_ids.extend([next_block, next_block + 1])
            next_block += 2
        elif op == "replace":
            req.block_ids = [next_block]
            next_block += 1
        step = [r for i, r in enumerate(requests) if op != "skip" or i != which]
        width = max(len(r.block_ids) for r in step)
        got = tables.gather(step, width)
        for row, r in zip(got, step):
            assert row[: len(r.block_ids)].tolist() == r.block_ids
            assert (row[len(r.block_ids) :] == NULL_BLOCK).all()


# --- the static-buffer path, on CPU ---------------------------------------------------------------------
def _decode_step(batch: int, seed: int, num_blocks: int, block_size: int) -> SchedulerOutput:
    """`batch` decode chunks with random contexts over distinct random blocks."""
    rng = np.random.default_rng(seed)
    free = (rng.permutation(num_blocks - 1) + 1).tolist()
    chunks = []
    for i in range(batch):
        context = int(rng.integers(1, 60))
        blocks = [free.pop() for _ in range(-(-(context + 1) // block_size))]
        req = _request(f"s{seed}-{i}", context, 1, context, blocks)
        chunks.append(ScheduledChunk(req, 1, sample=True))
    return SchedulerOutput(tuple(chunks))


def test_static_buffers_give_the_eager_result_on_cpu() -> None:
    """What a decode graph records (a forward over padded static buffers) equals the eager step: same logits
    for the live rows, same KV written, nothing written by the padding rows. Steps shrink so that stale
    rows from the previous, larger step sit past the live ones."""
    config = dummy_shape("tiny-llama")
    block_size, num_blocks = 8, 64
    layout = KVLayout(
        config.num_layers, config.num_kv_heads, config.head_dim, block_size, num_blocks, "float32"
    )
    weights = dummy_weights(config, torch.float32, "cpu", seed=1)
    runner = ModelRunner(config, weights, layout, "cpu", TorchAttention(), max_model_len=128)
    assert runner.graphs is None  # no CUDA graphs on CPU
    runner.kv_cache.normal_(generator=torch.Generator().manual_seed(0))
    static = StaticDecodeInputs(
        8, runner.max_blocks_per_seq, block_size, config.hidden_size, torch.float32, torch.device("cpu")
    )
    for seed, (batch, size) in enumerate([(7, 8), (3, 4), (1, 1)]):
        out = _decode_step(batch, seed, num_blocks, block_size)
        before = runner.kv_cache.clone()
        eager = runner.execute(out)
        eager_cache = runner.kv_cache.clone()
        runner.kv_cache.copy_(before)
        rows = build_host_batch(out, block_size).decode_rows()
        static.stage(pad_decode_rows(rows, size))
        with torch.inference_mode():
            hidden = runner.model(
                static.input_ids(size), static.positions(size), runner.kv_cache, static.meta(size)
            )
            logits = runner.model.compute_logits(hidden[:batch])
        torch.testing.assert_close(logits, eager, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(runner.kv_cache, eager_cache, atol=1e-6, rtol=1e-6)
        live = {layout.slot(c.request.block_ids, c.request.num_computed_tokens) for c in out.chunks}
        assert _changed_slots(runner.kv_cache, before) == live, "padding rows wrote KV"


def _changed_slots(cache: torch.Tensor, before: torch.Tensor) -> set[int]:
    num_layers, _, num_blocks, block_size = cache.shape[:4]
    flat = (num_layers, 2, num_blocks * block_size, -1)
    changed = (cache.view(flat) != before.view(flat)).any(dim=-1).any(dim=1).any(dim=0)
    return set(changed.nonzero().flatten().tolist())
