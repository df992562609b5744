"""Tokenizers against transformers: the embedded SmolLM2 GGUF, a tiny HF dir, tiny GGUFs (BPE and SentencePiece)."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from model_runtime.tokenizer import ChatMessage, ChatTemplateError, Tokenizer
from model_runtime.weights import ModelLoadError
from tests.model.tiny_models import transformers_smollm2_tokenizer, write_tiny_gguf, write_tiny_hf

pytestmark = pytest.mark.model

TEXTS = [
    "Hello, world!",
    "The year 2024 had 366 days; 3.14159 is pi and 1,000,000 is a million.",
    "naïve café résumé Ångström — “quotes” and ‘single’ … ellipsis",
    "日本語のテキストと中文文本，한국어 텍스트도 있습니다。",
    "Ελληνικά и кириллица, ßẞ, עברית, العربية",
    "Emoji: 🎉🚀👍🏽 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 and ✓ ✗",
    "def f(x):\n    return {'a': [x ** 2 for x in range(10)]}  # comment\n",
    "    leading spaces, trailing spaces    ",
    "multiple   spaces\t\ttabs\n\n\nnewlines\r\nwindows",
    "It's they're we'll I'm you've she'd DON'T",
    "<|im_start|>user\nspecial tokens inside text<|im_end|>",
    "",
    " ",
    "a",
    "\u0000\u0001 control chars and \ufffd replacement",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime. 素数?"},
        {"role": "assistant", "content": "7 🎉"},
        {"role": "user", "content": "Another."},
    ],
]


def _hf_ids(encoded: Any) -> list[int]:
    # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True); older versions a list.
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def assert_same_tokenization(ours: Tokenizer, hf: Any, texts: list[str]) -> None:
    for text in texts:
        for special in (True, False):
            expected = hf.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == expected, (text, special)
        ids = hf.encode(text, add_special_tokens=True)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), (
                text
            )


def assert_same_chat(ours: Tokenizer, hf: Any) -> None:
    for messages in CONVERSATIONS:
        for gen in (True, False):
            expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(messages, add_generation_prompt=gen) == expected
            hf_ids = _hf_ids(hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen))
            assert ours.encode_chat(messages, add_generation_prompt=gen) == hf_ids


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    return Tokenizer.from_spec("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def smollm2_hf() -> Any:
    return transformers_smollm2_tokenizer()


def test_smollm2_encode_decode_equal_transformers(smollm2: Tokenizer, smollm2_hf: Any) -> None:
    assert_same_tokenization(smollm2, smollm2_hf, TEXTS)


def test_smollm2_decodes_random_ids_like_transformers(smollm2: Tokenizer, smollm2_hf: Any) -> None:
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(smollm2.vocab_size) for _ in range(rng.randrange(1, 40))]
        assert smollm2.decode(ids) == smollm2_hf.decode(ids, skip_special_tokens=True)


def test_smollm2_chat_template_equals_transformers(smollm2: Tokenizer, smollm2_hf: Any) -> None:
    assert_same_chat(smollm2, smollm2_hf)


def test_smollm2_special_tokens(smollm2: Tokenizer, smollm2_hf: Any) -> None:
    assert smollm2.vocab_size == len(smollm2_hf) == 49152
    assert smollm2.bos_token_id == smollm2_hf.bos_token_id == 1
    assert smollm2.eos_token_ids == (smollm2_hf.eos_token_id,) == (2,)
    assert smollm2.id_to_token(2) == "<|im_end|>"
    # SmolLM2 was trained with digits split one by one (llama.cpp's "smollm" pre-tokenizer).
    assert smollm2.encode("12345") == [smollm2.token_to_id(d) for d in "12345"]


def test_chat_messages_as_objects_tuples_and_mappings_render_alike(smollm2: Tokenizer) -> None:
    as_dicts = smollm2.apply_chat_template(CONVERSATIONS[1])
    as_objects = smollm2.apply_chat_template([ChatMessage(m["role"], m["content"]) for m in CONVERSATIONS[1]])
    as_tuples = smollm2.apply_chat_template([(m["role"], m["content"]) for m in CONVERSATIONS[1]])
    assert as_dicts == as_objects == as_tuples
    with pytest.raises(ChatTemplateError, match=r"messages\[0\]\.content"):
        smollm2.apply_chat_template([ChatMessage("user", None)])  # type: ignore[arg-type]
    with pytest.raises(ChatTemplateError, match=r"messages\[1\]\.role"):
        smollm2.apply_chat_template([("user", "hi"), ("", "x")])


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf(tmp_path_factory.mktemp("tok"), "llama")


def test_tiny_hf_dir_equals_transformers(tiny_dir: Path) -> None:
    from transformers import AutoTokenizer

    ours, hf = Tokenizer.from_spec(str(tiny_dir)), AutoTokenizer.from_pretrained(tiny_dir)
    assert_same_tokenization(ours, hf, TEXTS)
    assert_same_chat(ours, hf)
    assert (ours.bos_token_id, ours.eos_token_ids, ours.vocab_size) == (1, (2,), len(hf))


@pytest.mark.parametrize("kind", ["bpe", "spm"])
def test_tiny_gguf_tokenizers_equal_transformers(tmp_path: Path, kind: str) -> None:
    from transformers import AutoTokenizer

    path = write_tiny_gguf(tmp_path, tokenizer=kind)
    ours = Tokenizer.from_spec(str(path))
    hf = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert_same_tokenization(ours, hf, TEXTS)
    assert_same_chat(ours, hf)
    if kind == "spm":
        assert ours.encode("hi")[0] == ours.bos_token_id == 1  # SentencePiece vocabularies add BOS by default
        ids = ours.encode("жизнь", add_special_tokens=False)  # letters the vocabulary lacks: byte fallback
        assert all(str(ours.id_to_token(i)).startswith("<0x") for i in ids[1:])
        assert ours.decode(ids) == "жизнь"


def test_template_errors_are_chat_template_errors(tiny_dir: Path, tmp_path: Path) -> None:
    backend = Tokenizer.from_spec(str(tiny_dir)).backend
    strict = Tokenizer(backend, chat_template="{{ raise_exception('roles must alternate') }}", name="strict")
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        strict.apply_chat_template([("user", "hi")])
    broken = Tokenizer(backend, chat_template="{% for m in messages %}", name="broken")
    with pytest.raises(ChatTemplateError, match="does not parse"):
        broken.apply_chat_template([("user", "hi")])
    plain = Tokenizer(backend, name="plain")
    with pytest.raises(ChatTemplateError, match="no chat template"):
        plain.encode_chat([("user", "hi")])
    sandboxed = Tokenizer(backend, chat_template="{{ ''.__class__.__mro__ }}", name="evil")
    with pytest.raises(ChatTemplateError):
        sandboxed.apply_chat_template([("user", "hi")])


def test_chat_template_jinja_file_and_missing_tokenizer(tiny_dir: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tiny_dir, copy)
    (copy / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    )
    assert Tokenizer.from_spec(str(copy)).apply_chat_template([("user", "x")]) == "[user]x"
    (copy / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"no tokenizer\.json"):
        Tokenizer.from_spec(str(copy))


def test_tokenizer_imports_no_torch() -> None:
    code = (
        "import sys; from model_runtime.tokenizer import Tokenizer; from model_runtime.detokenizer import "
        "IncrementalDetokenizer; import model_runtime.weights; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path.cwd())
    assert result.returncode == 0, result.stderr
