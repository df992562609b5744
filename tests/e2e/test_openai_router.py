"""The OpenAI HTTP API of the real RouterServer, with fake workers (tests/e2e/fake_workers.py): the statuses a
client only meets under load or failure (429 + Retry-After, 503, 504, an error after the stream began), and a
disconnect cancelling the worker calls at once. The official `openai` package is the client. Against real
workers (output equal to gRPC's, blocks and leases released, bad input): test_openai_api.py."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from router.model import ServedModel
from tests.e2e.fake_workers import FakeDecode, FakePrefill, LoopThread, RouterHarness, Script
from tests.polling import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]
MODEL = "smollm2-135m-instruct"


@pytest.fixture
def make(router_loop: LoopThread, served_model: ServedModel) -> Iterator:
    harnesses: list[RouterHarness] = []

    def build(step_s: float = 0.0, **config: object) -> RouterHarness:
        tokens = served_model.tokenizer.encode(" one two three four five six seven eight", False)
        harness = RouterHarness(
            router_loop, served_model, Script(tokens * 5, batch=1, step_s=step_s), http_port=0, **config
        )
        harnesses.append(harness)
        return harness

    yield build
    for harness in harnesses:
        harness.close()


def client(harness: RouterHarness, **kwargs: object) -> openai.OpenAI:
    # max_retries 0: the SDK would retry 429/503/504 on its own and hide the status under test.
    return openai.OpenAI(
        base_url=harness.router.http_address + "/v1", api_key="unused", max_retries=0, **kwargs
    )


def http(url: str, body: dict | None = None, headers: dict | None = None) -> tuple[int, Any]:
    """(status, JSON body) of a GET (no body) or POST, whatever the status."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def pair(harness: RouterHarness, decode_mode: str = "ok") -> RouterHarness:
    harness.add(FakePrefill, "p0")
    harness.add(FakeDecode, "d0", mode=decode_mode)
    return harness.start()


def fakes_cancelled(harness: RouterHarness) -> list[str]:
    return [rid for worker in harness.workers for rid in worker.cancelled]


def test_a_full_router_answers_429_with_retry_after_and_serves_again_once_free(make) -> None:
    harness = pair(make(step_s=0.05, max_inflight=1, max_queue=0))
    api = client(harness)
    with api.completions.create(model=MODEL, prompt="hi", max_tokens=30, stream=True) as first:
        next(iter(first))  # running: it holds the only slot
        with pytest.raises(openai.RateLimitError) as info:
            api.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert info.value.status_code == 429 and info.value.response.headers["Retry-After"] == "1"
        error = info.value.body
        assert error["type"] == "rate_limit_error" and error["code"] == "overloaded", error
        assert "router is full: 1 requests running, 0 waiting" in error["message"]
    wait_until(lambda: harness.router.metrics.protocols["http"] == 1, what="the first request to end")
    assert api.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].finish_reason == "length"
    assert harness.router.metrics.rejections["resource_exhausted"] == 1


def test_no_worker_is_503_and_health_says_so(make) -> None:
    harness = make().start(wait_ready=False)
    base = harness.router.http_address
    assert http(base + "/health") == (503, {"status": "not serving"})
    with pytest.raises(openai.InternalServerError) as info:
        client(harness).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 503 and info.value.response.headers["Retry-After"] == "1"
    assert info.value.body["type"] == "service_unavailable_error"
    assert "no worker can take the request now" in info.value.body["message"]


def test_the_deadline_header_gives_504_streaming_or_not(make) -> None:
    harness = pair(make(), decode_mode="hang")  # the decode worker never reserves
    api = client(harness, default_headers={"X-Request-Timeout": "0.3"})
    for stream in (False, True):
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as info:
            api.completions.create(model=MODEL, prompt="hi", max_tokens=4, stream=stream)
        assert info.value.status_code == 504, info.value
        assert info.value.body["message"] == "the request's deadline passed before the first token"
        assert time.monotonic() - started < 5
    status, body = http(
        harness.router.http_address + "/v1/completions",
        {"model": MODEL, "prompt": "hi"},
        {"X-Request-Timeout": "soon"},
    )
    assert status == 400 and "X-Request-Timeout" in body["error"]["message"]


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_cancels_the_worker_calls_at_once(make, stream: bool) -> None:
    harness = pair(make(step_s=0.2))  # 40 tokens at 0.2 s each: 8 s if nothing cancels them

    async def leave_early() -> None:
        api = openai.AsyncOpenAI(
            base_url=harness.router.http_address + "/v1", api_key="unused", max_retries=0, timeout=0.5
        )
        if stream:
            events = await api.completions.create(model=MODEL, prompt="hi", max_tokens=40, stream=True)
            await events.__anext__()
            await events.close()
        else:
            with pytest.raises(openai.APITimeoutError):
                await api.completions.create(model=MODEL, prompt="hi", max_tokens=40)
        await api.close()

    asyncio.run(leave_early())
    left = time.monotonic()
    wait_until(lambda: fakes_cancelled(harness), 2.0, "the workers to see the cancel")
    assert time.monotonic() - left < 1.0
    wait_until(lambda: harness.router.metrics.outcomes["cancelled"] == 1, what="the outcome")
    assert harness.router.metrics.protocols == {"http": 1}
    assert all(worker.active == 0 for worker in harness.workers)


def test_a_failure_after_the_stream_began_is_its_last_event(make) -> None:
    # step_s: the decode stream must not overtake the prefill's first token; with step 0 on a busy box it
    # failed before the router had sent anything, and the failure came back as a status, not as an event.
    harness = pair(make(step_s=0.05, worker_retries=0), decode_mode="fail_after")
    api = client(harness)
    seen = []
    with pytest.raises(openai.APIError, match="decode worker lost its GPU"):
        for chunk in api.completions.create(model=MODEL, prompt="hi", max_tokens=20, stream=True):
            seen.append(chunk.choices[0].text)
    assert seen, "the stream began before the worker failed"


def test_n_choices_are_admitted_all_or_none_and_a_disconnect_cancels_every_one(make) -> None:
    """n choices are n requests: over the router's room they are refused together (429) and the ones admitted
    before the refusal give their places back; within it they run at once; a client that leaves a stream of
    two choices cancels both choices' worker calls."""
    harness = pair(make(step_s=0.2, max_inflight=2, max_queue=0))
    api = client(harness)
    with pytest.raises(openai.RateLimitError):
        api.completions.create(model=MODEL, prompt="hi", max_tokens=2, n=3)
    two = api.completions.create(model=MODEL, prompt="hi", max_tokens=2, n=2)  # both places are free again
    assert [c.index for c in two.choices] == [0, 1] and two.usage.completion_tokens == 4

    async def leave_early() -> None:
        async with openai.AsyncOpenAI(
            base_url=harness.router.http_address + "/v1", api_key="unused", max_retries=0
        ) as api:
            events = await api.completions.create(model=MODEL, prompt="hi", max_tokens=40, n=2, stream=True)
            await events.__anext__()
            await events.close()

    asyncio.run(leave_early())

    def cancelled_choices() -> set[str]:  # a worker call's id: <request id>-<choice>#<attempt>
        return {rid.split("#")[0].rsplit("-", 1)[-1] for rid in fakes_cancelled(harness)}

    wait_until(lambda: cancelled_choices() >= {"0", "1"}, 3.0, "both choices' worker calls to be cancelled")
    assert cancelled_choices() == {"0", "1"}
    wait_until(lambda: all(worker.active == 0 for worker in harness.workers), 3.0, "every worker call to end")
