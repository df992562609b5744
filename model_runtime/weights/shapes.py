"""Named model shapes for dummy (random) weights: real shapes for benchmarks, tiny ones for tests.

`dummy:<name>` builds the same `ModelConfig` a real checkpoint of that model would, so memory planning, KV
layout and step times are those of the real model; only the numbers in the weights are random.
"""

from __future__ import annotations

from model_runtime.config import ModelConfig, RopeScaling
from model_runtime.weights.errors import ModelLoadError

_LLAMA3_ROPE = RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)

DUMMY_SHAPES: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        architecture="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_ids=(2,),
        name="dummy:smollm2-135m",
    ),
    # Llama-3.1-8B's shape (Llama-3-8B plus llama3 rope scaling and the 128k context).
    "llama-3-8b": ModelConfig(
        architecture="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE,
        bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009),
        name="dummy:llama-3-8b",
    ),
    "llama-3-70b": ModelConfig(
        architecture="llama",
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE,
        bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009),
        name="dummy:llama-3-70b",
    ),
    "qwen2.5-7b": ModelConfig(
        architecture="qwen2",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        head_dim=128,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        attention_bias=True,
        bos_token_id=151643,
        eos_token_ids=(151645, 151643),
        name="dummy:qwen2.5-7b",
    ),
    # Tests: tiny, GQA, and SmolLM2's vocabulary size (the byte-level dummy tokenizer needs only 258 ids).
    "tiny-llama": ModelConfig(
        architecture="llama",
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_ids=(2,),
        name="dummy:tiny-llama",
    ),
    "tiny-qwen2": ModelConfig(
        architecture="qwen2",
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        attention_bias=True,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_ids=(2,),
        name="dummy:tiny-qwen2",
    ),
}


def dummy_shape(name: str) -> ModelConfig:
    """The `ModelConfig` of a named dummy shape."""
    if name not in DUMMY_SHAPES:
        raise ModelLoadError(f"dummy:{name}: unknown dummy shape; known: {', '.join(DUMMY_SHAPES)}")
    return DUMMY_SHAPES[name]
