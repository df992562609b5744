"""The prefill / decode split of an eager step (host_batch.mixed_plan), from plain integers: which rows each group
of prompt chunks computes (fresh chunks over their own rows, long fresh prompts one by one, chunks over a cached
prefix from cache slots), which rows go to the decode kernel, and when rows are slices rather than indices."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from model_runtime.attention.base import PER_PROMPT_MAX_CHUNKS, PER_PROMPT_MIN_TOKENS
from model_runtime.config import DECODE_GATHER_MAX_STEP_TOKENS
from model_runtime.host_batch import HostRows, mixed_plan
from model_runtime.kv_layout import KVLayout

pytestmark = pytest.mark.unit

BLOCK = 4
LONG = PER_PROMPT_MIN_TOKENS


def _tables(rows: list[list[int]]) -> np.ndarray:
    width = max(len(r) for r in rows)
    return np.array([r + [0] * (width - len(r)) for r in rows], dtype=np.int32)


def _span(rows: HostRows) -> list[int]:
    return list(range(rows.start, rows.stop)) if rows.index is None else rows.index.tolist()


def test_fresh_prompts_use_their_own_rows_and_no_gather() -> None:
    plan = mixed_plan([5, 3, 7], np.array([5, 3, 7]), _tables([[1, 2], [3], [4, 5]]), BLOCK)
    assert plan.long_fresh is None and plan.cached is None and plan.decode_rows is None
    fresh = plan.fresh
    assert fresh is not None and fresh.context_slots is None, "no cached prefix: K/V are the fresh rows"
    assert (fresh.rows.start, fresh.rows.stop, fresh.rows.index) == (0, 15, None), "one slice, every row"
    assert fresh.cu_q.tolist() == fresh.cu_k.tolist() == [0, 5, 8, 15]
    assert plan.num_rows == 15 and plan.covered
    device = plan.to_device("cpu")
    assert device.sole_group() is device.fresh, "its one call's output is the step's"


def test_a_cached_chunk_gathers_only_its_own_context_and_fresh_chunks_keep_their_rows() -> None:
    # seq 0: chunk of 3 over a 6-token prefix; seq 1: decode; seq 2: no rows; seq 3: fresh prompt of 2.
    query_lens, seq_lens = [3, 1, 0, 2], np.array([9, 12, 0, 2])
    tables = [[7, 2, 9], [3, 4, 5], [0], [6]]
    plan = mixed_plan(query_lens, seq_lens, _tables(tables), BLOCK)
    cached, fresh = plan.cached, plan.fresh
    assert cached is not None and fresh is not None and plan.long_fresh is None
    assert _span(cached.rows) == [0, 1, 2] and cached.rows.index is None
    assert cached.cu_q.tolist() == [0, 3] and cached.cu_k.tolist() == [0, 9]
    layout = KVLayout(1, 1, 8, BLOCK, 16, "float32")
    assert cached.context_slots is not None and cached.context_slots.tolist() == layout.slots(tables[0], 0, 9)
    assert _span(fresh.rows) == [4, 5] and fresh.context_slots is None and fresh.cu_k.tolist() == [0, 2]
    assert plan.decode_rows is not None and _span(plan.decode_rows) == [3]
    assert plan.decode_seqs is not None and plan.decode_seqs.tolist() == [1]
    assert cached.starts == [0] and fresh.starts == [4]
    assert plan.covered, "seq 2 has no rows to leave at zero"
    assert plan.to_device("cpu").sole_group() is None


def test_rows_that_are_not_contiguous_carry_an_index() -> None:
    # fresh 2, decode, fresh 3, decode: neither group's rows are one slice.
    plan = mixed_plan([2, 1, 3, 1], np.array([2, 9, 3, 5]), _tables([[1], [2, 3, 4], [5], [6, 7]]), BLOCK)
    assert plan.fresh is not None and plan.fresh.rows.index is not None
    assert _span(plan.fresh.rows) == [0, 1, 3, 4, 5] and plan.fresh.starts == [0, 3]
    assert plan.decode_rows is not None and _span(plan.decode_rows) == [2, 6]
    device = plan.to_device("cpu")
    assert device.fresh is not None and device.fresh.rows.index is not None
    assert device.fresh.rows.index.tolist() == [0, 1, 3, 4, 5]
    assert device.decode_rows is not None and device.decode_rows.index is not None
    assert device.decode_seqs is not None and device.decode_seqs.tolist() == [1, 3]


def test_long_fresh_prompts_run_one_by_one_unless_there_are_too_many() -> None:
    # a decode, a long fresh prompt, a short fresh one, a chunk over a prefix, another long fresh prompt
    query_lens = [1, LONG, 10, 7, LONG + 5]
    seq_lens = np.array([40, LONG, 10, 20, LONG + 5])
    tables = np.ones((5, (LONG + 5) // BLOCK + 1), dtype=np.int32)
    plan = mixed_plan(query_lens, seq_lens, tables, BLOCK)
    assert plan.long_fresh is not None and plan.long_fresh.starts == [1, LONG + 18]
    assert plan.long_fresh.query_lens == [LONG, LONG + 5] and plan.long_fresh.context_slots is None
    assert plan.fresh is not None and plan.fresh.query_lens == [10] and plan.fresh.starts == [LONG + 1]
    assert plan.cached is not None and plan.cached.query_lens == [7] and plan.cached.seq_lens == [20]
    many = PER_PROMPT_MAX_CHUNKS + 1
    plan = mixed_plan([LONG] * many, np.array([LONG] * many), tables[:1].repeat(many, 0), BLOCK)
    assert plan.long_fresh is None, "more long prompts than per-prompt calls pay for: one varlen call"
    assert plan.fresh is not None and len(plan.fresh.query_lens) == many


def test_padding_rows_are_in_no_group_and_the_plan_says_so() -> None:
    plan = mixed_plan([4, 1], np.array([4, 0]), _tables([[1], [0]]), BLOCK)
    assert plan.decode_rows is None and plan.fresh is not None and _span(plan.fresh.rows) == [0, 1, 2, 3]
    assert not plan.covered, "row 4 belongs to padding and must come back zero"
    assert plan.to_device("cpu").sole_group() is None


def test_device_arrays_bind_in_the_order_they_are_listed() -> None:
    plan = mixed_plan(
        [3, 1, 2, 1], np.array([9, 12, 2, 5]), _tables([[7, 2, 9], [3, 4, 5], [6], [8, 1]]), BLOCK
    )
    i64, i32 = plan.int64_arrays(), plan.int32_arrays()
    # cached slots, fresh rows are one slice (no index), decode rows [3, 6] (an index) and their seqs
    assert [a.tolist() for a in i64][-2:] == [[3, 6], [1, 3]]
    assert len(i32) == 4  # cu_q and cu_k of the fresh and the cached group
    bound = plan.bind([torch.from_numpy(a) for a in i64], [torch.from_numpy(a) for a in i32])
    assert bound.cached is not None and bound.cached.context_slots is not None
    assert bound.cached.context_slots.tolist() == plan.cached.context_slots.tolist()  # type: ignore[union-attr]
    assert bound.fresh is not None and bound.fresh.cu_q.tolist() == [0, 2]


def test_decode_only_rows_have_no_prefill_part() -> None:
    plan = mixed_plan([1, 1], np.array([4, 9]), _tables([[1], [2, 3, 4]]), BLOCK)
    assert plan.long_fresh is None and plan.fresh is None and plan.cached is None
    assert (
        plan.decode_rows is not None and _span(plan.decode_rows) == [0, 1] and plan.decode_rows.index is None
    )


# --- decode rows attended with the chunks (device.decode_gather_tokens) -------------------------------------
def test_decode_rows_join_the_cached_group_while_their_contexts_are_short() -> None:
    # seq 0: decode over 9; seq 1: chunk of 3 over a 6-token prefix; seq 2: decode over 12; seq 3: a padding row
    query_lens, seq_lens = [1, 3, 1, 1], np.array([9, 9, 12, 0])
    tables = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [0]]
    plan = mixed_plan(query_lens, seq_lens, _tables(tables), BLOCK, decode_gather_tokens=21)
    cached = plan.cached
    assert cached is not None and plan.decode_rows is None and plan.decode_seqs is None
    assert cached.query_lens == [1, 3, 1] and cached.seq_lens == [9, 9, 12], "every live row, in step order"
    assert _span(cached.rows) == [0, 1, 2, 3, 4] and cached.rows.index is None
    assert cached.cu_q.tolist() == [0, 1, 4, 5] and cached.cu_k.tolist() == [0, 9, 18, 30]
    layout = KVLayout(1, 1, 8, BLOCK, 16, "float32")
    expected = layout.slots(tables[0], 0, 9) + layout.slots(tables[1], 0, 9) + layout.slots(tables[2], 0, 12)
    assert cached.context_slots is not None and cached.context_slots.tolist() == expected
    assert not plan.covered, "seq 3's padding row is in no group (it must stay zero)"
    # one token past the limit (21 context tokens of decodes): the decode kernel takes them as before
    kernel = mixed_plan(query_lens, seq_lens, _tables(tables), BLOCK, decode_gather_tokens=20)
    assert kernel.cached is not None and kernel.cached.query_lens == [3]
    assert kernel.decode_seqs is not None and kernel.decode_seqs.tolist() == [0, 2]
    assert mixed_plan(query_lens, seq_lens, _tables(tables), BLOCK).decode_seqs is not None, "0: never"


def test_a_step_past_the_gather_size_leaves_its_decodes_to_the_decode_kernel() -> None:
    """A large step's kernels outlast its launches: gathering its decodes would only add GPU work."""
    big = DECODE_GATHER_MAX_STEP_TOKENS - 1  # with the decode row: exactly the limit
    tables = np.ones((2, big // BLOCK + 2), dtype=np.int32)
    at_limit = mixed_plan([1, big], np.array([9, big]), tables, BLOCK, 8192)
    assert at_limit.decode_rows is None and at_limit.cached is not None
    past = mixed_plan([1, big + 1], np.array([9, big + 1]), tables, BLOCK, 8192)
    assert past.decode_seqs is not None and past.decode_seqs.tolist() == [0] and past.cached is None


def test_decodes_beside_a_fresh_prompt_form_the_cached_group_alone() -> None:
    plan = mixed_plan([1, 1, 4], np.array([5, 7, 4]), _tables([[1, 2], [3, 4], [5]]), BLOCK, 8192)
    assert plan.fresh is not None and plan.fresh.query_lens == [4] and plan.fresh.context_slots is None
    assert plan.cached is not None and plan.cached.query_lens == [1, 1] and plan.decode_rows is None
    device = plan.to_device("cpu")
    assert device.sole_group() is None and device.cached is not None and device.cached.max_k == 7
    # a step of decodes and a chunk over a prefix, nothing else: one call computes every row
    only = mixed_plan([1, 2], np.array([5, 6]), _tables([[1, 2], [3, 4]]), BLOCK, 8192).to_device("cpu")
    assert only.sole_group() is only.cached
