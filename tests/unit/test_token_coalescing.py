"""A decode stream that falls behind sends what piled up as one message (decode_worker.service.coalesce): the
tokens, logprobs and finish of consecutive step outputs, in order, never past the request's last output."""

from __future__ import annotations

import queue

import pytest

from decode_worker.service import coalesce, token_batch
from model_runtime.engine import StepOutput

pytestmark = pytest.mark.unit


def output(tokens: list[int], finish: str | None = None, logprobs: bool = False) -> StepOutput:
    lps = [(-0.5 * t, [(t, -0.5 * t), (t + 1, -2.0)]) for t in tokens] if logprobs else None
    return StepOutput("r", tokens, "", lps, finish_reason=finish, num_cached_tokens=7)


def waiting(*outputs: StepOutput) -> queue.Queue:
    q: queue.Queue = queue.Queue()
    for out in outputs:
        q.put(out)
    return q


def test_an_output_with_nothing_behind_it_goes_out_as_it_is() -> None:
    first = output([5])
    assert coalesce(first, waiting()) is first


def test_outputs_that_piled_up_go_out_as_one_in_order_with_their_logprobs() -> None:
    q = waiting(output([6], logprobs=True), output([7, 8], logprobs=True), output([9], logprobs=True))
    merged = coalesce(output([5], logprobs=True), q)
    assert merged.token_ids == [5, 6, 7, 8, 9] and q.empty()
    assert merged.logprobs is not None and [lp[0] for lp in merged.logprobs] == [-2.5, -3.0, -3.5, -4.0, -4.5]
    batch = token_batch(merged, [])
    assert list(batch.token_ids) == [5, 6, 7, 8, 9] and [lp.token_id for lp in batch.logprobs] == [
        5,
        6,
        7,
        8,
        9,
    ]
    assert batch.num_cached_tokens == 7 and merged.finish_reason is None


def test_the_last_output_ends_the_merge_and_carries_its_finish() -> None:
    merged = coalesce(output([5]), waiting(output([6]), output([2], finish="stop")))
    assert merged.token_ids == [5, 6, 2] and merged.finish_reason == "stop"


def test_a_finished_output_is_not_merged_with_anything_and_the_limit_holds() -> None:
    q = waiting(*(output([10 + i]) for i in range(5)))
    done = output([4], finish="length")
    assert coalesce(done, q) is done and q.qsize() == 5
    merged = coalesce(output([9]), q, limit=3)
    assert merged.token_ids == [9, 10, 11] and q.qsize() == 3
