"""The OpenAI adapter's translation, from plain values: JSON bodies -> the router's GenerateRequest, and the
router's gRPC errors -> HTTP statuses with OpenAI's error object (router/openai_api/requests.py, errors.py)."""

from __future__ import annotations

import grpc
import pytest

from router.errors import RouterError
from router.openai_api.errors import ApiError, from_router_error, openai_param
from router.openai_api.requests import parse_chat, parse_completion

pytestmark = pytest.mark.unit


def test_a_completion_becomes_the_same_internal_request_a_grpc_client_sends() -> None:
    r = parse_completion(
        {"model": "m", "prompt": "hi", "max_tokens": 7, "temperature": 0, "top_p": 0.9, "top_k": 5, "seed": 3,
         "stop": "\n", "logprobs": 2, "stream": True, "stream_options": {"include_usage": True}, "user": "u",
         "some_future_field": {"x": 1}}
    )  # fmt: skip
    m = r.message
    assert (m.model, m.text, m.WhichOneof("input")) == ("m", "hi", "text")
    s = m.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, list(s.stop), s.logprobs) == (
        7, 0.0, pytest.approx(0.9), 5, 3, ["\n"], 2,
    )  # fmt: skip
    assert (r.chat, r.stream, r.include_usage, r.logprobs) == (False, True, True, 2)
    assert m.request_id.startswith("cmpl-")
    assert m.sampling.ignore_eos is False and not m.sampling.stop_token_ids


@pytest.mark.parametrize("prompt", [[1, 2, 3], [[1, 2, 3]]])
def test_token_id_prompts(prompt: list) -> None:
    assert list(parse_completion({"prompt": prompt}).message.token_ids.ids) == [1, 2, 3]


