"""Tiny random-weight checkpoints for model tests (no hub access): Hugging Face directories and GGUF files.

    write_tiny_hf(tmp_path, arch="llama")        -> Path of an HF dir: config.json, model.safetensors (or shards
                                                    + model.safetensors.index.json), generation_config.json,
                                                    tokenizer.json, tokenizer_config.json (ChatML template)
    write_tiny_gguf(tmp_path, qtypes=(Q8_0, Q4_1)) -> Path of a .gguf file: weights quantized as llama.cpp stores
                                                    them (Q/K rows permuted for llama arch), tokenizer metadata
    tiny_hf_model(arch, seed=...)                -> the transformers model both writers start from (same seed,
                                                    same weights), to compare a GGUF against its unquantized source

Every model: 2 layers, hidden 64, 4 query heads over 2 KV heads (GQA), head_dim 16, intermediate 128, and a
vocabulary the size of the tiny tokenizer (a byte-level BPE trained here, special tokens <|endoftext|>=0,
<|im_start|>=1 (bos), <|im_end|>=2 (eos), like SmolLM2). Norm weights and biases are randomized too, so a
swapped or dropped norm shows up in comparisons. Load them in transformers with
`AutoModelForCausalLM.from_pretrained(path)` or `from_pretrained(path.parent, gguf_file=path.name)`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BOS_ID, EOS_ID = 1, 2
TOKENIZER_VOCAB = 512
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test model.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 500000.0,
}
_CONFIG_CLASSES = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config"}

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. Tokenizers split text into pieces that models read.",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i, add(i, i))\n",
    "Numbers like 12345, 3.14159 and 2024-06-01 appear in text; so do emails like a@b.io and URLs.",
    "Café, naïve, résumé — accents matter. 日本語のテキストと中文文本。 Emoji: 🎉🚀👍🏽 and ✓.",
    "In the beginning the model knew nothing; after training it predicted the next token well enough.",
    "class Engine:\n    def step(self):\n        return [seq.next_token() for seq in self.running]\n",
    "She said, \"It's fine,\" and they're sure we'll see what you've done. I'm here; you'd know.",
    "Whitespace   runs,\ttabs,\n\n\nnewlines and    indentation are tokens too.",
]


@functools.lru_cache(maxsize=1)
def tiny_tokenizer_json() -> str:
    """A byte-level BPE (GPT-2 pre-tokenizer) trained on a small corpus, as tokenizer.json text (cached)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 20, trainer=trainer)
    return str(tokenizer.to_str())


def tiny_vocab_size() -> int:
    return int(Tokenizer.from_str(tiny_tokenizer_json()).get_vocab_size(with_added_tokens=True))


def tiny_hf_model(
    arch: str = "llama", *, seed: int = 0, tie: bool = False, llama3_rope: bool = False, **overrides: Any
) -> Any:
    """A seeded random transformers `PreTrainedModel` of the tiny shape (float32, eval mode)."""
    import torch  # torch and transformers are imported here so tokenizer-only users stay light
    import transformers

    fields: dict[str, Any] = {
        **SHAPE,
        "vocab_size": tiny_vocab_size(),
        "tie_word_embeddings": tie,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
    }
    if llama3_rope:
        fields["rope_scaling"] = dict(LLAMA3_ROPE)
    fields.update(overrides)
    config = getattr(transformers, _CONFIG_CLASSES[arch])(**fields)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn_like(param))
    return model.eval()


def write_tiny_hf(
    tmp_path: Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    tie: bool = False,
    llama3_rope: bool = False,
    sharded: bool = False,
    **overrides: Any,
) -> Path:
    """Save `tiny_hf_model(...)` with the tiny tokenizer into `tmp_path/tiny-<arch>...` and return that directory.

    `sharded=True` splits the weights over several safetensors files with an index; `overrides` are config fields.
    """
    suffix = "".join(
        f"-{flag}" for flag, on in (("tied", tie), ("llama3", llama3_rope), ("sharded", sharded)) if on
    )
    directory = Path(tmp_path) / f"tiny-{arch}{suffix}-s{seed}"
    model = tiny_hf_model(arch, seed=seed, tie=tie, llama3_rope=llama3_rope, **overrides)
    model.save_pretrained(directory, max_shard_size="100KB" if sharded else "50GB")
    write_tiny_tokenizer_files(directory)
    return directory


def write_tiny_tokenizer_files(directory: Path) -> None:
    """tokenizer.json + tokenizer_config.json (bos/eos, ChatML chat template) into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(tiny_tokenizer_json(), encoding="utf-8")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "unk_token": None,
        "chat_template": CHATML_TEMPLATE,
        "model_max_length": SHAPE["max_position_embeddings"],
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")


def write_tiny_gguf(
    tmp_path: Path,
    arch: str = "llama",
    *,
    qtypes: Sequence[gguf.GGMLQuantizationType] = (
        gguf.GGMLQuantizationType.Q8_0,
        gguf.GGMLQuantizationType.Q4_1,
    ),
    tokenizer: str = "bpe",
    seed: int = 0,
    tie: bool = False,
) -> Path:
    """Write `tiny_hf_model(arch, seed=seed, tie=tie)` as llama.cpp would and return the .gguf path.

    The 2-D weights take the types in `qtypes` in turn (token_embd first, then each layer's q, k, v, o, gate,
    up, down; output last); norms and biases stay F32. `arch` is "llama" (Q/K rows permuted as llama.cpp's
    converter does) or "qwen2" (stored as is, with q/k/v biases). `tokenizer` is "bpe" (the tiny byte-level BPE,
    tokenizer.ggml.model gpt2) or "spm" (a SentencePiece-style vocabulary with scores and byte fallback).
    """
    model = tiny_hf_model(arch, seed=seed, tie=tie)
    types = "-".join(q.name for q in qtypes)
    path = Path(tmp_path) / f"tiny-{arch}-{tokenizer}-{types}{'-tied' if tie else ''}-s{seed}.gguf"
    state = {name: t.detach().numpy() for name, t in model.state_dict().items()}
    writer = gguf.GGUFWriter(str(path), arch)
    _add_model_metadata(writer, arch, model.config)
    _add_tokenizer_metadata(writer, tokenizer, model.config.vocab_size)
    for name, data, qtype in _gguf_tensors(arch, model.config, state, list(qtypes)):
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            writer.add_tensor(name, gguf.quants.quantize(data, qtype))
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def hf_state_dict(path: Path) -> dict[str, np.ndarray]:
    """transformers' float32 state dict of an HF dir or a GGUF file (dequantized), keyed by HF names."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return {name: t.detach().float().numpy() for name, t in model.state_dict().items()}


