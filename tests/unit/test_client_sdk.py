"""The SDK (Client, AsyncClient) and `tandem generate/status` in server mode against a real gRPC server.

The server here is a stand-in for the router with trivial deterministic behaviour: it echoes the prompt's
token ids (text prompts are tokenized as one token per character, ord(c)) two tokens per delta, each token's
text being chr(id). Some prompts trigger special behaviour: "slow" (0.2 s per token), "hang" (one delta, then
wait for the client to go away), "flaky" (UNAVAILABLE twice per request id, then normal), "no-final".
"""

from __future__ import annotations

import asyncio
import collections
import json
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

import tandem_client
from tandem_api.tandem.v1 import admin_pb2, admin_pb2_grpc, generate_pb2, generate_pb2_grpc
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
from tandem_client.cli import main as cli_main

pytestmark = pytest.mark.unit


def _prompt_ids(request: generate_pb2.GenerateRequest) -> list[int]:
    kind = request.WhichOneof("input")
    if kind == "token_ids":
        return list(request.token_ids.ids)
    if kind == "chat":
        return [ord(c) for m in request.chat.messages for c in f"{m.role}:{m.content};"]
    return [ord(c) for c in request.text]


class EchoGeneration(generate_pb2_grpc.GenerationServicer):
    def __init__(self) -> None:
        self.cancel_seen = threading.Event()
        self.attempts: collections.Counter[str] = collections.Counter()
        self.metadata: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0

    def _enter(self) -> None:
        with self.lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def _leave(self) -> None:
        # Called before the Final message goes out: the client cannot start its next request any earlier.
        with self.lock:
            self.in_flight -= 1

    def Generate(self, request, context):
        self.metadata = [(m.key, m.value) for m in context.invocation_metadata()]
        sampling = request.sampling
        if sampling.HasField("temperature") and sampling.temperature < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature: must be >= 0")
        text = request.text if request.WhichOneof("input") == "text" else ""
        if text == "flaky":
            self.attempts[request.request_id] += 1
            if self.attempts[request.request_id] <= 2:
                context.abort(grpc.StatusCode.UNAVAILABLE, "no decode worker yet")
        if text == "hang":
            # The RPC can only end by the client going away; the callback runs when gRPC tears it down (the
            # server may abandon this generator at its yield without resuming it, so no code after it is sure
            # to run).
            context.add_callback(self.cancel_seen.set)
            yield generate_pb2.GenerateResponse(delta=generate_pb2.Delta(token_ids=[1], text="h"))
            while context.is_active():
                time.sleep(0.01)
            return
        yield from self._echo(request, context, text)

    def _echo(self, request, context, text: str) -> Iterator[generate_pb2.GenerateResponse]:
        self._enter()
        prompt = _prompt_ids(request)
        limit = request.sampling.max_tokens if request.sampling.HasField("max_tokens") else 16
        output = prompt[:limit]
        for start in range(0, len(output), 2):
            if text == "slow":
                time.sleep(0.2)
            chunk = output[start : start + 2]
            logprobs = (
                [self._logprob(t, request.sampling) for t in chunk]
                if request.sampling.HasField("logprobs")
                else []
            )
            delta = generate_pb2.Delta(
                token_ids=chunk, text="".join(chr(t) for t in chunk), logprobs=logprobs
            )
            yield generate_pb2.GenerateResponse(delta=delta)
        self._leave()
        if text == "no-final":
            return
        reason = generate_pb2.FINISH_REASON_LENGTH if len(prompt) > limit else generate_pb2.FINISH_REASON_STOP
        final = generate_pb2.Final(
            request_id=request.request_id or "auto-1",
            finish_reason=reason,
            usage=generate_pb2.Usage(
                prompt_tokens=len(prompt), completion_tokens=len(output), cached_prompt_tokens=1
            ),
            timings=generate_pb2.Timings(
                queue_seconds=0.5, time_to_first_token_seconds=0.25, e2e_seconds=1.0
            ),
            prompt_token_ids=prompt,
        )
        if reason == generate_pb2.FINISH_REASON_STOP:
            final.stop_token_id = 2
        yield generate_pb2.GenerateResponse(final=final)

    @staticmethod
    def _logprob(token: int, sampling: generate_pb2.SamplingParams) -> generate_pb2.TokenLogprob:
        top = [
            generate_pb2.TopLogprob(token_id=token + k, logprob=-0.5 * (k + 1))
            for k in range(sampling.logprobs)
        ]
        return generate_pb2.TokenLogprob(token_id=token, logprob=-0.5, top=top)

    def ListModels(self, request, context):
        return generate_pb2.ListModelsResponse(
            models=[generate_pb2.ModelInfo(id="echo", max_model_len=2048, vocab_size=256)]
        )


class FixedAdmin(admin_pb2_grpc.AdminServicer):
    def Status(self, request, context):
        workers = [
            admin_pb2.WorkerInfo(
                worker_id="prefill-0",
                role=admin_pb2.WORKER_ROLE_PREFILL,
                address="10.0.0.1:7001",
                state=admin_pb2.WORKER_STATE_READY,
                kv_blocks_used=3,
                kv_blocks_total=100,
                running_requests=1,
                active_leases=2,
                last_heartbeat_age_seconds=0.25,
            ),
            admin_pb2.WorkerInfo(
                worker_id="decode-0", role=admin_pb2.WORKER_ROLE_DECODE, state=admin_pb2.WORKER_STATE_DRAINING
            ),
        ]
        return admin_pb2.ClusterStatus(
            workers=workers, router=admin_pb2.RouterInfo(queued_requests=4, in_flight_requests=5)
        )


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


def _free_port_address() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


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
    with Client(_free_port_address(), timeout=5, retries=0) as c, pytest.raises(Unavailable) as info:
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
    assert cli_main(["status", "--server", _free_port_address(), "--timeout", "2"]) == 1
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
        "3/100",
        "1",
        "0",
        "2",
        "0.2s",
    ]
    assert table[-1] == "router: 4 queued, 5 in flight"
    assert cli_main(["status", "--server", server[0], "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["workers"][1]["state"] == "draining" and status["router"]["queued_requests"] == 4


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
