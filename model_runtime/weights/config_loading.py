"""`ModelConfig` from config.json, from GGUF metadata, or from a named dummy shape."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from model_runtime.config import ConfigError, ModelConfig, RopeScaling
from model_runtime.weights.errors import ModelLoadError
from model_runtime.weights.gguf_file import GGUFFile
from model_runtime.weights.shapes import dummy_shape
from model_runtime.weights.source import ModelSource, SourceFormat, hf_architecture, read_json

# transformers' defaults for keys a config.json may leave out.
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "mistral": 32768, "qwen2": 32768}
_DEFAULT_RMS_EPS = 1e-6
_DEFAULT_ROPE_THETA = 10000.0
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def load_model_config(source: ModelSource) -> ModelConfig:
    """The model's shape and special ids; raises `ModelLoadError` naming the file and the key on problems."""
    if source.format is SourceFormat.DUMMY:
        return dummy_shape(source.dummy_shape or "")
    if source.format is SourceFormat.GGUF:
        return config_from_gguf(source.require_gguf(), source.name)
    directory = source.require_path()
    return config_from_hf(directory, source.name)


def config_from_hf(directory: Path, name: str) -> ModelConfig:
    where = directory / "config.json"
    raw = read_json(where)
    arch = hf_architecture(raw, where)
    _reject_unsupported_hf_features(raw, arch, where)
    hidden = _int(raw, "hidden_size", where)
    heads = _int(raw, "num_attention_heads", where)
    head_dim = raw.get("head_dim") or (hidden // heads)
    eos = _ids(raw.get("eos_token_id"), where, "eos_token_id")
    generation = directory / "generation_config.json"
    if generation.is_file():
        eos += _ids(read_json(generation).get("eos_token_id"), generation, "eos_token_id")
    return _build(
        where,
        architecture=arch,
        vocab_size=_int(raw, "vocab_size", where),
        hidden_size=hidden,
        intermediate_size=_int(raw, "intermediate_size", where),
        num_layers=_int(raw, "num_hidden_layers", where),
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        max_position_embeddings=raw.get("max_position_embeddings") or _DEFAULT_MAX_POSITIONS[arch],
        rms_norm_eps=float(raw.get("rms_norm_eps") or _DEFAULT_RMS_EPS),
        rope_theta=_rope_theta(raw),
        rope_scaling=_rope_scaling(raw, where),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        # Qwen2's q/k/v projections always carry a bias; Llama's and Mistral's never do here (see below).
        attention_bias=arch == "qwen2",
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(eos)),
        name=name,
    )


def _reject_unsupported_hf_features(raw: dict[str, Any], arch: str, where: Path) -> None:
    # Each of these changes the math; ignoring one would load without error and generate garbage.
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{where}: hidden_act {raw['hidden_act']!r} is not supported (only silu)")
    if arch != "qwen2" and raw.get("attention_bias"):
        raise ModelLoadError(f"{where}: attention_bias=true (biases on q/k/v/o) is not supported for {arch}")
    if raw.get("mlp_bias"):
        raise ModelLoadError(f"{where}: mlp_bias=true is not supported")
    # Mistral's sliding_window is accepted and not applied: it only matters past 4k tokens of context.


def _rope_theta(raw: dict[str, Any]) -> float:
    # transformers >= 5 nests rope_theta inside rope_parameters; older files keep it at the top level.
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        return float(params["rope_theta"])
    return float(raw.get("rope_theta") or _DEFAULT_ROPE_THETA)


def _rope_scaling(raw: dict[str, Any], where: Path) -> RopeScaling | None:
    scaling = raw.get("rope_scaling") or raw.get("rope_parameters")
    if not scaling:
        return None
    if not isinstance(scaling, dict):
        raise ModelLoadError(f"{where}: rope_scaling must be an object, got {scaling!r}")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "llama3":
        raise ModelLoadError(f"{where}: rope_scaling.rope_type {rope_type!r} is not supported (only llama3)")
    missing = [key for key in _LLAMA3_KEYS if key not in scaling]
    if missing:
        raise ModelLoadError(f"{where}: rope_scaling (llama3) is missing {', '.join(missing)}")
    try:
        return RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    except ConfigError as exc:
        raise ModelLoadError(f"{where}: {exc}") from exc


def config_from_gguf(gguf: GGUFFile, name: str) -> ModelConfig:
    key = gguf.arch_key
    hidden = gguf.get_int(key("embedding_length"))
    heads = gguf.get_int(key("attention.head_count"))
    head_dim = gguf.get_int(key("attention.key_length"), hidden // heads)
    rope_dims = gguf.get_int(key("rope.dimension_count"), head_dim)
    if rope_dims != head_dim:
        raise ModelLoadError(f"{gguf.path}: partial rotary ({rope_dims} of {head_dim} dims) is not supported")
    _reject_gguf_rope_scaling(gguf)
    tokens = gguf.get_list("tokenizer.ggml.tokens") if gguf.has("tokenizer.ggml.tokens") else []
    vocab = gguf.get_int(key("vocab_size"), len(tokens) or None)
    eos = [
        gguf.get_int(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if gguf.has(k)
    ]
    bos = gguf.get_int("tokenizer.ggml.bos_token_id") if gguf.has("tokenizer.ggml.bos_token_id") else None
    return _build(
        gguf.path,
        architecture=gguf.architecture,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=gguf.get_int(key("feed_forward_length")),
        num_layers=gguf.get_int(key("block_count")),
        num_heads=heads,
        num_kv_heads=gguf.get_int(key("attention.head_count_kv"), heads),
        head_dim=head_dim,
        max_position_embeddings=gguf.get_int(key("context_length")),
        rms_norm_eps=gguf.get_float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=gguf.get_float(key("rope.freq_base"), _DEFAULT_ROPE_THETA),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        attention_bias="blk.0.attn_q.bias" in gguf.tensors,
        bos_token_id=bos,
        eos_token_ids=tuple(dict.fromkeys(eos)),
        name=name,
    )


def _reject_gguf_rope_scaling(gguf: GGUFFile) -> None:
    # llama.cpp stores Llama-3.1's frequency scaling only as a precomputed `rope_freqs` tensor, without the
    # parameters RopeScaling needs; linear/yarn scaling come as rope.scaling.type. Neither is implemented.
    if "rope_freqs.weight" in gguf.tensors:
        raise ModelLoadError(
            f"{gguf.path}: llama3 rope scaling stored as rope_freqs.weight is not supported; "
            "load the Hugging Face checkpoint instead"
        )
    scaling = gguf.get_str(gguf.arch_key("rope.scaling.type"), "none")
    if scaling != "none":
        raise ModelLoadError(f"{gguf.path}: rope.scaling.type {scaling!r} is not supported")


def _build(where: Path, **fields: Any) -> ModelConfig:
    try:
        return ModelConfig(**fields)
    except (ConfigError, TypeError) as exc:
        raise ModelLoadError(f"{where}: {exc}") from exc


def _int(raw: dict[str, Any], key: str, where: Path) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelLoadError(f"{where}: {key} must be an integer, got {value!r}")
    return value


def _ids(value: object, where: Path, key: str) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ModelLoadError(f"{where}: {key} must be an integer or a list of integers, got {value!r}")
    return list(values)
