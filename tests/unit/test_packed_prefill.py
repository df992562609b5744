"""The per-prompt prefill attention's bucketed lengths (attention.packed_prefill.padded_rows): a prompt's rows
followed by padding, as views of the step's rows where there are enough and as a copy with the same strides
where there are not, and causal attention over them giving the prompt's rows exactly what its own rows give."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model_runtime.attention.base import PER_PROMPT_BUCKET, per_prompt_length
from model_runtime.attention.packed_prefill import padded_rows

pytestmark = pytest.mark.unit

HQ, HKV, D = 4, 2, 8


def _step_rows(t: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as the model makes them: views of one qkv projection output (Attention.heads)."""
    qkv = torch.randn(t, (HQ + 2 * HKV) * D, generator=torch.Generator().manual_seed(seed))
    q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
    return q.view(t, HQ, D), k.view(t, HKV, D), v.view(t, HKV, D)


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    qi, ki, vi = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)


def test_lengths_round_up_to_the_bucket() -> None:
    assert per_prompt_length(1) == PER_PROMPT_BUCKET
    assert per_prompt_length(PER_PROMPT_BUCKET) == PER_PROMPT_BUCKET
    assert per_prompt_length(PER_PROMPT_BUCKET + 1) == 2 * PER_PROMPT_BUCKET


def test_a_prompt_with_enough_rows_after_it_reads_them_in_place() -> None:
    q, k, v = _step_rows(40)
    pq, pk, pv = padded_rows(q, k, v, 3, 10, 16)
    assert pq.data_ptr() == q[3].data_ptr() and pk.data_ptr() == k[3].data_ptr() and pq.shape[0] == 16
    assert pq.stride() == q.stride() and pv.stride() == v.stride()
    assert torch.allclose(_causal(pq, pk, pv)[:10], _causal(q[3:13], k[3:13], v[3:13]), atol=1e-6)


def test_the_last_prompt_is_copied_with_the_step_strides_and_zero_padding() -> None:
    q, k, v = _step_rows(30, seed=1)
    pq, pk, pv = padded_rows(q, k, v, 21, 9, 16)
    assert all(p.data_ptr() != x.data_ptr() for p, x in ((pq, q), (pk, k), (pv, v))), "a copy, not the step"
    assert (pq.stride(), pk.stride(), pv.stride()) == (q.stride(), k.stride(), v.stride()), "same cuDNN plan"
    assert pk.data_ptr() - pq.data_ptr() == k.data_ptr() - q.data_ptr(), "one buffer, as the model's"
    assert torch.equal(pq[:9], q[21:]) and torch.equal(pv[:9], v[21:])
    assert not pq[9:].any() and not pk[9:].any() and not pv[9:].any(), "padding is finite: zeros"
    assert torch.allclose(_causal(pq, pk, pv)[:9], _causal(q[21:], k[21:], v[21:]), atol=1e-6)


def test_rows_that_are_separate_tensors_are_copied_one_by_one() -> None:
    gen = torch.Generator().manual_seed(2)
    q, k, v = (
        torch.randn(12, HQ, D, generator=gen),
        torch.randn(12, HKV, D, generator=gen),
        torch.randn(12, HKV, D, generator=gen),
    )
    pq, pk, pv = padded_rows(q, k, v, 4, 8, 16)
    assert pq.shape == (16, HQ, D) and pk.shape == (16, HKV, D) and pq.is_contiguous()
    assert torch.equal(pk[:8], k[4:]) and not pk[8:].any()
    assert torch.allclose(_causal(pq, pk, pv)[:8], _causal(q[4:], k[4:], v[4:]), atol=1e-6)


def test_per_prompt_calls_run_only_at_lengths_start_up_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-prompt path as a GPU runs it, with the cuDNN call replaced by the same causal attention on the CPU
    (what is under test is which lengths it is called at and which rows it writes, not cuDNN): warm_up builds
    every bucketed length up to the budget, a step's long prompts (one reading on into the next chunk's rows, one
    copied at the end) call only those, and each prompt's rows come out as its own causal attention."""
    from model_runtime.attention import packed_prefill
    from model_runtime.attention.base import PER_PROMPT_MIN_TOKENS
    from model_runtime.host_batch import mixed_plan

    lengths: list[int] = []

    def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        lengths.append(q.shape[0])
        return _causal(q, k, v)

    monkeypatch.setattr(packed_prefill, "_use_flash", lambda q: True)
    monkeypatch.setattr(packed_prefill, "_cudnn_causal", causal)
    long_a, short, long_b = PER_PROMPT_MIN_TOKENS + 76, 300, PER_PROMPT_MIN_TOKENS + 300
    query_lens = [long_a, short, long_b]
    budget = sum(query_lens)
    prefill = packed_prefill.PackedPrefill()
    with pytest.raises(ValueError, match="at least"):  # too few rows would build plans at other lengths
        prefill.warm_up(*_step_rows(budget), budget)
    built = prefill.warm_up(*_step_rows(per_prompt_length(budget)), budget)  # as ModelRunner sizes them
    warmed = set(lengths)
    assert built == len(warmed) and warmed == set(
        range(per_prompt_length(PER_PROMPT_MIN_TOKENS), per_prompt_length(budget) + 1, PER_PROMPT_BUCKET)
    )
    lengths.clear()
    q, k, v = _step_rows(budget, seed=3)  # the step: exactly its rows, so the last prompt is copied
    tables = torch.ones(3, budget // 16 + 2, dtype=torch.int32).numpy()
    plan = mixed_plan(query_lens, torch.tensor(query_lens).numpy(), tables, 16).to_device("cpu")
    assert plan.long_fresh is not None and plan.long_fresh.query_lens == [long_a, long_b]
    out = torch.full_like(q, float("nan"))
    assert prefill.per_prompt(q, k, v, plan.long_fresh, 1.0, out)
    assert lengths == [per_prompt_length(long_a), per_prompt_length(long_b)] and set(lengths) <= warmed
    b0 = long_a + short
    assert torch.allclose(out[:long_a], _causal(q[:long_a], k[:long_a], v[:long_a]), atol=1e-5)
    assert torch.allclose(out[b0:], _causal(q[b0:], k[b0:], v[b0:]), atol=1e-5)
    assert out[long_a:b0].isnan().all(), "the short prompt's rows are the varlen call's, left alone here"
