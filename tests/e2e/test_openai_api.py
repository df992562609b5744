"""The OpenAI-compatible HTTP API of a real `tandem serve` (the shared standard cluster: Ray, 1 prefill + 1
decode worker, the embedded SmolLM2), with the official `openai` package as the client, sync and async,
streaming and not: greedy output equal token for token to the gRPC API's, a cancel mid-stream releasing every
block and lease, bad input answered with the right status while the service keeps serving, and curl reading
the SSE framing as OpenAI clients parse it. Statuses under load or failure (429, 503, 504): test_openai_router.py.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import urllib.error
import urllib.request
from typing import Any

import openai
import pytest
import yaml

from tandem_client import AsyncClient, Client
from tests.e2e.cluster import ServeProcess
from tests.polling import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
MODEL = "smollm2-135m-instruct"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot"]
CHAT = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Name a color."}]
TOKEN_IDS = {"return_token_ids": True}  # vLLM's extension: each choice carries its token ids


@pytest.fixture(scope="module")
def cluster(standard_cluster: ServeProcess) -> ServeProcess:
    """The shared standard cluster (tests/e2e/conftest.py), which serves the HTTP API too."""
    assert standard_cluster.http_address
    return standard_cluster


@pytest.fixture(scope="module")
def api(cluster: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.http_address + "/v1", api_key="unused", max_retries=0, timeout=60)


def http(url: str, data: bytes | None = None) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def idle(address: str) -> bool:
    with Client(address) as client:
        workers = client.status().workers
    return all(w.kv_blocks_used == 0 and w.active_leases == 0 and w.running_requests == 0 for w in workers)


def test_models_and_health(cluster: ServeProcess, api: openai.OpenAI) -> None:
    (model,) = api.models.list().data
    assert (model.id, model.owned_by) == (MODEL, "tandem")
    assert model.model_extra == {"max_model_len": 8192, "vocab_size": 49152}
    assert api.models.retrieve(MODEL).id == MODEL
    assert http(cluster.http_address + "/health") == (200, {"status": "serving"})


def test_completions_equal_the_grpc_api_token_for_token(cluster: ServeProcess, api: openai.OpenAI) -> None:
    with Client(cluster.address) as client:
        expected = [client.generate(p, temperature=0, max_tokens=24, logprobs=2) for p in PROMPTS]
    for prompt, want in zip(PROMPTS, expected, strict=True):
        whole = api.completions.create(
            model=MODEL, prompt=prompt, temperature=0, max_tokens=24, logprobs=2, extra_body=TOKEN_IDS
        )
        (choice,) = whole.choices
        assert choice.model_extra["token_ids"] == list(want.token_ids), prompt
        assert (choice.text, choice.finish_reason) == (want.text, want.finish_reason.value)
        assert whole.model_extra["prompt_token_ids"] == list(want.prompt_token_ids)
        assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (
            want.usage.prompt_tokens,
            want.usage.completion_tokens,
        )
        assert choice.logprobs.token_logprobs == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-4)
        assert [len(top) for top in choice.logprobs.top_logprobs] == [2] * len(want.token_ids)

        chunks = list(
            api.completions.create(
                model=MODEL,
                prompt=prompt,
                temperature=0,
                max_tokens=24,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=TOKEN_IDS,
            )
        )
        *deltas, last, usage = chunks
        assert [t for c in deltas for t in c.choices[0].model_extra["token_ids"]] == list(want.token_ids)
        assert "".join(c.choices[0].text for c in deltas) == want.text
        assert last.choices[0].finish_reason == want.finish_reason.value and not usage.choices
        assert usage.usage.completion_tokens == len(want.token_ids)


def test_logit_bias_reaches_both_workers_through_both_front_doors(
    cluster: ServeProcess, api: openai.OpenAI
) -> None:
    """The prefill worker samples the first token and the decode worker the rest: a bias that bans tokens or
    forces one shows in every position, the same over gRPC and HTTP; an id past the vocabulary is a 400."""
    prompt, forced_id = PROMPTS[0], 1234
    with Client(cluster.address) as client:
        plain = client.generate(prompt, temperature=0, max_tokens=12)
        banned = {plain.token_ids[0]: -100.0, plain.token_ids[2]: -100.0}
        biased = client.generate(prompt, temperature=0, max_tokens=12, logit_bias=banned)
        forced = client.generate(prompt, temperature=0, max_tokens=6, logit_bias={forced_id: 100.0})
    assert biased.token_ids[0] != plain.token_ids[0]
    assert not set(banned) & set(biased.token_ids), (plain.token_ids, biased.token_ids)
    assert forced.token_ids == (forced_id,) * 6
    over_http = api.completions.create(
        model=MODEL,
        prompt=prompt,
        temperature=0,
        max_tokens=12,
        logit_bias={str(k): v for k, v in banned.items()},  # type: ignore[misc]
        extra_body=TOKEN_IDS,
    )
    assert over_http.choices[0].model_extra["token_ids"] == list(biased.token_ids)
    status, body = http(
        cluster.http_address + "/v1/completions",
        json.dumps({"model": MODEL, "prompt": prompt, "logit_bias": {"49152": 1}}).encode(),
    )
    assert (status, body["error"]["param"]) == (400, "logit_bias"), body
    assert "token id 49152 is outside the vocabulary [0, 49152)" in body["error"]["message"]


def test_penalties_over_http_are_the_grpc_apis(cluster: ServeProcess, api: openai.OpenAI) -> None:
    """presence_penalty, frequency_penalty and vLLM's repetition_penalty give the same tokens through both front
    doors; out of range, a 400 naming the field."""
    prompt, penalties = PROMPTS[1], {"presence_penalty": -0.5, "frequency_penalty": 1.5}
    with Client(cluster.address) as client:
        grpc_tokens = client.generate(
            prompt, temperature=0, max_tokens=12, repetition_penalty=1.2, **penalties
        ).token_ids
        chat_tokens = client.generate(
            messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=12, **penalties
        ).token_ids
    completion = api.completions.create(
        model=MODEL,
        prompt=prompt,
        temperature=0,
        max_tokens=12,
        extra_body={**TOKEN_IDS, "repetition_penalty": 1.2},
        **penalties,
    )
    chat = api.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        temperature=0,
        max_tokens=12,
        extra_body=TOKEN_IDS,
        **penalties,
    )
    assert completion.choices[0].model_extra["token_ids"] == list(grpc_tokens)
    assert chat.choices[0].model_extra["token_ids"] == list(chat_tokens)
    for field, value, message in (
        ("frequency_penalty", 2.5, "must be a number in [-2, 2], got 2.5"),
        ("repetition_penalty", 0, "must be a number in (0, 10], got 0.0"),
    ):
        status, body = http(
            cluster.http_address + "/v1/completions",
            json.dumps({"model": MODEL, "prompt": prompt, field: value}).encode(),
        )
        assert (status, body["error"]["param"]) == (400, field), body
        assert message in body["error"]["message"]


def test_echo_scores_the_prompt_as_the_grpc_api(cluster: ServeProcess, api: openai.OpenAI) -> None:
    """completions with echo: the text starts with the prompt; with logprobs the prompt's tokens come first (the
    first with null: nothing predicts it), scored as the gRPC API's prompt_logprobs, then the completion's;
    max_tokens 0 scores the prompt alone (what evaluation harnesses send); streamed, the first chunk carries
    the prompt. Chat has no echo, and max_tokens 0 needs it: both a 400 naming the field."""
    prompt, url = PROMPTS[0], cluster.http_address + "/v1/completions"
    with Client(cluster.address) as client:
        want = client.generate(prompt, temperature=0, max_tokens=4, logprobs=2, prompt_logprobs=2)
    n = len(want.prompt_token_ids)
    body = {"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": 4, "logprobs": 2, "echo": True}
    status, whole = http(url, json.dumps(body).encode())
    assert status == 200, whole
    (choice,) = whole["choices"]
    assert choice["text"] == prompt + want.text
    lp = choice["logprobs"]
    assert (
        len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n + len(want.token_ids)
    )
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    scored = [e.logprob for e in want.prompt_logprobs] + [e.logprob for e in want.logprobs]
    assert lp["token_logprobs"][1:] == pytest.approx(scored, abs=1e-3)
    assert all(len(top) == 2 for top in lp["top_logprobs"][1:])
    assert "".join(lp["tokens"][:n]).endswith(prompt)
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0

    status, only = http(url, json.dumps({**body, "max_tokens": 0}).encode())
    assert status == 200, only
    assert only["choices"][0]["text"] == prompt and only["choices"][0]["finish_reason"] == "length"
    assert only["choices"][0]["logprobs"]["token_logprobs"][1:] == pytest.approx(scored[: n - 1], abs=1e-3)
    assert (only["usage"]["prompt_tokens"], only["usage"]["completion_tokens"]) == (n, 0)

    chunks = list(
        api.completions.create(
            model=MODEL, prompt=prompt, temperature=0, max_tokens=4, echo=True, stream=True
        )
    )
    assert chunks[0].choices[0].text.startswith(prompt)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == prompt + want.text

    for path, extra, param in (
        ("/v1/chat/completions", {"messages": CHAT, "echo": True}, "echo"),
        ("/v1/completions", {"prompt": prompt, "max_tokens": 0}, "max_tokens"),
    ):
        status, error = http(cluster.http_address + path, json.dumps({"model": MODEL, **extra}).encode())
        assert (status, error["error"]["param"]) == (400, param), error
    wait_until(lambda: idle(cluster.address), 15, "every block and lease released")


def test_prompt_logprobs_in_vllms_layout_are_the_grpc_apis(cluster: ServeProcess) -> None:
    """vLLM's prompt_logprobs on /v1/completions: one entry per prompt token, null first, then the prompt token
    and its top alternatives by token id, with the logprobs the gRPC API's prompt_logprobs give; beside echo's
    logprobs each keeps its own top-n. Streaming with it and a top-n past 20 are a 400 naming the field."""
    prompt, url = PROMPTS[1], cluster.http_address + "/v1/completions"
    with Client(cluster.address) as client:
        want = client.generate(prompt, temperature=0, max_tokens=2, prompt_logprobs=3)
    body = {"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": 2, "prompt_logprobs": 3}
    status, whole = http(url, json.dumps({**body, "echo": True, "logprobs": 1}).encode())
    assert status == 200, whole
    (choice,) = whole["choices"]
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(want.prompt_token_ids) and entries[0] is None
    for entry, expected in zip(entries[1:], want.prompt_logprobs):
        mine = entry[str(expected.token_id)]
        assert mine["logprob"] == pytest.approx(expected.logprob, abs=1e-3)
        top_ids = [t.token_id for t in expected.top]
        assert mine["rank"] == (
            top_ids.index(expected.token_id) + 1 if expected.token_id in top_ids else None
        )
        assert set(entry) == {str(expected.token_id), *(str(t) for t in top_ids)}
        for rank, alt in enumerate(expected.top, start=1):
            assert entry[str(alt.token_id)]["rank"] == rank
            assert entry[str(alt.token_id)]["logprob"] == pytest.approx(alt.logprob, abs=1e-3)
    assert all(len(top) == 1 for top in choice["logprobs"]["top_logprobs"][1:]), "echo's own top-n: 1"
    for extra, param in (({"stream": True}, "prompt_logprobs"), ({"prompt_logprobs": 21}, "prompt_logprobs")):
        status, error = http(url, json.dumps({**body, **extra}).encode())
        assert (status, error["error"]["param"]) == (400, param), error
    wait_until(lambda: idle(cluster.address), 15, "every block and lease released")


def test_n_choices_are_the_requests_each_would_be_alone(cluster: ServeProcess, api: openai.OpenAI) -> None:
    """n > 1: greedy, every choice is the n = 1 completion; with a seed and temperature, choice i is what a
    request with seed + i gets alone (chat, streamed: each choice's chunks carry its index and end with its
    finish_reason, then one usage chunk); the usage counts the prompt once and adds the completions; and
    nothing is left held afterwards."""
    prompt, sampled = PROMPTS[2], {"temperature": 0.9, "top_p": 0.95, "max_tokens": 8}
    one = api.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8)
    three = api.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert [c.text for c in three.choices] == [one.choices[0].text] * 3
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens

    seeded = api.completions.create(model=MODEL, prompt=prompt, seed=7, n=2, **sampled)
    alone = [api.completions.create(model=MODEL, prompt=prompt, seed=7 + i, **sampled) for i in range(2)]
    assert [c.text for c in seeded.choices] == [a.choices[0].text for a in alone]

    texts, finishes, usages = ["", ""], [None, None], []
    stream = api.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        seed=11,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
        **sampled,
    )
    for chunk in stream:
        if chunk.usage is not None:
            usages.append(chunk.usage)
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finishes[c.index] = c.finish_reason or finishes[c.index]
    alone_chat = [
        api.chat.completions.create(model=MODEL, messages=CHAT, seed=11 + i, **sampled) for i in range(2)
    ]
    assert texts == [a.choices[0].message.content for a in alone_chat]
    assert finishes == [a.choices[0].finish_reason for a in alone_chat]
    (usage,) = usages
    assert usage.prompt_tokens == alone_chat[0].usage.prompt_tokens
    assert usage.completion_tokens == sum(a.usage.completion_tokens for a in alone_chat)
    wait_until(lambda: idle(cluster.address), 10.0, "every KV block, lease and sequence to be released")


def test_a_list_of_prompts_is_the_requests_each_prompt_would_be(
    cluster: ServeProcess, api: openai.OpenAI
) -> None:
    """/v1/completions with a list of prompts (as evaluation harnesses send them): choice p is prompt p's own
    completion, token for token, and the usage adds up the prompts and the completions."""
    prompts = PROMPTS[:2]
    batch = api.completions.create(
        model=MODEL, prompt=prompts, temperature=0, max_tokens=8, extra_body=TOKEN_IDS
    )
    alone = [
        api.completions.create(model=MODEL, prompt=p, temperature=0, max_tokens=8, extra_body=TOKEN_IDS)
        for p in prompts
    ]
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]
    assert [c.model_extra["prompt_token_ids"] for c in batch.choices] == [
        a.model_extra["prompt_token_ids"] for a in alone
    ]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)


def test_chat_equals_the_grpc_api_async_streaming_or_not(cluster: ServeProcess) -> None:
    async def both() -> tuple[Any, Any, list[Any]]:
        async with AsyncClient(cluster.address) as client:  # the SDK takes the same plain dicts
            want = await client.generate(messages=CHAT, temperature=0, max_tokens=32)
        api = openai.AsyncOpenAI(base_url=cluster.http_address + "/v1", api_key="unused", max_retries=0)
        kwargs: dict[str, Any] = {
            "model": MODEL,
            "messages": CHAT,
            "temperature": 0,
            "max_completion_tokens": 32,
            "extra_body": TOKEN_IDS,
        }
        whole = await api.chat.completions.create(**kwargs)
        chunks = [c async for c in await api.chat.completions.create(stream=True, **kwargs)]
        await api.close()
        return want, whole, chunks

    want, whole, chunks = asyncio.run(both())
    (choice,) = whole.choices
    assert choice.model_extra["token_ids"] == list(want.token_ids)
    assert (choice.message.role, choice.message.content) == ("assistant", want.text)
    assert choice.finish_reason == want.finish_reason.value
    assert whole.usage.prompt_tokens == want.usage.prompt_tokens
    *deltas, last = chunks
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content for c in deltas) == want.text
    assert [t for c in deltas for t in c.choices[0].model_extra["token_ids"]] == list(want.token_ids)
    assert last.choices[0].finish_reason == want.finish_reason.value


def test_a_cancel_mid_stream_releases_every_block_and_lease(
    cluster: ServeProcess, api: openai.OpenAI
) -> None:
    stream = api.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_completion_tokens=2000,
        stream=True,
        extra_body={"ignore_eos": True},  # 2000 tokens: tens of seconds on CPU unless the cancel reaches it
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    # The router's view of the workers is as fresh as its last poll (every 0.5 s): wait for the request to show.
    wait_until(lambda: not idle(cluster.address), 10.0, "the decoding request to hold KV blocks")
    stream.close()
    wait_until(lambda: idle(cluster.address), 5.0, "every KV block, lease and sequence to be released")


BAD = [  # (request body, status, start of the message)
    ({"prompt": "hi", "temperature": "hot"}, 400, "temperature: must be a number, got a string"),
    ({"prompt": "hi", "max_tokens": -5}, 400, "max_tokens: must be an integer >= 1, got -5"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p: must be in (0, 1]"),
    (
        {"prompt": [1] * 9000},
        400,
        "prompt: 9000 tokens leave no room for output in the model's context of 8192",
    ),
    ({"prompt": "hi", "max_tokens": 9000}, 400, "max_tokens: 9000 plus the prompt's"),
    (
        {"prompt": "hi", "model": "gpt-9"},
        404,
        "model: unknown model 'gpt-9'; serving 'smollm2-135m-instruct'",
    ),
    ({"prompt": "hi", "n": 100}, 400, "n: must be an integer in [1, 64], got 100"),
    ({"prompt": 42}, 400, "prompt: must be a string or a list of token ids, got an integer"),
    ({"prompt": "x" * 10_000_000}, 413, "the request body is too large"),
]


def test_bad_input_gets_its_status_and_a_clear_message_and_the_service_keeps_serving(
    cluster: ServeProcess, api: openai.OpenAI
) -> None:
    for body, status, message in BAD:
        with pytest.raises(openai.APIStatusError) as info:
            api.completions.create(**{"model": MODEL, **body})
        error = info.value.body
        assert info.value.status_code == status, (body, error)
        assert error["message"].startswith(message), error
        assert set(error) == {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.role: must be one of system, user"):
        api.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "hi"}])
    status, body = http(cluster.http_address + "/v1/completions", b'{"prompt": "hi", ')
    assert status == 400 and body["error"]["message"].startswith("the body is not valid JSON"), body
    status, body = http(cluster.http_address + "/v1/chat/completions", b"[1, 2]")
    assert status == 400 and "must be a JSON object" in body["error"]["message"], body
    ok = api.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    assert ok.choices[0].finish_reason == "length" and ok.usage.completion_tokens == 3


def test_metrics_count_http_requests_under_their_protocol(cluster: ServeProcess) -> None:
    port = yaml.safe_load(cluster.config_path.read_text())["router"]["metrics_port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    ok = [
        line
        for line in text.splitlines()
        if line.startswith("tandem_requests_total{") and 'status="ok"' in line
    ]
    by_protocol = {
        p: float(line.split()[-1]) for line in ok for p in ("grpc", "http") if f'protocol="{p}"' in line
    }
    assert by_protocol["http"] >= 1 and by_protocol["grpc"] >= 1, ok


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is missing (make install installs it)")
def test_curl_reads_the_sse_framing_as_openai_clients_parse_it(cluster: ServeProcess) -> None:
    # ignore_eos: the default temperature samples, and a short answer may end before 8 tokens
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 8, "stream": True, "ignore_eos": True}
    body["stream_options"] = {"include_usage": True}
    out = subprocess.run(
        ["curl", "-sS", "-N", "-i", "--max-time", "60", f"{cluster.http_address}/v1/chat/completions",
         "-H", "Content-Type: application/json", "-d", json.dumps(body)],
        capture_output=True, check=True, timeout=90,
    ).stdout.decode()  # fmt: skip
    head, _, stream = out.partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 200") and "Content-Type: text/event-stream" in head, head
    assert stream.endswith("\n\n") and "\r" not in stream
    events = stream.removesuffix("\n\n").split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
