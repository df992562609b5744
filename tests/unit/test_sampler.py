"""The sampler against plain numpy definitions: greedy, top-k, top-p, temperature, seeds, logprobs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from model_runtime.request import SamplingError, SamplingParams
from model_runtime.sampler import (
    PendingIds,
    Sampler,
    SamplingTensors,
    apply_top_k,
    apply_top_p,
    derive_step_seed,
)

pytestmark = pytest.mark.unit


def _tensors(params: list[SamplingParams], vocab: int, step: int = 0, device: str = "cpu") -> SamplingTensors:
    return SamplingTensors.from_params(params, [step] * len(params), vocab, device)


def _sample(sampler: Sampler, logits: torch.Tensor, params: list[SamplingParams], step: int = 0) -> list[int]:
    tensors = _tensors(params, logits.shape[1], step, str(logits.device))
    return sampler(logits, tensors).sampled_token_ids.tolist()


def _tied_logits(rng: np.random.Generator, rows: int, vocab: int) -> np.ndarray:
    """Logits on a coarse grid: many exact ties, and distinct values far apart in float32."""
    return (rng.integers(-16, 17, size=(rows, vocab)) / 4.0).astype(np.float32)


# ---- numpy references: written from the definitions, one row at a time ----


def _ref_top_k(row: np.ndarray, k: int) -> np.ndarray:
    if k <= 0 or k >= row.size:
        return np.ones(row.size, dtype=bool)
    kth = np.sort(row)[::-1][k - 1]
    return row >= kth


def _ref_top_p(row: np.ndarray, top_p: float) -> np.ndarray:
    probs = np.exp(row.astype(np.float64) - row.max())
    probs /= probs.sum()
    if top_p >= 1.0:
        return np.ones(row.size, dtype=bool)
    ordered = np.sort(probs)[::-1]
    last = min(int(np.searchsorted(np.cumsum(ordered), top_p, side="left")), row.size - 1)
    return probs >= ordered[last]


def _kept(masked: torch.Tensor) -> np.ndarray:
    return np.isfinite(masked.numpy())


# ---- greedy ----


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax_with_first_index_on_ties(dtype: torch.dtype) -> None:
    rng = np.random.default_rng(0)
    logits_np = _tied_logits(rng, 16, 50)
    logits = torch.from_numpy(logits_np).to(dtype)
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.5)] * 8 + [
        SamplingParams(temperature=1e-7)
    ] * 8
    out = Sampler(seed=0)(logits, _tensors(params, 50))
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.sampled_token_ids.tolist() == np.argmax(logits.float().numpy(), axis=1).tolist()


def test_sampler_does_not_modify_logits() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    params = [SamplingParams(temperature=0.5, top_k=5, top_p=0.7, logprobs=3)] * 4
    Sampler(seed=0)(logits, _tensors(params, 30))
    assert torch.equal(logits, before)


# ---- top-k / top-p masks against numpy ----


def test_top_k_mask_matches_numpy_including_ties() -> None:
    rng = np.random.default_rng(1)
    vocab = 40
    logits_np = np.concatenate(
        [_tied_logits(rng, 12, vocab), rng.standard_normal((12, vocab)).astype(np.float32)]
    )
    ks = [0, 1, 2, 3, 5, 7, 10, 39, 40, 41, 1000, 1] * 2
    top_ks = torch.tensor([k if 0 < k < vocab else vocab for k in ks])
    masked = apply_top_k(torch.from_numpy(logits_np), top_ks, max_top_k=39)
    expected = np.stack([_ref_top_k(row, k) for row, k in zip(logits_np, ks)])
    np.testing.assert_array_equal(_kept(masked), expected)
    # Ties really happen in the grid rows, so the "keep every tie" rule is exercised.
    assert any(expected[i].sum() > ks[i] for i in range(12) if 0 < ks[i] < vocab)


def test_top_p_mask_matches_numpy_including_ties_and_edges() -> None:
    rng = np.random.default_rng(2)
    vocab = 32
    logits_np = np.concatenate([_tied_logits(rng, 30, vocab), 2 * rng.standard_normal((30, vocab))]).astype(
        np.float32
    )
    top_ps = []
    for i, row in enumerate(logits_np):
        probs = np.sort(np.exp(row - row.max()) / np.exp(row - row.max()).sum())[::-1]
        cum = np.cumsum(probs)
        j = 1 + i % 6
        # Half-way between two cumulative sums: clear of float rounding on either side.
        edges = [1.0, 1e-9, 1.0, 1e-9, (cum[j - 1] + cum[j]) / 2, (cum[j] + cum[j + 1]) / 2]
        top_ps.append(float(edges[i % len(edges)]))
    masked = apply_top_p(torch.from_numpy(logits_np), torch.tensor(top_ps, dtype=torch.float32))
    expected = np.stack([_ref_top_p(row, p) for row, p in zip(logits_np, top_ps)])
    np.testing.assert_array_equal(_kept(masked), expected)
    assert _kept(masked)[0].all()  # top_p = 1 keeps the whole vocabulary
    assert any(expected[i].sum() > 1 for i in range(30) if top_ps[i] == 1e-9)  # a tie at the top survives


def test_top_p_one_keeps_tokens_a_float32_cumsum_would_drop() -> None:
    logits = 3 * torch.randn(20, 1000, generator=torch.Generator().manual_seed(0))
    probs = logits.softmax(dim=-1).sort(dim=-1, descending=True).values
    # The float32 cumsum reaches 1.0 while tokens with probability > 0 remain in these rows.
    assert ((probs.cumsum(dim=-1)[:, :-1] >= 1.0) & (probs[:, 1:] > 0)).any()
    assert _kept(apply_top_p(logits, torch.ones(20))).all()


def test_sampled_tokens_are_the_top_p_nucleus_of_the_top_k_survivors() -> None:
    rng = np.random.default_rng(3)
    vocab, rows = 24, 400
    row = rng.standard_normal(vocab).astype(np.float32) * 0.5
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.8)
    scaled = row / np.float32(0.8)
    allowed_k = _ref_top_k(scaled, 6)
    allowed = allowed_k & _ref_top_p(np.where(allowed_k, scaled, -np.inf), 0.8)
    # The order matters here: top-p first would keep 14 tokens, top-k alone 6; together they keep 4.
    assert (allowed.sum(), _ref_top_p(scaled, 0.8).sum()) == (4, 14)
    tokens = _sample(Sampler(seed=5), torch.from_numpy(np.tile(row, (rows, 1))), [params] * rows)
    assert set(tokens) == set(np.flatnonzero(allowed).tolist())


# ---- distribution ----


def _chi_square(tokens: list[int], probs: np.ndarray) -> float:
    counts = np.bincount(tokens, minlength=probs.size)
    expected = probs * len(tokens)
    return float(((counts - expected) ** 2 / expected).sum())


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def test_temperature_scaled_distribution_chi_square() -> None:
    base = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 2.5], dtype=np.float32)
    rows = 3000
    # Half the rows seeded (one seed each), half from the shared generator: both paths are checked.
    params = [SamplingParams(temperature=0.7, seed=i) for i in range(rows // 2)]
    params += [SamplingParams(temperature=0.7)] * (rows // 2)
    tokens = _sample(Sampler(seed=11), torch.from_numpy(np.tile(base, (rows, 1))), params)
    # 5 degrees of freedom: 30 is beyond the 1e-5 tail, so the bound fails only for a wrong distribution.
    assert _chi_square(tokens, _softmax(base / 0.7)) < 30
    assert _chi_square(tokens, _softmax(base)) > 100  # temperature 1 would be rejected


def test_top_k_distribution_is_renormalized() -> None:
    base = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5], dtype=np.float32)
    rows = 2000
    tokens = _sample(
        Sampler(seed=12), torch.from_numpy(np.tile(base, (rows, 1))), [SamplingParams(top_k=3)] * rows
    )
    expected = np.where(np.arange(6) < 3, _softmax(base), 0)
    expected /= expected.sum()
    assert max(tokens) <= 2
    assert _chi_square(tokens, expected[:3]) < 30


# ---- seeds ----


def _run_steps(
    sampler: Sampler, batch_rows: list[np.ndarray], params: list[SamplingParams], steps: range
) -> list[list[int]]:
    """Sample `steps` tokens for every row; returns tokens per row."""
    logits = torch.from_numpy(np.stack(batch_rows))
    out: list[list[int]] = [[] for _ in params]
    for step in steps:
        for i, tok in enumerate(_sample(sampler, logits, params, step)):
            out[i].append(tok)
    return out


def test_seeded_request_repeats_alone_and_inside_any_batch() -> None:
    rng = np.random.default_rng(4)
    vocab = 1000
    mine, other = rng.standard_normal((2, vocab)).astype(np.float32) * 0.5
    me = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    alone = _run_steps(Sampler(seed=0), [mine], [me], range(20))[0]
    batch_params = [SamplingParams(seed=7), SamplingParams(), me, SamplingParams(temperature=0), me]
    batched = _run_steps(Sampler(seed=99), [other, other, mine, other, mine], batch_params, range(20))
    assert batched[2] == alone
    assert batched[4] == alone
    assert len(set(alone)) > 5  # each step draws new noise


def test_seeded_stream_continues_across_samplers() -> None:
    # Prefill samples token 0, a decode worker samples the rest: together they equal one uninterrupted run.
    row = np.random.default_rng(5).standard_normal(500).astype(np.float32)
    params = [SamplingParams(seed=42)]
    whole = _run_steps(Sampler(seed=1), [row], params, range(10))[0]
    first = _run_steps(Sampler(seed=2), [row], params, range(1))[0]
    rest = _run_steps(Sampler(seed=3), [row], params, range(1, 10))[0]
    assert first + rest == whole


def test_different_seeds_give_different_tokens() -> None:
    row = np.zeros(1000, dtype=np.float32)
    runs = _run_steps(Sampler(seed=0), [row] * 3, [SamplingParams(seed=s) for s in (1, 2, 3)], range(10))
    assert runs[0] != runs[1] and runs[1] != runs[2] and runs[0] != runs[2]


def test_shared_generator_seed_makes_unseeded_rows_repeat() -> None:
    row = np.zeros(1000, dtype=np.float32)
    params = [SamplingParams()] * 4
    first = _run_steps(Sampler(seed=8), [row] * 4, params, range(5))
    assert _run_steps(Sampler(seed=8), [row] * 4, params, range(5)) == first
    assert _run_steps(Sampler(seed=9), [row] * 4, params, range(5)) != first


def test_derive_step_seed_is_stable_and_in_range() -> None:
    seeds = {derive_step_seed(s, t) for s in (0, 1, 2**63 - 1) for t in range(100)}
    assert len(seeds) == 300
    assert all(0 <= s < 2**63 for s in seeds)
    assert derive_step_seed(5, 3) == derive_step_seed(5, 3)
    with pytest.raises(SamplingError, match=r"^seed"):
        derive_step_seed(-1, 0)


# ---- logprobs ----


def test_logprobs_are_raw_log_softmax() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(6)) * 3
    params = [
        SamplingParams(temperature=0.5, logprobs=5),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=1.3),
        SamplingParams(top_k=2, logprobs=20),
    ]
    out = Sampler(seed=0)(logits, _tensors(params, 50))
    ids = out.sampled_token_ids.tolist()
    ref = torch.log_softmax(logits.double(), dim=-1)
    rows = out.logprobs_lists()
    assert rows[2] is None
    for i, n in ((0, 5), (1, 0), (3, 20)):
        entry = rows[i]
        assert entry is not None
        chosen, top = entry
        assert math.isclose(chosen, ref[i, ids[i]].item(), abs_tol=1e-5)
        assert [t for t, _ in top] == ref[i].argsort(descending=True)[:n].tolist()
        np.testing.assert_allclose([v for _, v in top], ref[i].sort(descending=True).values[:n], atol=1e-5)


def test_no_logprobs_requested_gives_none_rows() -> None:
    out = Sampler(seed=0)(torch.randn(3, 10), _tensors([SamplingParams()] * 3, 10))
    assert out.logprobs is None
    assert out.logprobs_lists() == [None, None, None]


def test_logprobs_count_clamped_to_vocab() -> None:
    out = Sampler(seed=0)(torch.randn(1, 4), _tensors([SamplingParams(logprobs=20)], 4))
    entry = out.logprobs_lists()[0]
    assert entry is not None and len(entry[1]) == 4


# ---- validation ----


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("temperature", {"temperature": -1.0}),
        ("temperature", {"temperature": float("nan")}),
        ("temperature", {"temperature": float("inf")}),
        ("top_p", {"top_p": 0.0}),
        ("top_p", {"top_p": 1.5}),
        ("top_k", {"top_k": -2}),
        ("logprobs", {"logprobs": 21}),
        ("max_tokens", {"max_tokens": 0}),
        ("seed", {"seed": -1}),
        ("stop", {"stop": ("",)}),
        ("logit_bias", {"logit_bias": ((5, 101.0),)}),
        ("logit_bias", {"logit_bias": ((5, float("nan")),)}),
        ("logit_bias", {"logit_bias": ((-1, 1.0),)}),
        ("logit_bias", {"logit_bias": ((5, 1.0), (5, 2.0))}),
        ("logit_bias", {"logit_bias": ((5, True),)}),
        ("logit_bias", {"logit_bias": ((5,),)}),
        ("logit_bias", {"logit_bias": tuple((i, 1.0) for i in range(1025))}),
    ],
)
def test_invalid_sampling_params_name_the_field(field: str, kwargs: dict[str, object]) -> None:
    with pytest.raises(SamplingError, match=f"^{field}:"):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_sampler_rejects_mismatched_inputs() -> None:
    sampler = Sampler(seed=0)
    tensors = _tensors([SamplingParams()] * 2, 10)
    with pytest.raises(SamplingError, match=r"^logits:"):
        sampler(torch.randn(3, 10), tensors)
    with pytest.raises(SamplingError, match=r"^logits:"):
        sampler(torch.randn(2, 11), tensors)
    with pytest.raises(SamplingError, match=r"^logits:"):
        sampler(torch.randn(20), tensors)
    with pytest.raises(SamplingError, match=r"^output_indices:"):
        SamplingTensors.from_params([SamplingParams()] * 2, [0], 10, "cpu")
    with pytest.raises(SamplingError, match=r"^vocab_size:"):
        SamplingTensors.from_params([SamplingParams()], [0], 0, "cpu")


def test_empty_batch() -> None:
    out = Sampler(seed=0)(torch.empty(0, 10), _tensors([], 10))
    assert out.sampled_token_ids.shape == (0,)


# ---- GPU: same contracts, and no host sync ----


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_sampling_has_no_host_sync_and_seeds_repeat() -> None:
    vocab = 32_000
    logits = torch.randn(10, vocab, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    logits[4] = logits[0]  # same request content twice: same seed, same step -> same token
    # the favourites of a row that generated its own (once known, once pending) and of one whose prompt holds it
    logits[8, 9] = logits[8].max() + 1.0
    logits[9, 11] = logits[9].max() + 1.0
    params = [
        SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=3, logprobs=5),
        SamplingParams(temperature=0.0),
        SamplingParams(top_p=0.5),
        SamplingParams(temperature=1.2, top_k=1000, seed=4),
        SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=3, logprobs=5),
        SamplingParams(),
        SamplingParams(temperature=0.0, logit_bias=((123, 100.0), (5, -3.0))),  # forced, greedy
        SamplingParams(temperature=0.9, seed=5, logit_bias=((77, 100.0),)),  # forced, sampled
        SamplingParams(temperature=0.0, frequency_penalty=2.0),  # penalized away from its favourite
        SamplingParams(temperature=0.0, repetition_penalty=10.0),  # and this one by its prompt
    ]
    sampler = Sampler("cuda", seed=0)
    pending_on_device = torch.tensor([9], device="cuda")  # a step-ahead engine's pending token
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        generated: list[list[int]] = [[]] * 8 + [[9], []]
        prompts: list[list[int]] = [[]] * 9 + [[11, 12]]
        tensors = SamplingTensors.from_params(
            params, [7] * len(params), vocab, "cuda", generated, PendingIds((8,), pending_on_device), prompts
        )
        out = sampler(logits.bfloat16(), tensors)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ids = out.sampled_token_ids.tolist()
    assert out.sampled_token_ids.dtype == torch.int64
    assert ids[1] == logits.bfloat16().float()[1].argmax().item()
    assert ids[0] == ids[4]
    assert ids[6:8] == [123, 77]
    penalized = logits.bfloat16().float()[8]
    penalized[9] -= 4.0
    assert ids[8] == penalized.argmax().item() != 9
    repeated = logits.bfloat16().float()[9]
    repeated[11] = repeated[11] / 10  # positive: the largest logit of its row
    repeated[12] = repeated[12] / 10 if repeated[12] > 0 else repeated[12] * 10
    assert ids[9] == repeated.argmax().item() != 11
    alone = sampler(logits[:1].bfloat16(), SamplingTensors.from_params(params[:1], [7], vocab, "cuda"))
    assert alone.sampled_token_ids.tolist() == [ids[0]]
