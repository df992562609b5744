"""router.validation: every bad field of a GenerateRequest is refused with a status naming it; good requests come
out with the prompt tokenized and every sampling value resolved. Uses a tiny word-level tokenizer built here."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

from model_runtime.request import MAX_STOP_STRINGS
from model_runtime.tokenizer import Tokenizer
from router.config import RouterConfig, RouterConfigError
from router.errors import RouterError
from router.model import ServedModel
from router.validation import engine_sampling, validate_request
from tandem_api.tandem.v1 import generate_pb2
from worker_host.convert import sampling_from_proto

pytestmark = pytest.mark.unit

WORDS = ["<unk>", "<eos>", "<|user|>", "<|assistant|>", "hello", "world", "stop", "a", "b", "c"]
VOCAB = len(WORDS)
CONTEXT = 32
TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|> {{ m.content }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def _model(chat_template: str | None = TEMPLATE) -> ServedModel:
    backend = BackendTokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = WhitespaceSplit()
    tok = Tokenizer(backend, eos_token="<eos>", chat_template=chat_template, name="tiny")
    return ServedModel(id="tiny", tokenizer=tok, vocab_size=VOCAB, max_model_len=CONTEXT, eos_token_ids=(1,))


MODEL = _model()
CONFIG = RouterConfig(default_max_tokens=16)


def _request(text: str | None = "hello world", **sampling: object) -> generate_pb2.GenerateRequest:
    message = generate_pb2.GenerateRequest(sampling=generate_pb2.SamplingParams(**sampling))
    if text is not None:
        message.text = text
    return message


def _rejected(message: generate_pb2.GenerateRequest, config: RouterConfig = CONFIG) -> RouterError:
    with pytest.raises(RouterError) as info:
        validate_request(message, MODEL, config)
    return info.value


def _chat(*pairs: tuple[str, str]) -> generate_pb2.GenerateRequest:
    message = generate_pb2.GenerateRequest()
    message.chat.messages.extend(generate_pb2.ChatMessage(role=r, content=c) for r, c in pairs)
    return message


def _ids(*ids: int) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=list(ids)))


@pytest.mark.parametrize(
    ("message", "prefix"),
    [
        (_request(None), "input: one of text, token_ids, chat is required"),
        (_request(""), "input.text: must not be empty"),
        (_ids(), "input.token_ids: must hold at least one token id"),
        (_ids(4, 70000), f"input.token_ids: 70000 is outside the vocabulary [0, {VOCAB})"),
        (_chat(), "input.chat.messages: must hold at least one message"),
        (_chat(("user", "hello"), ("<|assistant|>", "x")), "input.chat.messages[1].role: must be one of"),
        (_chat(("user", "hello"), ("", "x")), "input.chat.messages[1].role:"),
        (_request(temperature=-0.5), "sampling.temperature: must be a finite number >= 0"),
        (_request(temperature=float("nan")), "sampling.temperature:"),
        (_request(top_p=0.0), "sampling.top_p: must be in (0, 1]"),
        (_request(top_p=1.5), "sampling.top_p:"),
        (_request(top_k=-2), "sampling.top_k:"),
        (_request(seed=2**63), "sampling.seed: must be an integer in [0, 2^63)"),
        (
            _request(max_tokens=0),
            "sampling.max_tokens: must be an integer >= 1, got 0 (0 only with prompt_logprobs",
        ),
        (_request(stop=[""]), "sampling.stop: each stop string must be 1..256 characters"),
        (_request(stop=["x" * 257]), "sampling.stop:"),
        (_request(stop=["s"] * (MAX_STOP_STRINGS + 1)), f"sampling.stop: at most {MAX_STOP_STRINGS}"),
        (_request(stop_token_ids=[VOCAB]), f"sampling.stop_token_ids: {VOCAB} is outside the vocabulary"),
        (_request(logprobs=21), "sampling.logprobs: must be an integer in [0, 20]"),
        (
            _request(logit_bias={VOCAB: 1.0}),
            f"sampling.logit_bias: token id {VOCAB} is outside the vocabulary",
        ),
        (
            _request(logit_bias={5: 100.5}),
            "sampling.logit_bias: token 5: the bias must be a number in [-100, 100]",
        ),
        (_request(logit_bias={5: float("inf")}), "sampling.logit_bias: token 5:"),
        (_request(presence_penalty=2.5), "sampling.presence_penalty: must be a number in [-2, 2], got 2.5"),
        (_request(frequency_penalty=float("nan")), "sampling.frequency_penalty: must be a number in [-2, 2]"),
        (
            _request(repetition_penalty=0.0),
            "sampling.repetition_penalty: must be a number in (0, 10], got 0.0",
        ),
        (
            _request(repetition_penalty=11.0),
            "sampling.repetition_penalty: must be a number in (0, 10], got 11.0",
        ),
        (_request(prompt_logprobs=21), "sampling.prompt_logprobs: must be an integer in [0, 20], got 21"),
        (generate_pb2.GenerateRequest(text="hello", request_id=""), "request_id: must be 1..128 characters"),
        (generate_pb2.GenerateRequest(text="hello", request_id="r" * 129), "request_id: must be 1..128"),
        (
            generate_pb2.GenerateRequest(text="hello", request_id="a\nb"),
            "request_id: must not contain control",
        ),
        (_request(" ".join(["a"] * CONTEXT)), f"input: {CONTEXT} tokens leave no room for output"),
        (_request("   "), "input.text: tokenizes to no tokens"),
        (
            _request("a b c", max_tokens=CONTEXT - 2),
            "sampling.max_tokens: 30 plus the prompt's 3 tokens exceed",
        ),
    ],
)
def test_bad_field_is_invalid_argument_naming_it(message: generate_pb2.GenerateRequest, prefix: str) -> None:
    error = _rejected(message)
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details.startswith(prefix), error.details


def test_unknown_model_is_not_found_and_names_the_served_one() -> None:
    error = _rejected(generate_pb2.GenerateRequest(model="x", text="hello"))
    assert error.code == grpc.StatusCode.NOT_FOUND
    assert error.details == "model: unknown model 'x'; serving 'tiny'"


def test_served_or_empty_model_name_is_accepted() -> None:
    for name in ("tiny", ""):
        request = validate_request(generate_pb2.GenerateRequest(model=name, text="hello"), MODEL, CONFIG)
        assert request.prompt_token_ids == (4,)


def test_router_prompt_limit_is_enforced_below_the_context() -> None:
    error = _rejected(_request("a b c d"), RouterConfig(max_prompt_tokens=3))
    assert error.details == "input: 4 tokens exceed the router's limit of 3"


def test_model_without_chat_template_rejects_chat_naming_the_input() -> None:
    with pytest.raises(RouterError) as info:
        validate_request(_chat(("user", "hello")), _model(chat_template=None), CONFIG)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details.startswith("input.chat: tiny: the model has no chat template")


def test_text_chat_and_token_ids_become_prompt_ids() -> None:
    assert validate_request(_request("hello world stop"), MODEL, CONFIG).prompt_token_ids == (4, 5, 6)
    chat = validate_request(_chat(("user", "hello"), ("assistant", "world")), MODEL, CONFIG)
    assert chat.prompt_token_ids == (2, 4, 3, 5, 3)  # <|user|> hello <|assistant|> world <|assistant|>
    assert validate_request(_ids(9, 8, 7), MODEL, CONFIG).prompt_token_ids == (9, 8, 7)


def test_unset_sampling_fields_take_defaults_and_max_tokens_is_clamped_to_the_room() -> None:
    request = validate_request(_request("a b c"), MODEL, RouterConfig(default_max_tokens=256))
    s = request.sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed, s.logprobs, s.stop) == (1.0, 1.0, 0, None, None, ())
    assert s.max_tokens == CONTEXT - 3  # the default would not fit: clamped, not rejected
    assert validate_request(_request("a b c"), MODEL, CONFIG).sampling.max_tokens == 16


def test_given_sampling_fields_are_kept() -> None:
    message = _request(
        "a",
        temperature=0.0,
        top_p=0.5,
        top_k=-1,
        seed=7,
        max_tokens=CONTEXT - 1,
        stop=["b"],
        stop_token_ids=[6],
        ignore_eos=True,
        logprobs=0,
        logit_bias={9: -100.0, 4: 2.5},
    )
    s = validate_request(message, MODEL, CONFIG).sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed, s.max_tokens) == (0.0, 0.5, -1, 7, CONTEXT - 1)
    assert (s.stop, s.stop_token_ids, s.ignore_eos, s.logprobs) == (("b",), (6,), True, 0)
    assert s.logit_bias == ((4, 2.5), (9, -100.0))


def test_request_id_is_echoed_or_generated_uniquely() -> None:
    given = validate_request(generate_pb2.GenerateRequest(text="a", request_id="my-id"), MODEL, CONFIG)
    assert given.request_id == "my-id"
    first, second = (validate_request(_request("a"), MODEL, CONFIG).request_id for _ in range(2))
    assert first != second and len(first) == 32


def test_engine_sampling_carries_every_resolved_value() -> None:
    s = validate_request(
        _request("a", temperature=0.7, top_k=5, seed=3, stop=["x"], logprobs=2), MODEL, CONFIG
    )
    engine = engine_sampling(s.sampling)
    assert engine.temperature == pytest.approx(0.7) and engine.top_p == 1.0 and engine.top_k == 5
    assert engine.seed == 3 and engine.HasField("logprobs") and engine.logprobs == 2
    assert engine.max_tokens == 16 and not engine.ignore_eos
    unseeded = engine_sampling(validate_request(_request("a"), MODEL, CONFIG).sampling)
    assert not unseeded.HasField("seed") and not unseeded.HasField("logprobs") and not unseeded.logit_bias
    biased = validate_request(_request("a", logit_bias={3: -100.0, 8: 1.5}), MODEL, CONFIG).sampling
    assert dict(engine_sampling(biased).logit_bias) == {3: -100.0, 8: 1.5}
    assert (
        sampling_from_proto(engine_sampling(biased)).logit_bias == biased.logit_bias
    )  # what the workers get
    penalized = validate_request(
        _request("a", presence_penalty=0.5, frequency_penalty=-1.25, repetition_penalty=1.3), MODEL, CONFIG
    ).sampling
    assert (penalized.presence_penalty, penalized.frequency_penalty, penalized.repetition_penalty) == (
        0.5,
        -1.25,
        1.3,
    )
    assert validate_request(_request("a"), MODEL, CONFIG).sampling.repetition_penalty == 1.0  # unset: off
    assert not engine_sampling(validate_request(_request("a"), MODEL, CONFIG).sampling).HasField(
        "repetition_penalty"
    )
    # every field the workers need arrives, stop strings excepted (the router applies them)
    assert sampling_from_proto(engine_sampling(penalized)) == dataclasses.replace(penalized, stop=())


def test_max_tokens_zero_with_prompt_logprobs_scores_the_prompt_only() -> None:
    """The workers sample one token (the engine always does) which the router drops: score_only."""
    scored = validate_request(_request("a b", max_tokens=0, prompt_logprobs=2), MODEL, CONFIG)
    assert scored.score_only and scored.sampling.max_tokens == 1 and scored.sampling.prompt_logprobs == 2
    engine = engine_sampling(scored.sampling)
    assert engine.HasField("prompt_logprobs") and engine.prompt_logprobs == 2 and engine.max_tokens == 1
    assert sampling_from_proto(engine) == dataclasses.replace(scored.sampling, stop=())
    both = validate_request(_request("a", max_tokens=3, prompt_logprobs=0), MODEL, CONFIG)
    assert not both.score_only and both.sampling.prompt_logprobs == 0
    plain = validate_request(_request("a"), MODEL, CONFIG)
    assert not plain.score_only and plain.sampling.prompt_logprobs is None
    assert not engine_sampling(plain.sampling).HasField("prompt_logprobs")


@pytest.mark.parametrize(
    ("kwargs", "prefix"),
    [
        ({"port": 70000}, "port:"),
        ({"max_queue": -1}, "max_queue:"),
        ({"max_inflight": 0}, "max_inflight:"),
        ({"request_timeout_s": 0}, "request_timeout_s:"),
        ({"poll_interval_s": float("inf")}, "poll_interval_s:"),
        ({"max_prompt_tokens": 0}, "max_prompt_tokens:"),
        ({"model": " "}, "model:"),
    ],
)
def test_router_config_errors_name_the_field(kwargs: dict[str, object], prefix: str) -> None:
    with pytest.raises(RouterConfigError, match=f"^{prefix}"):
        RouterConfig(**kwargs)  # type: ignore[arg-type]


def test_router_server_import_leaves_torch_out() -> None:
    # The import-linter contract on the router (pyproject.toml) ignores one edge it cannot judge statically,
    # the call-time torch import in model_runtime.config's DeviceConfig.resolved_device; this run checks it.
    code = "import sys, router.server; sys.exit(1 if 'torch' in sys.modules or 'ray' in sys.modules else 0)"
    repo = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr or "router.server imported torch or ray"


def test_router_entry_point_maps_the_deploy_config_onto_the_router(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The router runs as `python -m deploy.router --config FILE` (the chart's command, and a standalone router):
    # its settings are the deploy config's router section.
    from deploy.config import parse_config
    from deploy.router import main
    from deploy.router_inputs import router_config

    c = router_config(parse_config({"router": {"port": 0, "max_queue": 3, "request_timeout_s": 1.5}}))
    assert (c.port, c.max_queue, c.request_timeout_s, c.max_model_len) == (0, 3, 1.5, None)
    bad = tmp_path / "router.yaml"
    bad.write_text("router:\n  max_queue: -1\n")
    assert main(["--config", str(bad)]) == 2
    assert capsys.readouterr().err.strip() == "tandem router: router.max_queue: must be >= 1, got -1"


@pytest.mark.parametrize(
    ("router", "message"),
    [
        ({"auth": {"api_keys_file": 7}}, "router.auth.api_keys_file: must be the path of the API key file"),
        (
            {"auth": {"reload_interval_s": 0}},
            "router.auth.reload_interval_s: must be a number of seconds > 0",
        ),
        ({"auth": {"keys": []}}, "router.auth.keys: unknown key; allowed: api_keys_file, reload_interval_s"),
        ({"auth": "keys.yaml"}, "router.auth: must be a mapping"),
    ],
)
def test_router_auth_config_errors_name_the_field(router: dict[str, object], message: str) -> None:
    from deploy.config import parse_config
    from model_runtime.config import ConfigError

    with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
        parse_config({"router": router})


def test_router_auth_maps_onto_the_router_and_a_bad_key_file_stops_the_standalone_router(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from deploy.config import parse_config
    from deploy.router import main
    from deploy.router_inputs import router_config

    assert router_config(parse_config({})).api_keys_file is None  # off by default
    keys = tmp_path / "keys.yaml"
    c = router_config(
        parse_config({"router": {"auth": {"api_keys_file": str(keys), "reload_interval_s": 0.5}}})
    )
    assert (c.api_keys_file, c.api_keys_reload_s) == (str(keys), 0.5)
    keys.write_text("keys:\n  - name: a\n    secret: too-short\n")
    config = tmp_path / "router.yaml"
    config.write_text(
        f"router:\n  port: 0\n  http_port: 0\n  metrics_port: 0\n  auth: {{api_keys_file: {keys}}}\n"
    )
    assert main(["--config", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tandem router: router.auth.api_keys_file: ") and "keys[0].secret: must be" in err
    assert "too-short" not in err


def test_the_spill_threshold_reaches_the_routers_placer_and_a_negative_one_is_refused() -> None:
    from deploy.config import parse_config
    from deploy.router_inputs import router_config
    from model_runtime.config import ConfigError
    from router.placement import placer_for

    assert (
        placer_for(router_config(parse_config({}))).local_prefill.spill_queued_tokens == 0
    )  # off by default
    c = router_config(parse_config({"router": {"local_prefill_spill_tokens": 8192}}))
    assert placer_for(c).local_prefill.spill_queued_tokens == 8192
    with pytest.raises(ConfigError, match=r"^router\.local_prefill_spill_tokens: must be >= 0"):
        parse_config({"router": {"local_prefill_spill_tokens": -1}})


def test_the_stream_interval_reaches_the_router_and_a_bad_one_names_the_key() -> None:
    from deploy.config import parse_config
    from deploy.router_inputs import router_config
    from model_runtime.config import ConfigError

    assert router_config(parse_config({})).stream_interval == 1  # every step's tokens as they come
    assert router_config(parse_config({"router": {"stream_interval": 8}})).stream_interval == 8
    for bad in (0, 257, "4", True):
        with pytest.raises(ConfigError, match=r"^router\.stream_interval: must be an integer in \[1, 256\]"):
            parse_config({"router": {"stream_interval": bad}})
    with pytest.raises(RouterConfigError, match=r"stream_interval: must be an integer in \[1, 256\]"):
        RouterConfig(model="m", stream_interval=0)