def test_a_chat_takes_text_parts_the_developer_role_and_max_completion_tokens_first() -> None:
    r = parse_chat(
        {"messages": [{"role": "developer", "content": "be brief"},
                      {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
         "max_completion_tokens": 4, "max_tokens": 99, "logprobs": True, "top_logprobs": 3}
    )  # fmt: skip
    roles = [(m.role, m.content) for m in r.message.chat.messages]
    assert roles == [("system", "be brief"), ("user", "ab")]
    assert r.message.sampling.max_tokens == 4 and r.max_tokens_field == "max_completion_tokens"
    assert r.logprobs == 3 and r.message.sampling.logprobs == 3
    assert r.message.request_id.startswith("chatcmpl-")


def test_n_choices_are_requests_of_their_own_with_seeds_one_apart() -> None:
    r = parse_completion({"prompt": "hi", "n": 3, "seed": 2**63 - 2, "max_tokens": 5, "stream": True})
    messages = r.choice_messages()
    assert r.n == 3 and [m.request_id for m in messages] == [f"{r.request_id}-{i}" for i in range(3)]
    assert [m.sampling.seed for m in messages] == [2**63 - 2, 2**63 - 1, 0]  # within [0, 2^63)
    assert all(m.text == "hi" and m.sampling.max_tokens == 5 for m in messages)
    assert r.message.sampling.seed == 2**63 - 2  # the copies are copies
    unseeded = parse_chat({"messages": [{"role": "user", "content": "a"}], "n": 2}).choice_messages()
    assert not any(m.sampling.HasField("seed") for m in unseeded)
    one = parse_completion({"prompt": "hi"})
    assert one.n == 1 and one.choice_messages() == [one.message]


def test_a_list_of_prompts_is_each_prompts_n_choices_in_order() -> None:
    r = parse_completion({"prompt": ["ab", [5, 6]], "n": 2, "seed": 9, "max_tokens": 3})
    messages = r.choice_messages()
    assert r.num_prompts == 2 and [m.request_id for m in messages] == [
        f"{r.request_id}-{i}" for i in range(4)
    ]
    inputs = [m.text if m.WhichOneof("input") == "text" else list(m.token_ids.ids) for m in messages]
    assert inputs == ["ab", "ab", [5, 6], [5, 6]]
    assert [m.sampling.seed for m in messages] == [9, 10, 9, 10]  # choice j of any prompt: seed + j
    assert all(m.sampling.max_tokens == 3 for m in messages)
    assert parse_completion({"prompt": [[1, 2]]}).num_prompts == 1  # a list of one prompt is that prompt


def test_echo_asks_for_the_prompts_scores_when_they_are_returned_or_alone_wanted() -> None:
    """echo with logprobs: the prompt's scores with as many alternatives; echo with max_tokens 0: scores
    (prompt_logprobs 0), the only way to end a request before its first token; echo alone: the text only."""
    scored = parse_completion({"prompt": ["a", "b"], "echo": True, "logprobs": 3, "max_tokens": 2})
    assert scored.echo and all(m.sampling.prompt_logprobs == 3 for m in scored.choice_messages())
    alone = parse_completion({"prompt": "a", "echo": True, "max_tokens": 0})
    assert alone.message.sampling.HasField("max_tokens") and alone.message.sampling.max_tokens == 0
    assert alone.message.sampling.HasField("prompt_logprobs") and alone.message.sampling.prompt_logprobs == 0
    text_only = parse_completion({"prompt": "a", "echo": True})
    assert text_only.echo and not text_only.message.sampling.HasField("prompt_logprobs")
    assert not parse_completion({"prompt": "a", "logprobs": 2}).message.sampling.HasField("prompt_logprobs")
    assert scored.prompt_of(1).text == "b" and alone.prompt_of(0).text == "a"


def test_prompt_logprobs_ask_for_the_prompts_scores_with_the_wider_top_n_of_it_and_echo() -> None:
    """vLLM's prompt_logprobs: the prompt's scores with that many alternatives, with or without echo; with echo's
    logprobs as well, one request scores the prompt with the wider of the two."""
    alone = parse_completion({"prompt": "a", "prompt_logprobs": 2})
    assert alone.prompt_logprobs == 2 and alone.message.sampling.prompt_logprobs == 2 and not alone.echo
    both = parse_completion({"prompt": "a", "prompt_logprobs": 1, "echo": True, "logprobs": 4})
    assert (both.prompt_logprobs, both.logprobs, both.message.sampling.prompt_logprobs) == (1, 4, 4)
    wider = parse_completion({"prompt": "a", "prompt_logprobs": 5, "echo": True, "logprobs": 0})
    assert wider.message.sampling.prompt_logprobs == 5
    assert parse_completion({"prompt": "a"}).prompt_logprobs is None


@pytest.mark.parametrize(
    ("parse", "body", "param", "message"),
    [
        (parse_completion, {"prompt": "a", "prompt_logprobs": 2, "stream": True}, "prompt_logprobs",
         "is not available with stream: true"),
        (parse_completion, {"prompt": "a", "prompt_logprobs": -1}, "prompt_logprobs", "-1 is out of range"),
        (parse_completion, {"prompt": "a", "prompt_logprobs": 1.5}, "prompt_logprobs", "must be an integer"),
        (parse_chat, {"messages": [{"role": "user", "content": "a"}], "prompt_logprobs": 1}, "prompt_logprobs",
         "is supported on /v1/completions only"),
        (parse_completion, {"prompt": "a", "temperature": "hot"}, "temperature", "must be a number, got a string"),
        (parse_completion, {"prompt": "a", "max_tokens": True}, "max_tokens", "must be an integer, got a boolean"),
        (parse_completion, {"prompt": "a", "max_tokens": 1.5}, "max_tokens", "must be an integer, got a number"),
        (parse_completion, {"prompt": "a", "max_tokens": 0}, "max_tokens", "must be an integer >= 1, got 0"),
        (parse_completion, {"prompt": "a", "seed": -1}, "seed", "-1 is out of range"),
        (parse_completion, {"prompt": "a", "n": 0}, "n", "must be an integer in [1, 64], got 0"),
        (parse_completion, {"prompt": "a", "n": 65}, "n", "must be an integer in [1, 64], got 65"),
        (parse_completion, {"prompt": ["a"] * 33, "n": 2}, "prompt", "33 prompts x n = 2 make more than 64"),
        (parse_completion, {"prompt": ["a", []]}, "prompt[1]", "must be a string or a list of token ids"),
        (parse_completion, {"prompt": ["a", [1, -2]]}, "prompt[1]", "token id -2 is outside the vocabulary"),
        (parse_chat, {"messages": [{"role": "user", "content": "a"}], "n": 1.0}, "n", "must be an integer"),
        (parse_chat, {"messages": [{"role": "user", "content": "a"}], "echo": True}, "echo",
         "is not supported for chat completions"),
        (parse_completion, {"prompt": "a", "echo": 1}, "echo", "must be a boolean, got an integer"),
        (parse_completion, {"prompt": "a", "echo": True, "max_tokens": -1}, "max_tokens",
         "must be an integer >= 0 (with echo), got -1"),

        (parse_completion, {"prompt": "a", "presence_penalty": "a lot"}, "presence_penalty", "must be a number"),
        (parse_chat, {"messages": [{"role": "user", "content": "a"}], "frequency_penalty": True},
         "frequency_penalty", "must be a number, got a boolean"),
        (parse_completion, {"prompt": "a", "logit_bias": [1]}, "logit_bias", "must be an object"),
        (parse_completion, {"prompt": "a", "logit_bias": {"x": 1}}, "logit_bias", "keys must be token ids"),
        (parse_completion, {"prompt": "a", "logit_bias": {"-1": 1}}, "logit_bias", "keys must be token ids"),
        (parse_chat, {"messages": [{"role": "user", "content": "a"}], "logit_bias": {"5": "up"}}, "logit_bias",
         "token 5: the bias must be a number, got a string"),
        (parse_completion, {"prompt": "a", "logit_bias": {"4294967296": 1}}, "logit_bias",
         "token id 4294967296 is outside the vocabulary"),
        (parse_completion, {"prompt": "a", "stop": [1]}, "stop", "must be a string or a list of strings"),
        (parse_completion, {"prompt": [-1]}, "prompt", "token id -1 is outside the vocabulary"),
        (parse_completion, {}, "prompt", "is required"),
        (parse_chat, {"messages": []}, "messages", "must be a non-empty list"),
        (parse_chat, {"messages": [{"role": 1, "content": "a"}]}, "messages[0].role", "must be a string"),
        (parse_chat, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages[0].content[0]", "only text parts are supported, got 'image_url'"),
        (parse_chat, {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, "top_logprobs",
         "needs logprobs: true"),
        (parse_chat, {"messages": [{"role": "user", "content": "a"}], "response_format": {"type": "json_object"}},
         "response_format", "only {'type': 'text'} is supported"),
    ],
)  # fmt: skip
def test_wrong_types_and_unsupported_fields_are_a_400_naming_the_field(parse, body, param, message) -> None:
    with pytest.raises(ApiError) as info:
        parse(body)
    error = info.value
    assert (error.status, error.param) == (400, param)
    assert error.message.startswith(f"{param}: {message}"), error.message


@pytest.mark.parametrize(
    ("code", "details", "chat", "status", "param", "message"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p: must be in (0, 1]", False, 400, "top_p",
         "top_p: must be in (0, 1]"),
        (grpc.StatusCode.INVALID_ARGUMENT, "input: 9000 tokens leave no room", True, 400, "messages",
         "messages: 9000 tokens leave no room"),
        (grpc.StatusCode.INVALID_ARGUMENT, "input.chat.messages[1].role: must be one of", True, 400,
         "messages[1].role", "messages[1].role: must be one of"),
        (grpc.StatusCode.INVALID_ARGUMENT, "sampling.logprobs: must be in [0, 20]", True, 400, "top_logprobs",
         "top_logprobs: must be in [0, 20]"),
        (grpc.StatusCode.INVALID_ARGUMENT, "sampling.prompt_logprobs: must be an integer in [0, 20], got 21",
         False, 400, "prompt_logprobs", "prompt_logprobs: must be an integer in [0, 20], got 21"),
        (grpc.StatusCode.NOT_FOUND, "model: unknown model 'x'", False, 404, "model", "model: unknown model 'x'"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "router is full", False, 429, None, "router is full"),
        (grpc.StatusCode.UNAVAILABLE, "no worker can take the request now", False, 503, None,
         "no worker can take the request now"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed", False, 504, None,
         "the request's deadline passed"),
        (grpc.StatusCode.INTERNAL, "router error: KeyError", False, 500, None, "router error: KeyError"),
    ],
)  # fmt: skip
def test_router_errors_map_to_openai_statuses(code, details, chat, status, param, message) -> None:
    error = from_router_error(RouterError(code, details), chat)
    assert (error.status, error.param, error.message) == (status, param, message)
    body = error.body()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    retry = error.headers().get("Retry-After")
    assert retry == ("1" if status in (429, 503) else None)


def test_logit_bias_reaches_the_internal_request_by_token_id() -> None:
    request = parse_completion({"prompt": "a", "logit_bias": {"5": -100, "17": 2.5}})
    assert dict(request.message.sampling.logit_bias) == {5: -100.0, 17: 2.5}
    assert not parse_completion({"prompt": "a", "logit_bias": {}}).message.sampling.logit_bias


def test_a_bias_out_of_range_is_the_pipelines_400_naming_logit_bias() -> None:
    details = "sampling.logit_bias: token 5: the bias must be a number in [-100, 100], got 200.0"
    error = from_router_error(RouterError(grpc.StatusCode.INVALID_ARGUMENT, details), False)
    assert (error.status, error.param) == (400, "logit_bias")
    assert error.message == details.removeprefix("sampling.")


def test_penalties_reach_the_internal_request_and_their_range_is_the_pipelines_400() -> None:
    request = parse_chat(
        {
            "messages": [{"role": "user", "content": "a"}],
            "presence_penalty": 0.5,
            "frequency_penalty": -1,
            "repetition_penalty": 1.2,
        }
    )
    assert request.message.sampling.repetition_penalty == 1.2
    assert not parse_completion({"prompt": "a"}).message.sampling.HasField("repetition_penalty")
    assert (request.message.sampling.presence_penalty, request.message.sampling.frequency_penalty) == (
        0.5,
        -1.0,
    )
    details = "sampling.frequency_penalty: must be a number in [-2, 2], got 3.0"
    error = from_router_error(RouterError(grpc.StatusCode.INVALID_ARGUMENT, details), True)
    assert (error.status, error.param) == (400, "frequency_penalty")


def test_the_max_tokens_field_the_client_used_is_the_one_named() -> None:
    details = "sampling.max_tokens: 9000 plus the prompt's 3 tokens exceed"
    assert openai_param(details, True, "max_completion_tokens")[1] == "max_completion_tokens"
    assert openai_param("a message naming no field", False) == ("a message naming no field", None)
