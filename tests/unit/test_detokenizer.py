"""IncrementalDetokenizer: deltas join to the full decode and never end inside a UTF-8 character."""

from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import SentencePieceBPETokenizer
from tokenizers import Tokenizer as BackendTokenizer

from model_runtime.detokenizer import IncrementalDetokenizer
from model_runtime.tokenizer import Tokenizer
from tests.model.tiny_models import tiny_tokenizer_json

pytestmark = pytest.mark.unit

MULTIBYTE_TEXT = "Say 日本語 and 🎉👍🏽 then ж, ß, 👨‍👩‍👧 — done ✓"


@functools.lru_cache(maxsize=1)
def byte_level() -> Tokenizer:
    """The tiny byte-level BPE of the model tests: characters it has not merged arrive as single-byte tokens."""
    return Tokenizer(BackendTokenizer.from_str(tiny_tokenizer_json()), name="tiny-bpe")


@functools.lru_cache(maxsize=1)
def sentencepiece() -> Tokenizer:
    """A Metaspace tokenizer: its decoder drops the leading space of the first token it decodes."""
    learner = SentencePieceBPETokenizer()
    learner.train_from_iterator(["The capital of France is Paris. Paris is big."] * 5, vocab_size=60)
    return Tokenizer(BackendTokenizer.from_str(learner.to_str()), name="tiny-spm")


def stream(tokenizer: Tokenizer, prompt: list[int], output: list[int], chunk: int = 1) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [detok.push(output[i : i + chunk]) for i in range(0, len(output), chunk)]
    pieces.append(detok.finish())
    assert "".join(pieces) == detok.text
    return pieces


def test_multibyte_characters_are_held_back_until_complete() -> None:
    tok = byte_level()
    ids = tok.encode(MULTIBYTE_TEXT)
    partial = [i for i in ids if "\ufffd" in tok.decode([i])]
    assert len(partial) > 5, "the text must exercise characters split over byte tokens"
    pieces = stream(tok, [], ids)
    assert "".join(pieces) == tok.decode(ids) == MULTIBYTE_TEXT
    assert not any("\ufffd" in piece for piece in pieces)
    assert pieces.count("") >= 3  # byte tokens of an unfinished character produce no text yet


def test_prompt_context_gives_the_same_text_for_byte_level_bpe() -> None:
    tok = byte_level()
    prompt, output = tok.encode("Question: 日本?"), tok.encode(" Answer: 🎉 yes")
    assert "".join(stream(tok, prompt, output)) == tok.decode(output)
    assert "".join(stream(tok, prompt, output, chunk=3)) == tok.decode(output)


def test_sentencepiece_first_token_keeps_its_space_after_the_prompt() -> None:
    tok = sentencepiece()
    prompt, output = tok.encode("The capital of France is"), tok.encode("Paris. Paris")
    whole = tok.decode(prompt + output)
    joined = "".join(stream(tok, prompt, output))
    assert joined == whole[len(tok.decode(prompt)) :] == " Paris. Paris"
    assert tok.decode(output) == "Paris. Paris"  # decoded alone the space is lost; in context it is not


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(min_value=0, max_value=511), max_size=40), chunk=st.integers(1, 4))
def test_random_token_streams_join_to_the_full_decode(ids: list[int], chunk: int) -> None:
    tok = byte_level()
    pieces = stream(tok, [], ids, chunk)
    assert "".join(pieces) == tok.decode(ids)
    # Only the final flush may end in U+FFFD (an unfinished character at the very end of the output).
    assert not any(piece.endswith("\ufffd") for piece in pieces[:-1])


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=30), cut=st.integers(0, 30))
def test_any_text_split_anywhere_streams_exactly(text: str, cut: int) -> None:
    tok = byte_level()
    ids = tok.encode(text)
    pieces = stream(tok, ids[:cut], ids[cut:])
    # Exact even when the cut falls inside a character (the output then starts with orphan bytes).
    assert "".join(pieces) == tok.decode(ids[cut:])
    assert not any(piece.endswith("\ufffd") for piece in pieces[:-1])
