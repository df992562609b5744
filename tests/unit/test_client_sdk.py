"""The SDK (Client, AsyncClient) and `tandem generate/status` in server mode against a real gRPC server
serving the stand-in router of tests/unit/sdk_server.py (see there for its deterministic behaviour).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

import tandem_client
from tandem_api.tandem.v1 import admin_pb2_grpc, generate_pb2_grpc
from tandem_cli.cli import main as cli_main
from tandem_client import (
    AsyncClient,
    ChatMessage,
    Client,
    DeadlineExceeded,
    FinishReason,
    GenerationDelta,
    GenerationResult,
    Internal,
    InvalidArgument,
    Prompt,
    ResourceExhausted,
    Sampling,
    Unavailable,
    WorkerRole,
    WorkerState,
    wire,
)
from tandem_client.wire import build_request
from tests.loopback import free_port
from tests.unit.sdk_server import EchoGeneration, FixedAdmin

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, EchoGeneration]]:
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    servicer = EchoGeneration()
    generate_pb2_grpc.add_GenerationServicer_to_server(servicer, grpc_server)
    admin_pb2_grpc.add_AdminServicer_to_server(FixedAdmin(), grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    yield f"127.0.0.1:{port}", servicer
    grpc_server.stop(grace=None)


@pytest.fixture()
def client(server) -> Iterator[Client]:
    with Client(server[0], timeout=10) as c:
        yield c


# --- Client ---------------------------------------------------------------------------------------------------


def test_generate_returns_the_whole_typed_result(client: Client) -> None:
    result = client.generate("Hello", request_id="r-1", max_tokens=16)
    assert isinstance(result, GenerationResult)
    assert result.text == "Hello"
    assert result.token_ids == tuple(ord(c) for c in "Hello")
    assert result.prompt_token_ids == result.token_ids
    assert result.finish_reason is FinishReason.STOP and result.stop_reason == 2
    assert result.request_id == "r-1"
    assert (
        result.usage.prompt_tokens,
        result.usage.completion_tokens,
        result.usage.cached_prompt_tokens,
    ) == (5, 5, 1)
    assert result.timings.time_to_first_token_seconds == 0.25 and result.timings.e2e_seconds == 1.0
    assert result.logprobs == ()


def test_stream_deltas_join_to_the_final_result(client: Client) -> None:
    events = list(client.stream("streaming!", max_tokens=7))
    *deltas, final = events
    assert len(deltas) == 4 and all(isinstance(d, GenerationDelta) for d in deltas)
    assert isinstance(final, GenerationResult)
    assert "".join(d.text for d in deltas) == final.text == "streami"
    assert tuple(t for d in deltas for t in d.token_ids) == final.token_ids
    assert final.finish_reason is FinishReason.LENGTH and final.stop_reason is None


def test_token_ids_and_chat_inputs(client: Client) -> None:
    assert client.generate(token_ids=[72, 105]).text == "Hi"
    chat = client.generate(messages=[ChatMessage("user", "yo")], max_tokens=100)
    assert chat.text == "user:yo;"


def test_chat_messages_may_be_plain_dicts_as_openai_clients_write_them(client: Client) -> None:
    mixed = [{"role": "system", "content": "be brief", "name": "ignored"}, ChatMessage("user", "yo")]
    assert client.generate(messages=mixed, max_tokens=100).text == "system:be brief;user:yo;"
    with pytest.raises(InvalidArgument, match=r"messages\[1\]\.content: must be a string, got int"):
        client.generate(messages=[{"role": "user", "content": "a"}, {"role": "user", "content": 3}])
    with pytest.raises(InvalidArgument, match=r"messages\[0\]: must be a ChatMessage or a"):
        client.generate(messages=[("user", "a")])  # type: ignore[list-item]
    with pytest.raises(InvalidArgument, match="messages: must be a list of messages, not one message"):
        client.generate(messages={"role": "user", "content": "a"})  # type: ignore[arg-type]


def test_logprobs_are_typed_per_token(client: Client) -> None:
    result = client.generate(token_ids=[10, 11, 12], logprobs=2)
    assert [lp.token_id for lp in result.logprobs] == [10, 11, 12]
    assert [t.token_id for t in result.logprobs[1].top] == [11, 12]
    assert result.logprobs[0].top[1].logprob == pytest.approx(-1.0)


def test_deadline_becomes_deadline_exceeded(client: Client) -> None:
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded) as info:
        client.generate("slow", timeout=0.3)
    assert time.monotonic() - started < 2.0
    assert info.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert isinstance(info.value, TimeoutError)


def test_server_invalid_argument_carries_code_and_details(client: Client) -> None:
    with pytest.raises(InvalidArgument) as info:
        client.generate("x", temperature=-1.0)
    assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details == "sampling.temperature: must be >= 0"


def test_bad_arguments_fail_before_any_rpc(client: Client) -> None:
    with pytest.raises(InvalidArgument, match="exactly one of text, messages, token_ids"):
        client.generate("a", token_ids=[1])
    with pytest.raises(InvalidArgument, match=r"sampling\.max_tokens"):
        client.generate("a", max_tokens=-3)
    with pytest.raises(InvalidArgument, match="request_id"):
        client.generate("a", request_id="x" * 129)
    with pytest.raises(InvalidArgument, match=r"sampling\.logit_bias"):
        client.generate("a", logit_bias={"5": 1.0})  # type: ignore[dict-item]


def test_logit_bias_goes_as_a_map_whether_given_as_a_mapping_or_as_pairs() -> None:
    assert Sampling(logit_bias={5: -100.0, 2: 1.5}) == Sampling(logit_bias=((5, -100.0), (2, 1.5)))
    request = build_request(Prompt(text="a"), Sampling(logit_bias={5: -100.0, 2: 1.5}))
    assert dict(request.sampling.logit_bias) == {5: -100.0, 2: 1.5}
    assert not build_request(Prompt(text="a"), Sampling()).sampling.logit_bias


def test_closing_the_stream_cancels_the_rpc_on_the_server(server, client: Client) -> None:
    servicer = server[1]
    servicer.cancel_seen.clear()
    events = client.stream("hang")
    first = next(events)
    assert isinstance(first, GenerationDelta) and first.text == "h"
    assert not servicer.cancel_seen.wait(0.1), "the RPC ended before the client closed the stream"
    events.close()
    assert servicer.cancel_seen.wait(5), "the server never saw the cancellation"
    with pytest.raises(StopIteration):
        next(events)


def test_unavailable_is_retried_before_the_first_token(server) -> None:
    with Client(server[0], timeout=10, retries=2) as patient:
        assert patient.generate("flaky", request_id="retry-ok").text == "flaky"
    with (
        Client(server[0], timeout=10, retries=0) as impatient,
        pytest.raises(Unavailable, match="no decode worker"),
    ):
        impatient.generate("flaky", request_id="retry-none")


def test_unreachable_server_is_unavailable() -> None:
    with Client(f"127.0.0.1:{free_port()}", timeout=5, retries=0) as c, pytest.raises(Unavailable) as info:
        c.generate("hi")
    assert isinstance(info.value, ConnectionError)


def test_stream_without_final_is_an_error(client: Client) -> None:
    with pytest.raises(Internal, match="without a final message"):
        client.generate("no-final")


def test_message_size_limit_is_applied(server) -> None:
    with Client(server[0], timeout=10, max_message_bytes=1000) as small, pytest.raises(ResourceExhausted):
        small.generate(token_ids=list(range(1, 2000)), max_tokens=1)


def test_metadata_reaches_the_server(server) -> None:
    with Client(server[0], timeout=10, metadata=[("authorization", "Bearer t0k")]) as c:
        c.generate("m")
    assert ("authorization", "Bearer t0k") in server[1].metadata


def test_api_key_goes_as_a_bearer_token_from_the_argument_or_the_environment(server, monkeypatch) -> None:
    monkeypatch.setenv("TANDEM_API_KEY", "tk-from-env")
    with Client(server[0], timeout=10) as c:
        c.generate("m")
    assert ("authorization", "Bearer tk-from-env") in server[1].metadata
    with Client(server[0], timeout=10, api_key="tk-explicit") as c:  # the argument wins over the variable
        c.generate("m")
    assert ("authorization", "Bearer tk-explicit") in server[1].metadata

    async def scenario() -> None:
        async with AsyncClient(server[0], timeout=10, api_key="tk-async") as c:
            await c.generate("m")

    asyncio.run(scenario())
    assert ("authorization", "Bearer tk-async") in server[1].metadata
    monkeypatch.delenv("TANDEM_API_KEY")
    with Client(server[0], timeout=10) as c:
        c.generate("m")
    assert "authorization" not in dict(server[1].metadata)
    with pytest.raises(ValueError, match="api_key"):
        Client(server[0], api_key="tk with\nnewline")


def test_a_retry_delay_in_trailing_metadata_reaches_the_error() -> None:
    """What the router sends with RESOURCE_EXHAUSTED (retry-after-ms), read from a real RpcError."""

    class Refuse(generate_pb2_grpc.GenerationServicer):
        def Generate(self, request, context):
            context.set_trailing_metadata((("retry-after-ms", "2500"),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "over quota")

    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    generate_pb2_grpc.add_GenerationServicer_to_server(Refuse(), grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    try:
        with (
            Client(f"127.0.0.1:{port}", timeout=10, retries=0) as c,
            pytest.raises(ResourceExhausted) as info,
        ):
            c.generate("m")
        assert info.value.retry_after_s == 2.5 and info.value.details == "over quota"
    finally:
        grpc_server.stop(grace=None)


def test_list_models_and_status_are_typed(client: Client) -> None:
    (model,) = client.list_models()
    assert (model.id, model.max_model_len, model.vocab_size) == ("echo", 2048, 256)
    status = client.status()
    assert [w.role for w in status.workers] == [WorkerRole.PREFILL, WorkerRole.DECODE]
    assert status.workers[1].state is WorkerState.DRAINING
    assert (status.workers[0].kv_blocks_used, status.workers[0].active_leases) == (3, 2)
    assert (status.router.queued_requests, status.router.in_flight_requests) == (4, 5)


# --- AsyncClient ----------------------------------------------------------------------------------------------


def test_async_client_generate_and_stream(server) -> None:
    async def scenario() -> tuple[GenerationResult, list]:
        async with AsyncClient(server[0], timeout=10) as c:
            whole = await c.generate("async", max_tokens=4)
            events = [e async for e in c.stream(token_ids=[1, 2, 3])]
            return whole, events

    whole, events = asyncio.run(scenario())
    assert whole.text == "asyn" and whole.finish_reason is FinishReason.LENGTH
    *deltas, final = events
    assert isinstance(final, GenerationResult) and final.token_ids == (1, 2, 3)
    assert tuple(t for d in deltas for t in d.token_ids) == (1, 2, 3)


def test_async_client_errors(server) -> None:
    async def scenario() -> None:
        async with AsyncClient(server[0]) as c:
            with pytest.raises(DeadlineExceeded):
                await c.generate("slow", timeout=0.3)
            with pytest.raises(InvalidArgument, match=r"sampling\.temperature"):
                await c.generate("x", temperature=-2.0)
            assert (await c.status()).router.in_flight_requests == 5
            assert (await c.list_models())[0].id == "echo"

    asyncio.run(scenario())


def test_async_cancel_reaches_the_server(server) -> None:
    servicer = server[1]

    async def close_stream() -> None:
        async with AsyncClient(server[0], timeout=10) as c:
            events = c.stream("hang")
            assert isinstance(await anext(events), GenerationDelta)
            await events.aclose()

    async def cancel_task() -> None:
        async with AsyncClient(server[0], timeout=10) as c:
            events = c.stream("hang")
            await anext(events)
            task = asyncio.create_task(anext(events))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    for scenario in (close_stream, cancel_task):
        servicer.cancel_seen.clear()
        asyncio.run(scenario())
        assert servicer.cancel_seen.wait(5), f"{scenario.__name__}: the server never saw the cancellation"


# --- tandem CLI in server mode --------------------------------------------------------------------------------


def test_cli_json_lines_in_input_order_with_bounded_concurrency(server, tmp_path, capsys) -> None:
    # Slow requests finish after the fast ones that follow them; output must still follow the input.
    prompts = ["slow", "p1p1", "slow", "p3p3p3p3", "slow", "p5"]
    lines = [{"prompt": p} for p in prompts] + [{"prompt_token_ids": [7, 8]}]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    server[1].in_flight = server[1].max_in_flight = (
        0  # handlers cut off by earlier tests' deadlines never left
    )
    argv = ["generate", "--server", server[0], "--input", str(source), "--json", "--concurrency", "2"]
    assert cli_main([*argv, "--max-tokens", "4"]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [p["text"] for p in printed] == [p[:4] for p in prompts] + ["\x07\x08"]
    assert printed[5] == {
        "prompt_token_ids": [112, 53],
        "token_ids": [112, 53],
        "text": "p5",
        "finish_reason": "stop",
    }
    assert printed[1]["finish_reason"] == "stop" and printed[3]["finish_reason"] == "length"
    assert server[1].max_in_flight == 2


def test_cli_streams_a_single_prompt(server, capsys) -> None:
    assert cli_main(["generate", "--server", server[0], "Hello there"]) == 0
    assert capsys.readouterr().out == "Hello there\n"


def test_cli_output_file_and_server_rejection(server, tmp_path, capsys) -> None:
    out = tmp_path / "out.jsonl"
    assert cli_main(["generate", "--server", server[0], "--output", str(out), "--chat", "hi"]) == 0
    assert json.loads(out.read_text())["text"] == "user:hi;"
    source = tmp_path / "in.jsonl"
    source.write_text('{"prompt": "a"}\n{"prompt": "b", "temperature": -1}\n')
    assert cli_main(["generate", "--server", server[0], "--input", str(source), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "line 2: sampling.temperature: must be >= 0" in err and "Traceback" not in err
    assert json.loads(out.read_text())["text"] == "user:hi;", (
        "a failed run must leave the old output untouched"
    )


def test_cli_runtime_failures_exit_1(server, capsys) -> None:
    assert cli_main(["generate", "--server", server[0], "--timeout", "0.3", "--json", "slow"]) == 1
    assert "DEADLINE_EXCEEDED" in capsys.readouterr().err
    assert cli_main(["status", "--server", f"127.0.0.1:{free_port()}", "--timeout", "2"]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err


def test_cli_status_table_and_json(server, capsys) -> None:
    assert cli_main(["status", "--server", server[0]]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["WORKER", "ROLE", "STATE"]
    assert table[1].split() == [
        "prefill-0",
        "prefill",
        "ready",
        "10.0.0.1:7001",
        "2",
        "3/100",
        "1",
        "0",
        "2",
        "0.2s",
        "07beabfa9d91",
        "tcp,cuda_ipc",
    ]
    assert table[2].split()[-2:] == ["-", "-"]  # an older worker: no node, no transports
    assert table[2].split()[3] == "-"  # nor a device count (its address is empty too)
    assert table[-1] == "router: 4 queued, 5 in flight"
    assert cli_main(["status", "--server", server[0], "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["workers"][1]["state"] == "draining" and status["router"]["queued_requests"] == 4
    assert status["workers"][0]["node_id"] == "07beabfa9d9100c00404260e8adaed1fec46b086cd757ee48ce429b0"
    assert status["workers"][0]["kv_transports"] == ["tcp", "cuda_ipc"]
    assert (status["workers"][0]["devices"], status["workers"][1]["devices"]) == (2, 0)


def test_request_message_keeps_zero_values_and_omits_unset_ones() -> None:
    sampling = Sampling(temperature=0.0, seed=0, stop="\n", ignore_eos=True)  # type: ignore[arg-type]
    request = wire.build_request(Prompt(text="a"), sampling, model="m", request_id="")
    # temperature 0 means greedy: it must travel with presence, not vanish as proto3's default value.
    assert request.sampling.HasField("temperature") and request.sampling.temperature == 0
    assert request.sampling.HasField("seed") and request.sampling.seed == 0
    assert not request.sampling.HasField("top_p") and not request.sampling.HasField("max_tokens")
    assert list(request.sampling.stop) == ["\n"] and request.sampling.ignore_eos
    assert request.model == "m" and request.HasField("request_id")
    assert not wire.build_request(Prompt(token_ids=(1,)), Sampling()).HasField("model")


def test_public_names_are_exported() -> None:
    for name in tandem_client.__all__:
        assert hasattr(tandem_client, name), name
