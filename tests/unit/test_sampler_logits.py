"""What the sampler adds to the logits before a token is chosen: logit_bias, the presence and frequency
penalties over the generated tokens (the pending one of a step-ahead engine included), the repetition penalty
over the prompt and output; the logprobs returned stay the model's own. The GPU no-sync test, which carries
these rows too, is in test_sampler.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from model_runtime.request import SamplingError, SamplingParams
from model_runtime.sampler import PendingIds, Sampler, SamplingTensors

pytestmark = pytest.mark.unit


def _tensors(params: list[SamplingParams], vocab: int) -> SamplingTensors:
    return SamplingTensors.from_params(params, [0] * len(params), vocab, "cpu")


def test_logit_bias_outside_the_vocabulary_names_the_token() -> None:
    with pytest.raises(SamplingError, match=r"^logit_bias: token id 40 is outside the vocabulary \[0, 40\)"):
        SamplingParams(logit_bias=((3, 1.0), (40, -1.0))).check_vocab(40)


def test_logit_bias_is_added_before_the_choice_and_logprobs_stay_the_models() -> None:
    rng = np.random.default_rng(4)
    vocab = 64
    logits = torch.tensor(rng.normal(size=(4, vocab)).astype(np.float32))
    best = logits.argmax(dim=-1).tolist()
    bias_rows = [
        ((best[0], -100.0),),  # banned: the second best wins
        (),  # no bias, beside rows that have one
        ((7, 3.0), (9, -2.5), (best[2], -0.25)),
        ((11, 100.0),),
    ]
    params = [SamplingParams(temperature=0, logprobs=2, logit_bias=b) for b in bias_rows]
    out = Sampler()(logits, _tensors(params, vocab))
    expected = logits.clone()
    for row, pairs in enumerate(bias_rows):
        for token, bias in pairs:
            expected[row, token] += bias
    assert out.sampled_token_ids.tolist() == expected.argmax(dim=-1).tolist()
    assert out.sampled_token_ids.tolist()[3] == 11 and out.sampled_token_ids.tolist()[0] != best[0]
    raw = torch.log_softmax(logits, dim=-1)  # the model's distribution, not the biased one
    for row, (chosen, top) in enumerate(out.logprobs_lists()):
        token = out.sampled_token_ids.tolist()[row]
        assert chosen == pytest.approx(raw[row, token].item(), abs=1e-5)
        assert [t for t, _ in top] == raw[row].topk(2).indices.tolist()


def test_penalties_count_generated_tokens_once_each_with_the_pending_ones_and_logprobs_stay_the_models() -> (
    None
):
    """Row 0 generated 5, 5, 7 and has 7 pending on the device: 5 and 7 count twice, each penalized for presence
    once. Row 1 (no penalty) is untouched although it has a pending token too; row 2's pending token is new."""
    rng = np.random.default_rng(9)
    vocab = 16
    logits = torch.tensor(rng.normal(size=(3, vocab)).astype(np.float32))
    logits[0, 5] = logits[0].max() + 1.0  # the raw favourite, which the penalties must push below another
    logits[1, 3] = logits[1].max() + 1.0  # generated and pending in row 1, which has no penalty: still chosen
    logits[2, 9] = logits[2].max() - 1.0  # a negative presence penalty of 2 lifts it to the top
    params = [
        SamplingParams(temperature=0, logprobs=1, presence_penalty=0.5, frequency_penalty=1.25),
        SamplingParams(temperature=0, logprobs=1),
        SamplingParams(temperature=0, logprobs=1, presence_penalty=-2.0),
    ]
    generated = [[5, 5, 7], [3], [1]]
    pending = PendingIds(rows=(0, 1, 2), values=torch.tensor([7, 3, 9]))
    out = Sampler()(logits, SamplingTensors.from_params(params, [4, 2, 2], vocab, "cpu", generated, pending))
    expected = logits.clone()
    expected[0, 5] -= 2 * 1.25 + 0.5
    expected[0, 7] -= 2 * 1.25 + 0.5
    expected[2, 1] += 2.0
    expected[2, 9] += 2.0
    ids = out.sampled_token_ids.tolist()
    assert ids == expected.argmax(dim=-1).tolist()
    assert ids[0] != 5 and ids[1] == 3 and ids[2] == 9
    raw = torch.log_softmax(logits, dim=-1)  # the model's distribution, not the penalized one
    for row, (chosen, _) in enumerate(out.logprobs_lists()):
        assert chosen == pytest.approx(raw[row, ids[row]].item(), abs=1e-5)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_output_tokens() -> (
    None
):
    """Row 0 (penalty 2): prompt token 1 and generated token 2 (known) and 3 (pending on the device) are seen;
    row 1 (penalty 0.5, which favours repeats) has only its prompt; row 2 has none (its tokens untouched)."""
    logits = torch.tensor(
        [[1.0, 4.0, -2.0, 3.0, 3.5], [2.0, -1.0, 1.5, 0.0, 1.9], [0.0, 5.0, 1.0, 2.0, 3.0]],
        dtype=torch.float32,
    )
    params = [
        SamplingParams(temperature=0, logprobs=1, repetition_penalty=2.0),
        SamplingParams(temperature=0, repetition_penalty=0.5),
        SamplingParams(temperature=0),
    ]
    pending = PendingIds(rows=(0,), values=torch.tensor([3]))
    tensors = SamplingTensors.from_params(
        params, [2, 0, 0], 5, "cpu", generated=[[2], [], [1]], pending=pending, prompts=[[1], [1], [4]]
    )
    expected = logits.clone()
    expected[0, 1], expected[0, 2], expected[0, 3] = 4.0 / 2, -2.0 * 2, 3.0 / 2  # 4 is not seen: it wins
    expected[1, 1] = -1.0 * 0.5
    out = Sampler()(logits, tensors)
    assert out.sampled_token_ids.tolist() == expected.argmax(dim=-1).tolist() == [4, 0, 1]
    assert out.logprobs_lists()[0][0] == pytest.approx(torch.log_softmax(logits[0], -1)[4].item(), abs=1e-6)
    with pytest.raises(SamplingError, match="penalties: the prompt of every row is needed"):
        SamplingTensors.from_params(params, [2, 0, 0], 5, "cpu", generated=[[2], [], [1]])


