"""The disaggregated service end to end: real Ray, real gRPC on 127.0.0.1, the tcp KV transport, the embedded model.

The shared standard cluster (2 prefill + 2 decode workers, tests/e2e/conftest.py) serves every test in this
module; the offline engine in this process is the reference it must match token for token.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from model_runtime.llm import LLM
from model_runtime.request import ChatMessage, PromptInput, SamplingParams
from tandem_client import AsyncClient, Client
from tandem_client.errors import Cancelled, DeadlineExceeded, InvalidArgument
from tests.e2e.cluster import ServeProcess
from tests.e2e.faults_support import assert_prompt_scores, offline_engine
from tests.polling import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

WORDS = [
    "river",
    "light",
    "seven",
    "quiet",
    "engine",
    "paper",
    "orbit",
    "maple",
    "signal",
    "harbor",
    "copper",
    "violet",
    "thunder",
    "garden",
    "silver",
    "lantern",
    "meadow",
    "falcon",
    "pebble",
    "canyon",
]


def prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 60))) for _ in range(n)]


@pytest.fixture(scope="module")
def cluster(standard_cluster: ServeProcess) -> ServeProcess:
    """These tests only send it requests; the conftest checks its clean stop (exit 0)."""
    return standard_cluster


@pytest.fixture(scope="module")
def offline() -> Iterator[LLM]:
    with offline_engine(512) as llm:
        yield llm


async def _generate_all(address: str, texts: list[str], **sampling) -> list:
    async with AsyncClient(address) as client:
        return await asyncio.gather(*(client.generate(t, **sampling) for t in texts))


def assert_all_idle(address: str, timeout_s: float = 15.0) -> None:
    """Every worker reports zero used KV blocks and zero leases (the router polls them)."""
    deadline = time.monotonic() + timeout_s
    with Client(address) as client:
        while True:
            workers = client.status().workers
            busy = [
                (w.worker_id, w.kv_blocks_used, w.active_leases)
                for w in workers
                if w.kv_blocks_used or w.active_leases
            ]
            if not busy and workers:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"workers still hold KV after {timeout_s}s: {busy}")
            time.sleep(0.3)


def test_health_was_not_serving_until_workers_were_ready(cluster):
    assert health_pb2.HealthCheckResponse.NOT_SERVING in cluster.health_seen
    with grpc.insecure_channel(cluster.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_greedy_outputs_equal_the_offline_engine(cluster, offline):
    texts = prompts(16, seed=1)
    served = asyncio.run(_generate_all(cluster.address, texts, temperature=0, max_tokens=12))
    expected = offline.generate(
        [PromptInput(text=t) for t in texts], SamplingParams(temperature=0, max_tokens=12)
    )
    for text, got, want in zip(texts, served, expected):
        assert list(got.prompt_token_ids) == want.prompt_token_ids, text
        assert list(got.token_ids) == want.token_ids, (
            f"{text!r}: service {got.token_ids} offline {want.token_ids}"
        )
        assert got.text == want.text
        assert got.finish_reason == want.finish_reason
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)
        assert got.usage.completion_tokens == len(want.token_ids)


def test_seeded_sampling_equals_the_offline_engine(cluster, offline):
    texts = prompts(6, seed=2)
    params = {"temperature": 0.9, "top_p": 0.95, "top_k": 50, "max_tokens": 10}
    served = asyncio.run(_generate_all_seeded(cluster.address, texts, params))
    expected = offline.generate(
        [PromptInput(text=t) for t in texts],
        [SamplingParams(seed=100 + i, **params) for i in range(len(texts))],
    )
    assert [list(s.token_ids) for s in served] == [e.token_ids for e in expected]


def test_penalties_equal_the_offline_engine(cluster, offline):
    """Presence, frequency and repetition penalties over a prefill worker's first token (the repetition penalty
    acts on it through the prompt's tokens) and a decode worker's rest (it runs
    ahead: its counts include the token still pending on its device) give the offline engine's tokens; and they
    act: some outputs differ from the unpenalized ones."""
    texts = prompts(6, seed=3)
    params = {
        "temperature": 0,
        "max_tokens": 16,
        "presence_penalty": 0.6,
        "frequency_penalty": 1.2,
        "repetition_penalty": 1.1,
    }
    served = asyncio.run(_generate_all(cluster.address, texts, **params))
    expected = offline.generate([PromptInput(text=t) for t in texts], SamplingParams(**params))
    assert [list(s.token_ids) for s in served] == [e.token_ids for e in expected]
    plain = offline.generate(
        [PromptInput(text=t) for t in texts], SamplingParams(temperature=0, max_tokens=16)
    )
    assert any(p.token_ids != e.token_ids for p, e in zip(plain, expected))


async def _generate_all_seeded(address: str, texts: list[str], params: dict) -> list:
    async with AsyncClient(address) as client:
        return await asyncio.gather(
            *(client.generate(t, seed=100 + i, **params) for i, t in enumerate(texts))
        )


def test_streamed_deltas_join_to_the_final_text(cluster):
    with Client(cluster.address) as client:
        stream = client.stream("Once upon a time, by the sea,", temperature=0, max_tokens=24, ignore_eos=True)
        deltas = list(stream)
        result = stream.result
    pieces = [d.text for d in deltas if hasattr(d, "text") and d is not result]
    assert result is not None and result.text
    assert "".join(pieces) == result.text
    assert sum(len(d.token_ids) for d in deltas if d is not result) == len(result.token_ids)
    assert result.timings.time_to_first_token_seconds > 0


def settled_requests_totals(client: Client) -> dict[str, int]:
    """requests_total per worker once two reads 1 s apart (two polls of each worker) agree: an earlier test's
    requests are all counted."""
    last: dict[str, int] = {}

    def read() -> dict[str, int] | None:
        nonlocal last
        now = {w.worker_id: w.requests_total for w in client.status().workers}
        same, last = now == last, now
        if not same:
            time.sleep(1.0)
        return now if same else None

    return wait_until(read, 15, "the workers' request counts to settle")


def test_every_worker_serves_traffic(cluster):
    """Each worker takes a share of 12 requests (counted from before them: earlier tests' requests count too)."""
    with Client(cluster.address) as client:
        before = settled_requests_totals(client)
        asyncio.run(_generate_all(cluster.address, prompts(12, seed=3), temperature=0, max_tokens=2))

        def idle() -> list[str]:
            return [w.worker_id for w in client.status().workers if w.requests_total == before[w.worker_id]]

        # The router's view of a worker is as fresh as its last poll (0.5 s apart).
        wait_until(lambda: not idle(), 5, "every worker to count a share", lambda: f"served none: {idle()}")
        # Each one's engine ran steps for them: busy time (the autoscaler's prefill load signal) was counted.
        assert all(w.busy_seconds_total > 0 for w in client.status().workers)
    assert len(before) == 4


def test_cancel_mid_stream_releases_everything(cluster):
    with Client(cluster.address) as client:
        stream = client.stream(
            "Count from one to one thousand:", temperature=0, max_tokens=400, ignore_eos=True
        )
        seen = 0
        for _ in stream:
            seen += 1
            if seen == 3:
                break
        stream.close()
    assert seen == 3
    assert_all_idle(cluster.address)


def test_client_deadline_is_deadline_exceeded_and_releases_everything(cluster):
    with Client(cluster.address) as client, pytest.raises(DeadlineExceeded):
        client.generate(
            "Tell me a very long story.", temperature=0, max_tokens=2000, ignore_eos=True, timeout=1.5
        )
    assert_all_idle(cluster.address)


def test_async_cancel_is_cancelled(cluster):
    async def run() -> None:
        async with AsyncClient(cluster.address) as client:
            task = asyncio.ensure_future(client.generate("Say many things.", max_tokens=500, ignore_eos=True))
            await asyncio.sleep(1.0)
            task.cancel()
            with pytest.raises((asyncio.CancelledError, Cancelled)):
                await task

    asyncio.run(run())
    assert_all_idle(cluster.address)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -1.0}, "sampling.temperature"),
        ({"top_p": 1.5}, "sampling.top_p"),
        ({"token_ids": [1, 10**9]}, "input.token_ids"),
        ({"max_tokens": 0}, "sampling.max_tokens"),
        ({"prompt_logprobs": 21}, "sampling.prompt_logprobs"),
    ],
)
def test_invalid_input_names_the_field_and_service_keeps_serving(cluster, kwargs, field):
    prompt = None if "token_ids" in kwargs else "hello"
    with Client(cluster.address) as client:
        with pytest.raises(InvalidArgument) as info:
            client.generate(prompt, **kwargs)
        assert field in info.value.details
        assert client.generate("hello", temperature=0, max_tokens=2).token_ids