def llama_cpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter reorder of Q/K rows (per head, interleave the two rotary halves)."""
    return (
        weight.reshape(n_heads, 2, weight.shape[0] // n_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _add_model_metadata(writer: gguf.GGUFWriter, arch: str, config: Any) -> None:
    rope = getattr(config, "rope_parameters", None) or {}
    writer.add_name(f"tiny-{arch}")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_vocab_size(config.vocab_size)


_GGUF_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _gguf_tensors(
    arch: str, config: Any, state: dict[str, np.ndarray], qtypes: list[gguf.GGMLQuantizationType]
) -> list[tuple[str, np.ndarray, gguf.GGMLQuantizationType]]:
    """(gguf name, float32 data in torch layout, type) in llama.cpp's order and naming."""
    f32 = gguf.GGMLQuantizationType.F32
    named: list[tuple[str, np.ndarray]] = [("token_embd.weight", state["model.embed_tokens.weight"])]
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        for hf, ours in _GGUF_LAYER_NAMES.items():
            for kind in ("weight", "bias"):
                if prefix + f"{hf}.{kind}" in state:
                    data = state[prefix + f"{hf}.{kind}"]
                    if arch == "llama" and kind == "weight" and ours in ("attn_q", "attn_k"):
                        heads = config.num_attention_heads if ours == "attn_q" else config.num_key_value_heads
                        data = llama_cpp_permute(data, heads)
                    named.append((f"blk.{i}.{ours}.{kind}", data))
    named.append(("output_norm.weight", state["model.norm.weight"]))
    if not config.tie_word_embeddings:
        named.append(("output.weight", state["lm_head.weight"]))
    out, matrices = [], 0
    for name, data in named:
        qtype = f32 if data.ndim == 1 else qtypes[matrices % len(qtypes)]
        matrices += data.ndim == 2
        out.append((name, np.ascontiguousarray(data, dtype=np.float32), qtype))
    return out


def _add_tokenizer_metadata(writer: gguf.GGUFWriter, kind: str, vocab_size: int) -> None:
    if kind == "bpe":
        data = json.loads(tiny_tokenizer_json())
        vocab: dict[str, int] = data["model"]["vocab"]
        tokens = sorted(vocab, key=vocab.__getitem__)
        merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt-2")
        writer.add_token_list(tokens)
        writer.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])
        writer.add_token_merges(merges)
        writer.add_bos_token_id(BOS_ID)
        writer.add_eos_token_id(EOS_ID)
        writer.add_add_bos_token(False)
    elif kind == "spm":
        tokens, scores, types = _spm_vocab(vocab_size)
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_unk_token_id(0)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(tokens.index("<|im_end|>"))
        writer.add_add_bos_token(True)
    else:
        raise ValueError(f"tokenizer must be 'bpe' or 'spm', got {kind!r}")
    writer.add_chat_template(CHATML_TEMPLATE)


def _spm_vocab(size: int) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style vocabulary of exactly `size` tokens: specials, 256 byte tokens, then pieces learned by
    a Metaspace BPE on the corpus (score = -rank, so earlier merges win), padded with unused tokens."""
    from tokenizers import SentencePieceBPETokenizer

    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    learner = SentencePieceBPETokenizer()
    learner.train_from_iterator(_CORPUS * 20, vocab_size=size, show_progress=False)
    learned = learner.get_vocab()
    pieces = [p for p in sorted(learned, key=learned.__getitem__) if p not in specials]
    pieces = pieces[: size - len(specials) - len(byte_tokens)]
    unused = [f"<unused{i}>" for i in range(size - len(specials) - len(byte_tokens) - len(pieces))]
    tokens = specials + byte_tokens + pieces + unused
    scores = [0.0] * (len(specials) + len(byte_tokens)) + [-float(i) for i in range(len(pieces))]
    scores += [-1e9] * len(unused)
    types = [2, 3, 3, 3, 3] + [6] * len(byte_tokens) + [1] * len(pieces) + [5] * len(unused)
    return tokens, scores, types


@functools.lru_cache(maxsize=1)
def transformers_smollm2() -> Any:
    """transformers' float32 model of the embedded SmolLM2 GGUF, loaded once per process (~20 s on 2 cores).

    Shared by every test that compares against it; treat it as read-only (no .to(), no weight edits).
    """
    import torch
    from transformers import AutoModelForCausalLM

    from model_runtime.weights.source import embedded_model_path

    path = embedded_model_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@functools.lru_cache(maxsize=1)
def transformers_smollm2_tokenizer() -> Any:
    """transformers' tokenizer of the embedded SmolLM2 GGUF, loaded once per process (read-only)."""
    from transformers import AutoTokenizer

    from model_runtime.weights.source import embedded_model_path

    path = embedded_model_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
