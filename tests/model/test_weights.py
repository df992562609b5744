"""Weight loading against transformers: HF directories, GGUF files (tiny and the embedded SmolLM2), dummy shapes."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from model_runtime.config import ModelConfig, RopeScaling
from model_runtime.weights import (
    DUMMY_SHAPES,
    ModelLoadError,
    SourceFormat,
    load_model_config,
    load_weights,
    resolve_model,
)
from model_runtime.weights.canonical import canonical_shapes
from tests.model.tiny_models import (
    hf_state_dict,
    tiny_hf_model,
    transformers_smollm2,
    write_tiny_gguf,
    write_tiny_hf,
)

pytestmark = pytest.mark.model

HF_VARIANTS = {
    "llama": {"arch": "llama"},
    "llama-llama3-rope": {"arch": "llama", "llama3_rope": True},
    "llama-tied": {"arch": "llama", "tie": True},
    "qwen2": {"arch": "qwen2"},
    "mistral-sharded": {"arch": "mistral", "sharded": True},
}


def fuse_reference(state: dict[str, np.ndarray], config: ModelConfig) -> dict[str, np.ndarray]:
    """The canonical tensors, built independently of the loader from a transformers state dict."""
    out = {
        "embed_tokens.weight": state["model.embed_tokens.weight"],
        "norm.weight": state["model.norm.weight"],
    }
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        attn = [p + f"self_attn.{x}_proj" for x in "qkv"]
        out[f"layers.{i}.input_norm.weight"] = state[p + "input_layernorm.weight"]
        out[f"layers.{i}.qkv.weight"] = np.concatenate([state[a + ".weight"] for a in attn])
        if config.attention_bias:
            out[f"layers.{i}.qkv.bias"] = np.concatenate([state[a + ".bias"] for a in attn])
        out[f"layers.{i}.o_proj.weight"] = state[p + "self_attn.o_proj.weight"]
        out[f"layers.{i}.post_attn_norm.weight"] = state[p + "post_attention_layernorm.weight"]
        out[f"layers.{i}.gate_up.weight"] = np.concatenate(
            [state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]]
        )
        out[f"layers.{i}.down.weight"] = state[p + "mlp.down_proj.weight"]
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    return out


def assert_same_weights(ours: dict[str, torch.Tensor], reference: dict[str, np.ndarray]) -> None:
    assert sorted(ours) == sorted(reference)
    for name, expected in reference.items():
        np.testing.assert_array_equal(ours[name].float().numpy(), expected, err_msg=name)


@pytest.mark.parametrize("variant", list(HF_VARIANTS))
def test_hf_weights_equal_transformers_state_dict(tmp_path: Path, variant: str) -> None:
    directory = write_tiny_hf(tmp_path, **HF_VARIANTS[variant])
    source = resolve_model(str(directory))
    config = load_model_config(source)
    weights = load_weights(source, config, torch.float32)
    assert_same_weights(weights, fuse_reference(hf_state_dict(directory), config))
    assert all(t.dtype == torch.float32 and t.is_contiguous() for t in weights.values())


@pytest.mark.parametrize("variant", list(HF_VARIANTS))
def test_hf_config_matches_transformers_config(tmp_path: Path, variant: str) -> None:
    directory = write_tiny_hf(tmp_path, **HF_VARIANTS[variant])
    config = load_model_config(resolve_model(str(directory)))
    hf = tiny_hf_model(**HF_VARIANTS[variant]).config
    assert config.architecture == HF_VARIANTS[variant]["arch"]
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (
        hf.vocab_size,
        hf.hidden_size,
        hf.intermediate_size,
    )
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (2, 4, 2, 16)
    assert config.rms_norm_eps == hf.rms_norm_eps
    assert config.rope_theta == hf.rope_parameters["rope_theta"]
    assert config.tie_word_embeddings == hf.tie_word_embeddings
    assert config.attention_bias == (variant == "qwen2")
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))
    if variant == "llama-llama3-rope":
        assert config.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 64)
    else:
        assert config.rope_scaling is None


def test_bf16_load_is_the_rounded_checkpoint(tmp_path: Path) -> None:
    directory = write_tiny_hf(tmp_path, "qwen2")
    source = resolve_model(str(directory))
    config = load_model_config(source)
    weights = load_weights(source, config, torch.bfloat16)
    reference = fuse_reference(hf_state_dict(directory), config)
    for name, expected in reference.items():
        assert weights[name].dtype == torch.bfloat16
        assert torch.equal(weights[name], torch.from_numpy(expected).to(torch.bfloat16)), name


def _rewrite_config(directory: Path, **changes: object) -> None:
    path = directory / "config.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps({k: v for k, v in data.items() if v is not None}))


def test_legacy_config_keys_and_eos_lists(tmp_path: Path) -> None:
    # Files written before transformers 5 keep rope_theta and rope_scaling at the top level, no head_dim.
    directory = write_tiny_hf(tmp_path)
    _rewrite_config(
        directory,
        rope_parameters=None,
        head_dim=None,
        rope_theta=250000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        },
        eos_token_id=[2, 0],
    )
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    config = load_model_config(resolve_model(str(directory)))
    assert config.head_dim == 64 // 4
    assert config.rope_theta == 250000.0
    assert config.rope_scaling == RopeScaling(32.0, 1.0, 4.0, 128)
    assert config.eos_token_ids == (2, 0, 7)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope_type 'yarn'"),
        ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_size": 96}, "shape"),  # config no longer matches the tensors
    ],
)
def test_bad_configs_raise_model_load_error(tmp_path: Path, changes: dict, message: str) -> None:
    directory = write_tiny_hf(tmp_path)
    _rewrite_config(directory, **changes)
    with pytest.raises(ModelLoadError, match=message) as info:
        source = resolve_model(str(directory))
        load_weights(source, load_model_config(source), torch.float32)
    assert str(directory) in str(info.value)


def test_missing_and_corrupt_files_raise_model_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such file"):
        resolve_model(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        resolve_model(str(tmp_path / "empty"))
    directory = write_tiny_hf(tmp_path)
    weights_file = directory / "model.safetensors"
    weights_file.write_bytes(weights_file.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        resolve_model(str(directory))
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + bytes(range(200)))
    with pytest.raises(ModelLoadError, match=r"garbage\.gguf: not a readable GGUF"):
        resolve_model(str(garbage))
    good = write_tiny_gguf(tmp_path)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match=r"truncated\.gguf"):
        resolve_model(str(truncated))
    with pytest.raises(ModelLoadError, match="unknown dummy shape"):
        resolve_model("dummy:gpt-5")


def test_sharded_checkpoint_with_missing_shard_is_rejected(tmp_path: Path) -> None:
    directory = write_tiny_hf(tmp_path, "mistral", sharded=True)
    next(directory.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(ModelLoadError, match="shard files are missing"):
        resolve_model(str(directory))


def test_unsupported_gguf_tensor_type_is_named(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path, qtypes=(Q.Q8_0, Q.Q5_0))
    with pytest.raises(ModelLoadError, match=r"tensor blk\.0\.attn_q\.weight has type Q5_0"):
        resolve_model(str(path))


GGUF_VARIANTS = {
    "llama-q8_0-q4_1": {"arch": "llama", "qtypes": (Q.Q8_0, Q.Q4_1)},
    "llama-tied-q4_0-f16": {"arch": "llama", "qtypes": (Q.Q4_0, Q.F16), "tie": True},
    "qwen2-bf16-q8_0-f32": {"arch": "qwen2", "qtypes": (Q.BF16, Q.Q8_0, Q.F32)},
}
# Worst-case dequantization error of N(0, 0.02^2) weights, per type (a wrong row order is off by ~0.03).
QUANT_TOLERANCE = {Q.Q8_0: 2e-3, Q.Q4_0: 2e-2, Q.Q4_1: 1.5e-2, Q.F16: 1e-4, Q.BF16: 1e-3, Q.F32: 0.0}


@pytest.mark.parametrize("variant", list(GGUF_VARIANTS))
def test_gguf_weights_equal_transformers_gguf_load(tmp_path: Path, variant: str) -> None:
    spec = GGUF_VARIANTS[variant]
    path = write_tiny_gguf(tmp_path, **spec)
    source = resolve_model(str(path))
    assert source.format is SourceFormat.GGUF
    config = load_model_config(source)
    weights = load_weights(source, config, torch.float32)
    assert_same_weights(weights, fuse_reference(hf_state_dict(path), config))
    # And independently of transformers: close to the unquantized model the file was written from (this is what
    # checks the Q/K row order for llama files and its absence for qwen2 files).
    original = fuse_reference(
        {
            k: v.numpy()
            for k, v in tiny_hf_model(spec["arch"], tie=spec.get("tie", False)).state_dict().items()
        },
        config,
    )
    tolerance = max(QUANT_TOLERANCE[q] for q in spec["qtypes"])
    for name, expected in original.items():
        np.testing.assert_allclose(
            weights[name].numpy(), expected, rtol=0, atol=tolerance + 1e-7, err_msg=name
        )


def test_gguf_config_matches_transformers(tmp_path: Path) -> None:
    from transformers import AutoConfig

    path = write_tiny_gguf(tmp_path, "qwen2")
    config = load_model_config(resolve_model(str(path)))
    hf = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    assert config.architecture == hf.model_type == "qwen2"
    assert (config.hidden_size, config.intermediate_size, config.num_layers) == (
        hf.hidden_size,
        hf.intermediate_size,
        hf.num_hidden_layers,
    )
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size) == (
        hf.num_attention_heads,
        hf.num_key_value_heads,
        hf.hidden_size // hf.num_attention_heads,
        hf.vocab_size,
    )
    assert config.rms_norm_eps == pytest.approx(hf.rms_norm_eps)
    assert config.attention_bias and not config.tie_word_embeddings
    assert config.eos_token_ids == (2,)


@pytest.fixture(scope="module")
def smollm2_transformers_state() -> dict[str, np.ndarray]:
    return {name: t.detach().numpy() for name, t in transformers_smollm2().state_dict().items()}


def test_embedded_smollm2_equals_transformers(smollm2_transformers_state: dict[str, np.ndarray]) -> None:
    source = resolve_model("smollm2-135m-instruct")
    config = load_model_config(source)
    # The dummy shape was written by hand from SmolLM2's card; the file must agree with it (eps is stored as f32).
    expected = dataclasses.replace(
        DUMMY_SHAPES["smollm2-135m"], rms_norm_eps=config.rms_norm_eps, name=config.name
    )
    assert config == expected
    assert config.rms_norm_eps == pytest.approx(1e-5)
    weights = load_weights(source, config, torch.float32)
    assert_same_weights(weights, fuse_reference(smollm2_transformers_state, config))


def test_dummy_configs_have_real_shapes() -> None:
    big = load_model_config(resolve_model("dummy:llama-3-70b"))
    assert (big.num_layers, big.hidden_size, big.num_kv_heads) == (80, 8192, 8)
    assert 69e9 < big.param_count() < 72e9
    assert 7.9e9 < load_model_config(resolve_model("dummy:llama-3-8b")).param_count() < 8.1e9
    assert 7.0e9 < load_model_config(resolve_model("dummy:qwen2.5-7b")).param_count() < 7.7e9


def test_dummy_weights_are_seeded_canonical_and_in_dtype() -> None:
    source = resolve_model("dummy:tiny-qwen2")
    config = load_model_config(source)
    first = load_weights(source, config, torch.bfloat16)
    second = load_weights(source, config, torch.bfloat16)
    assert {k: tuple(v.shape) for k, v in first.items()} == canonical_shapes(config)
    assert "lm_head.weight" not in first and "layers.1.qkv.bias" in first
    assert all(v.dtype == torch.bfloat16 for v in first.values())
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert torch.equal(first["norm.weight"], torch.ones(64, dtype=torch.bfloat16))
    std = first["layers.0.gate_up.weight"].float().std().item()
    assert 0.015 < std < 0.025


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_dummy_llama3_8b_bf16_allocates_only_its_weights_on_gpu() -> None:
    source = resolve_model("dummy:llama-3-8b")
    config = load_model_config(source)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    weights = load_weights(source, config, torch.bfloat16, "cuda")
    weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    assert weight_bytes == config.param_count() * 2
    assert torch.cuda.max_memory_allocated() - base < weight_bytes * 1.01  # no fp32 or staging copies
    assert all(t.is_cuda and t.dtype == torch.bfloat16 for t in weights.values())


def test_gguf_copy_without_suffix_is_rejected(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path)
    renamed = tmp_path / "model.bin"
    shutil.copy(path, renamed)
    with pytest.raises(
        ModelLoadError, match=r"model\.bin: not a Hugging Face model directory or a \.gguf file"
    ):
        resolve_model(str(renamed))