def test_a_generic_client_finds_and_calls_the_api_through_reflection(cluster, offline):
    """No generated stubs: the service, its messages and the call all come from server reflection."""
    from google.protobuf import descriptor_pool, message_factory
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(cluster.address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        assert "tandem.v1.Generation" in list(database.get_services())
        pool = descriptor_pool.DescriptorPool(database)
        method = pool.FindServiceByName("tandem.v1.Generation").FindMethodByName("Generate")
        request_class = message_factory.GetMessageClass(method.input_type)
        response_class = message_factory.GetMessageClass(method.output_type)
        request = request_class(text="The capital of France is")
        request.sampling.temperature = 0
        request.sampling.max_tokens = 8
        call = channel.unary_stream(
            "/tandem.v1.Generation/Generate",
            request_serializer=request_class.SerializeToString,
            response_deserializer=response_class.FromString,
        )
        tokens = [t for r in call(request, timeout=60) if r.HasField("delta") for t in r.delta.token_ids]
    want = offline.generate(
        [PromptInput(text="The capital of France is")], SamplingParams(temperature=0, max_tokens=8)
    )
    assert tokens == want[0].token_ids


# --- what the workers no longer compute (text, stop strings) and what the first token alone decides ----------
def _one_word_reply(offline, reply: str) -> list[int]:
    """A chat whose assistant turn already holds a whole reply: the model's next token is its end of turn."""
    tok = offline.tokenizer
    return tok.encode_chat([ChatMessage("user", "Say one word.")]) + tok.encode(
        reply, add_special_tokens=False
    )


def _assert_same(got, want, what: str) -> None:
    assert list(got.token_ids) == want.token_ids, f"{what}: service {got.token_ids} offline {want.token_ids}"
    assert got.text == want.text, what
    assert got.finish_reason == want.finish_reason, what


def test_stop_strings_end_the_text_as_offline_and_stop_the_workers(cluster, offline):
    """Workers never see stop strings: the router finds them, ends the text there and cancels decode (the
    requests ask for 400 tokens, so a decode worker still generating would hold its blocks past the check)."""
    texts = prompts(4, seed=5)
    probe = offline.generate(
        [PromptInput(text=t) for t in texts], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    )
    stops = [p.text[len(p.text) // 2 : len(p.text) // 2 + 4] for p in probe]  # mid-text, may span tokens
    assert all(stops), probe
    params = [SamplingParams(temperature=0, max_tokens=400, ignore_eos=True, stop=(s,)) for s in stops]
    expected = offline.generate([PromptInput(text=t) for t in texts], params)

    async def run() -> list:
        async with AsyncClient(cluster.address) as client:
            return await asyncio.gather(
                *(
                    client.generate(t, temperature=0, max_tokens=400, ignore_eos=True, stop=[s])
                    for t, s in zip(texts, stops)
                )
            )

    served = asyncio.run(run())
    for text, stop, got, want in zip(texts, stops, served, expected):
        _assert_same(got, want, f"{text!r} stop {stop!r}")
        assert got.finish_reason == "stop" and got.stop_reason == stop
        assert stop not in got.text and len(got.token_ids) < 16
    assert_all_idle(cluster.address)


def test_max_tokens_one_is_the_first_token_alone_as_offline(cluster, offline):
    texts = prompts(4, seed=6)
    served = asyncio.run(_generate_all(cluster.address, texts, temperature=0, max_tokens=1, ignore_eos=True))
    expected = offline.generate(
        [PromptInput(text=t) for t in texts], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    )
    for text, got, want in zip(texts, served, expected):
        _assert_same(got, want, text)
        assert got.finish_reason == "length" and got.stop_reason is None and len(got.token_ids) == 1
    assert_all_idle(cluster.address)


def test_prompt_logprobs_are_the_offline_engines_and_max_tokens_zero_only_scores(cluster, offline):
    """A prefill worker scores the prompt, its FirstToken brings the scores: the first delta carries the
    offline engine's prompt logprobs (each prompt token's own under the model, top 2 alternatives), the tokens
    are unchanged; max_tokens 0 gives the same scores and no token; nothing is left held."""
    texts = prompts(4, seed=9)
    served = asyncio.run(
        _generate_all(cluster.address, texts, temperature=0, max_tokens=4, prompt_logprobs=2)
    )
    scored_only = asyncio.run(_generate_all(cluster.address, texts, max_tokens=0, prompt_logprobs=2))
    expected = offline.generate(
        [PromptInput(text=t) for t in texts], SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2)
    )
    for text, got, only, want in zip(texts, served, scored_only, expected):
        _assert_same(got, want, text)
        assert [e.token_id for e in got.prompt_logprobs] == want.prompt_token_ids[1:], text
        assert_prompt_scores(got.prompt_logprobs, want.prompt_logprobs, text)
        assert only.token_ids == () and only.text == "" and only.finish_reason == "length", text
        assert (only.usage.completion_tokens, only.usage.prompt_tokens) == (0, len(want.prompt_token_ids))
        assert_prompt_scores(only.prompt_logprobs, want.prompt_logprobs, f"{text} (max_tokens 0)")
    assert_all_idle(cluster.address)


def test_eos_or_a_stop_id_as_the_first_token_ends_the_request_as_offline(cluster, offline):
    eos_prompt = _one_word_reply(offline, "Yes.")
    (want_eos,) = offline.generate([PromptInput(token_ids=tuple(eos_prompt))], SamplingParams(temperature=0))
    assert want_eos.token_ids[0] in offline.engine.eos_token_ids, "the model no longer ends its turn here"
    text = "The capital of France is"
    (first,) = offline.generate([PromptInput(text=text)], SamplingParams(temperature=0, max_tokens=1))
    stop_id = first.token_ids[0]
    (want_stop,) = offline.generate(
        [PromptInput(text=text)], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=(stop_id,))
    )
    with Client(cluster.address) as client:
        got_eos = client.generate(token_ids=eos_prompt, temperature=0)
        got_stop = client.generate(text, temperature=0, max_tokens=8, stop_token_ids=[stop_id])
    _assert_same(got_eos, want_eos, "EOS first")
    assert got_eos.finish_reason == "stop" and got_eos.stop_reason == want_eos.token_ids[0]
    _assert_same(got_stop, want_stop, "stop id first")
    assert list(got_stop.token_ids) == [stop_id] and got_stop.stop_reason == stop_id
    assert_all_idle(cluster.address)
