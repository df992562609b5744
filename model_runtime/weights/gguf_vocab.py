"""A GGUF file's tokenizer metadata -> a `tokenizers.Tokenizer` (no torch here: the router uses it).

Two vocabularies, after `tokenizer.ggml.model`:
  "gpt2"  byte-level BPE: tokens spelled in GPT-2's byte alphabet, merges as "left right" strings, and a
          pre-tokenizer chosen by `tokenizer.ggml.pre` (how the text is split before merging; it must be the
          split the merges were learned on, or numbers and punctuation tokenize differently).
  "llama" SentencePiece BPE: tokens with scores, bytes as <0xNN> fallback tokens, spaces as U+2581; the merge
          order is recovered from the scores (a merge ranks by the score of the piece it makes).
Control tokens become special tokens (matched whole, dropped by `decode(skip_special_tokens=True)`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from model_runtime.weights.errors import ModelLoadError
from model_runtime.weights.gguf_file import GGUFFile

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
SPM_SPACE = "\u2581"

# Split patterns of the pre-tokenizers that llama.cpp names in tokenizer.ggml.pre.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_PRE = ("default", "gpt-2", "gpt2")
_DIGITS_THEN_GPT2_PRE = ("smollm", "starcoder", "refact", "codeshell", "command-r")
_REGEX_PRE = {
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# llama.cpp (like Llama 3's tokenizer.json) takes a whole pre-token that is itself in the vocab without merging.
_IGNORE_MERGES_PRE = ("llama-bpe", "llama3", "llama-v3", "smaug-bpe")


@dataclass(frozen=True)
class GGUFTokenizer:
    """What a GGUF says about its tokenizer."""

    backend: BackendTokenizer
    bos_token: str | None
    eos_token: str | None
    eos_token_ids: tuple[int, ...]
    chat_template: str | None


def tokenizer_from_gguf(gguf: GGUFFile) -> GGUFTokenizer:
    """Build the tokenizer the file describes; unknown tokenizer kinds raise `ModelLoadError`."""
    kind = gguf.get_str("tokenizer.ggml.model")
    tokens = [str(t) for t in gguf.get_list("tokenizer.ggml.tokens")]
    types = (
        [int(t) for t in gguf.get_list("tokenizer.ggml.token_type")]
        if gguf.has("tokenizer.ggml.token_type")
        else [1] * len(tokens)
    )
    if kind == "gpt2":
        backend = _byte_level_bpe(gguf, tokens, types)
        add_bos_default = False
    elif kind == "llama":
        backend = _sentencepiece_bpe(gguf, tokens, types)
        add_bos_default = True
    else:
        raise ModelLoadError(f"{gguf.path}: tokenizer.ggml.model {kind!r} is not supported (gpt2 or llama)")
    bos = _token(gguf, tokens, "tokenizer.ggml.bos_token_id")
    eos = _token(gguf, tokens, "tokenizer.ggml.eos_token_id")
    _add_post_processor(backend, gguf, bos, eos, add_bos_default)
    eos_ids = [
        gguf.get_int(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if gguf.has(k)
    ]
    template = gguf.get_str("tokenizer.chat_template") if gguf.has("tokenizer.chat_template") else None
    return GGUFTokenizer(backend, bos, eos, tuple(dict.fromkeys(eos_ids)), template)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of each byte: printable Latin-1 bytes as themselves, the rest from U+0100 on."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    spelling = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling


def _byte_level_bpe(gguf: GGUFFile, tokens: list[str], types: list[int]) -> BackendTokenizer:
    pre = gguf.get_str("tokenizer.ggml.pre", "default")
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    # Tokens llama.cpp wrote with raw characters (some user-defined ones) are respelled in the byte alphabet.
    spelled = [t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")) for t in tokens]
    merges = [_split_merge(gguf, m) for m in gguf.get_list("tokenizer.ggml.merges")]
    vocab = {token: i for i, token in enumerate(spelled)}
    backend = BackendTokenizer(models.BPE(vocab, merges, ignore_merges=pre in _IGNORE_MERGES_PRE))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(gguf, pre)
    backend.decoder = decoders.ByteLevel()
    # A control token spelled outside the byte alphabet would be a new token past the model's vocab: skip it.
    _add_special_tokens(backend, tokens, types, keep=lambda t: set(t) <= alphabet)
    return backend


def _byte_level_pre_tokenizer(gguf: GGUFFile, pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in _GPT2_PRE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in _REGEX_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_REGEX_PRE[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    known = ", ".join([*_GPT2_PRE, *_DIGITS_THEN_GPT2_PRE, *_REGEX_PRE])
    raise ModelLoadError(f"{gguf.path}: tokenizer.ggml.pre {pre!r} is not supported; supported: {known}")


def _sentencepiece_bpe(gguf: GGUFFile, tokens: list[str], types: list[int]) -> BackendTokenizer:
    scores = [float(s) for s in gguf.get_list("tokenizer.ggml.scores")]
    if len(scores) != len(tokens):
        raise ModelLoadError(f"{gguf.path}: {len(scores)} tokenizer scores for {len(tokens)} tokens")
    vocab = {token: i for i, token in enumerate(tokens)}
    unk = _token(gguf, tokens, "tokenizer.ggml.unknown_token_id")
    model = models.BPE(
        vocab, merges_from_scores(tokens, scores), unk_token=unk, fuse_unk=True, byte_fallback=True
    )
    backend = BackendTokenizer(model)
    add_prefix = gguf.get_bool("tokenizer.ggml.add_space_prefix", True)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SPM_SPACE, prepend_scheme="first" if add_prefix else "never", split=False
    )
    steps = [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    _add_special_tokens(backend, tokens, types, keep=lambda t: True)
    return backend


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges in priority order: every split of a piece into two vocab pieces, ranked by the
    piece's score (higher first), then by longer left part, then longer right part."""
    vocab = {token: i for i, token in enumerate(tokens)}
    candidates: list[tuple[float, int, int, int, int, str, str]] = []
    for piece, score in zip(tokens, scores):
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                candidates.append((-score, -len(left), -len(right), vocab[left], vocab[right], left, right))
    candidates.sort()
    return [(left, right) for *_, left, right in candidates]


