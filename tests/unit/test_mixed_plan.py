"""The prefill / decode split of an eager step (host_batch.mixed_plan), from plain integers: which rows go to
the packed varlen attention, which to the decode kernel, and which cache slots hold each chunk's context."""

from __future__ import annotations

import numpy as np
import pytest

from model_runtime.host_batch import mixed_plan
from model_runtime.kv_layout import KVLayout

pytestmark = pytest.mark.unit

BLOCK = 4


def _tables(rows: list[list[int]]) -> np.ndarray:
    width = max(len(r) for r in rows)
    return np.array([r + [0] * (width - len(r)) for r in rows], dtype=np.int32)


def test_fresh_prompts_use_their_own_rows_and_no_gather() -> None:
    plan = mixed_plan([5, 3, 7], np.array([5, 3, 7]), _tables([[1, 2], [3], [4, 5]]), BLOCK)
    assert plan.prefill_rows is None, "every row is a prefill row: no index needed"
    assert plan.context_slots is None, "no cached prefix: K/V are the chunks' fresh rows"
    assert plan.cu_q.tolist() == plan.cu_k.tolist() == [0, 5, 8, 15]
    assert plan.decode_rows is None and plan.decode_seqs is None


def test_mixed_step_splits_rows_and_gathers_prefix_context_by_slot() -> None:
    # seq 0: chunk of 3 over a 6-token prefix; seq 1: decode; seq 2: padding; seq 3: fresh prompt of 2.
    query_lens, seq_lens = [3, 1, 0, 2], np.array([9, 12, 0, 2])
    tables = [[7, 2, 9], [3, 4, 5], [0], [6]]
    plan = mixed_plan(query_lens, seq_lens, _tables(tables), BLOCK)
    assert plan.prefill_rows is not None and plan.prefill_rows.tolist() == [0, 1, 2, 4, 5]
    assert plan.decode_rows is not None and plan.decode_rows.tolist() == [3]
    assert plan.decode_seqs is not None and plan.decode_seqs.tolist() == [1]
    assert plan.cu_q.tolist() == [0, 3, 5] and plan.cu_k.tolist() == [0, 9, 11]
    layout = KVLayout(1, 1, 8, BLOCK, 16, "float32")
    want = layout.slots(tables[0], 0, 9) + layout.slots(tables[3], 0, 2)
    assert plan.context_slots is not None and plan.context_slots.tolist() == want
    assert plan.prefill_query_lens == [3, 2] and plan.prefill_seq_lens == [9, 2]


def test_decode_only_rows_have_no_prefill_part() -> None:
    plan = mixed_plan([1, 1], np.array([4, 9]), _tables([[1], [2, 3, 4]]), BLOCK)
    assert plan.prefill_query_lens == [] and plan.cu_q.tolist() == [0]
    assert plan.prefill_rows is not None and plan.prefill_rows.tolist() == []
    assert plan.decode_rows is not None and plan.decode_rows.tolist() == [0, 1]