def test_penalized_rows_need_their_generated_tokens() -> None:
    with pytest.raises(SamplingError, match="penalties: the generated tokens of every row"):
        SamplingTensors.from_params([SamplingParams(frequency_penalty=1.0)], [0], 8, "cpu")
    with pytest.raises(SamplingError, match=r"^presence_penalty: must be a number in \[-2, 2\]"):
        SamplingParams(presence_penalty=2.5)
    with pytest.raises(SamplingError, match=r"^frequency_penalty: must be a number in \[-2, 2\]"):
        SamplingParams(frequency_penalty=float("nan"))


def test_sampled_rows_draw_from_the_biased_distribution() -> None:
    """Temperature 1 over four equal logits, token 0 banned and token 1 raised by ln 2: the draws follow
    (0, 2/4, 1/4, 1/4)."""
    vocab, draws = 4, 4000
    logits = torch.zeros(draws, vocab)
    params = [SamplingParams(temperature=1.0, logit_bias=((0, -100.0), (1, math.log(2.0))))] * draws
    sampled = Sampler(seed=1)(logits, _tensors(params, vocab)).sampled_token_ids
    counts = torch.bincount(sampled, minlength=vocab).tolist()
    assert counts[0] == 0
    expected = [0.0, draws / 2, draws / 4, draws / 4]
    chi2 = sum((c - e) ** 2 / e for c, e in zip(counts[1:], expected[1:]))
    assert chi2 < 13.8, (counts, chi2)  # 2 degrees of freedom, p = 0.001
