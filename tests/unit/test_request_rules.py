"""The request rules, stated once in model_runtime.request_rules: what each check rejects, naming the field."""

from __future__ import annotations

import pytest

from model_runtime.request import SamplingParams
from model_runtime.request_rules import InvalidRequest, RequestLimits, pool_overflow, prompt_leaves_no_room

pytestmark = pytest.mark.unit
LIMITS = RequestLimits(vocab_size=50, max_model_len=16, block_size=4, usable_blocks=3)


@pytest.mark.parametrize(
    ("prompt", "sampling", "message"),
    [
        ([], SamplingParams(), "prompt_token_ids: must hold at least one token id"),
        ([1, 50], SamplingParams(), "prompt_token_ids: 50 is outside the vocabulary [0, 50)"),
        ([1, -1], SamplingParams(), "prompt_token_ids: -1 is outside"),
        ([1] * 16, SamplingParams(), "prompt_token_ids: 16 tokens leave no room for output"),
        ([1], SamplingParams(stop_token_ids=(50,)), "stop_token_ids: 50 is outside the vocabulary"),
        (
            [1] * 4,
            SamplingParams(max_tokens=9),
            "max_tokens: prompt + max_tokens (capped at max_model_len) is 13",
        ),
    ],
)
def test_a_request_that_can_never_run_is_rejected_naming_the_field(prompt, sampling, message) -> None:
    with pytest.raises(InvalidRequest) as info:
        LIMITS.check(prompt, sampling)
    assert str(info.value).startswith(message), info.value


def test_a_request_at_the_limits_passes() -> None:
    LIMITS.check([49] * 4, SamplingParams(max_tokens=8))  # 12 tokens = 3 blocks, the whole pool
    LIMITS.check([1] * 11, SamplingParams(max_tokens=1))
    assert prompt_leaves_no_room(15, 16) is None and pool_overflow(12, 4, 3) is None
    assert "at most 15 prompt tokens" in (prompt_leaves_no_room(16, 16) or "")