def _add_special_tokens(
    backend: BackendTokenizer, tokens: list[str], types: list[int], keep: Callable[[str], bool]
) -> None:
    control = [t for t, kind in zip(tokens, types) if kind == TOKEN_TYPE_CONTROL and keep(t)]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    user = [t for t, kind in zip(tokens, types) if kind == TOKEN_TYPE_USER_DEFINED and keep(t)]
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])


def _add_post_processor(
    backend: BackendTokenizer, gguf: GGUFFile, bos: str | None, eos: str | None, add_bos_default: bool
) -> None:
    # BOS/EOS are added by the backend's post-processor, as a tokenizer.json would, so encode() stays one call.
    add_bos = gguf.get_bool("tokenizer.ggml.add_bos_token", add_bos_default) and bos is not None
    add_eos = gguf.get_bool("tokenizer.ggml.add_eos_token", False) and eos is not None
    if not (add_bos or add_eos):
        return
    head = f"{bos}:0 " if add_bos else ""
    tail = f" {eos}:0" if add_eos else ""
    specials = [
        (t, backend.token_to_id(t)) for t in (bos if add_bos else None, eos if add_eos else None) if t
    ]
    backend.post_processor = processors.TemplateProcessing(
        single=f"{head}$A:0{tail}", pair=f"{head}$A:0{tail} $B:1{tail}", special_tokens=specials
    )


def _token(gguf: GGUFFile, tokens: list[str], key: str) -> str | None:
    if not gguf.has(key):
        return None
    index = gguf.get_int(key)
    if not 0 <= index < len(tokens):
        raise ModelLoadError(
            f"{gguf.path}: {key} = {index} is outside the vocabulary of {len(tokens)} tokens"
        )
    return tokens[index]


def _split_merge(gguf: GGUFFile, merge: object) -> tuple[str, str]:
    left, sep, right = str(merge).partition(" ")
    if not sep or not left or not right:
        raise ModelLoadError(f"{gguf.path}: tokenizer merge {merge!r} is not of the form 'left right'")
    return left, right
