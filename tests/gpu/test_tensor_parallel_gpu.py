"""Tensor parallelism on CUDA GPUs: NCCL all-reduces, captured in the decode CUDA graphs, give TP=1's results.

The same checks as tests/model/test_tensor_parallel.py (which runs them on CPU over gloo), here with one process
per GPU (rank r on cuda:r, NCCL), float32 and the Triton kernels: TP=2 (and TP=4 on a machine with four GPUs)
gives TP=1's greedy tokens through the engine, with decode in CUDA graphs and eager alike, and every rank's
hidden states and gathered logits of hand-built prefill and decode steps match TP=1's. The reference runs in
this process on cuda:0.

    pytest -m gpu tests/gpu/test_tensor_parallel_gpu.py
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.model import tp_ranks
from tests.model.test_tensor_parallel import MAX_NEW, SHARP_INIT, prompts
from tests.model.tiny_models import write_tiny_hf

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"
    ),
]

# Float32 on the GPU: the split sums (each rank's partial product, then the all-reduce) round differently
# from TP=1's single matmul, a little more than on CPU (other kernel blockings).
ATOL = 1e-3
SIZES = [2, 4]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    where = tmp_path_factory.mktemp("tp-gpu-models")
    return {
        "llama": str(write_tiny_hf(where, "llama", initializer_range=SHARP_INIT, vocab_size=515)),
        "qwen2-mqa-tied": str(
            write_tiny_hf(where, "qwen2", tie=True, initializer_range=SHARP_INIT, num_key_value_heads=1)
        ),
        "dummy": "dummy:tiny-llama",
    }


CHECKS = [
    ("greedy", "llama"),
    ("greedy-eager", "llama"),
    ("steps", "llama"),
    ("greedy", "qwen2-mqa-tied"),
    ("steps", "qwen2-mqa-tied"),
    ("steps", "dummy"),
]


@pytest.fixture(scope="module")
def results(models: dict[str, str]):
    """results(tp) -> {(kind, model name): (TP=1's result, [each rank's result])}, computed once per tp."""
    batches = tp_ranks.prefill_then_decode(prompts(), device="cuda")
    checks = [
        (kind, models[name], batches if kind == "steps" else (prompts(), MAX_NEW)) for kind, name in CHECKS
    ]
    reference = tp_ranks.run_checks(None, checks, device="cuda")
    torch.cuda.empty_cache()

    @functools.cache
    def run(tp: int) -> dict:
        if torch.cuda.device_count() < tp:
            pytest.skip(f"TP={tp} needs {tp} GPUs, this machine has {torch.cuda.device_count()}")
        per_rank = tp_ranks.run_ranks(tp_ranks.run_checks, tp, checks, "cuda", timeout_s=600, device="cuda")
        return {key: (reference[i], [ranks[i] for ranks in per_rank]) for i, key in enumerate(CHECKS)}

    return run


CASES = [(tp, kind, name) for tp in SIZES for kind, name in CHECKS]


@pytest.mark.parametrize(("tp", "kind", "name"), CASES, ids=[f"tp{t}-{k}-{n}" for t, k, n in CASES])
def test_tensor_parallel_on_nccl_matches_one_gpu(results, tp: int, kind: str, name: str) -> None:
    reference, ranks = results(tp)[(kind, name)]
    tp_ranks.assert_matches_one_device(tp, kind, reference, ranks, len(prompts()), ATOL)
    if kind.startswith("greedy"):
        graphs = ranks[0][3]
        assert graphs is (kind == "greedy"), f"decode CUDA graphs {'on' if graphs else 'off'} for {kind}"
