"""API keys, per-key quotas and priority classes on the real RouterServer (gRPC through the SDK, HTTP through the
official `openai` package) with fake workers (tests/e2e/fake_workers.py): a request without a valid key is
refused and reaches no worker, a key added to the file works without a restart, a key over its rate is refused
with a retry delay while another key is served, and a full admission queue serves interactive before batch."""

from __future__ import annotations

import asyncio
import json
import os
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from router.model import ServedModel
from tandem_api.tandem.v1 import admin_pb2, admin_pb2_grpc
from tandem_cli.bench.transports import OpenAITransport
from tandem_cli.cli import EXIT_RUNTIME, main
from tandem_client import Client, ResourceExhausted, Unauthenticated
from tests.e2e.fake_workers import FakeDecode, FakePrefill, LoopThread, RouterHarness, Script
from tests.polling import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]
MODEL = "smollm2-135m-instruct"
ALPHA = "tk-alpha-0123456789abcdef"
BRAVO = "tk-bravo-0123456789abcdef"
GONE = "tk-gone-0123456789abcdefg"
NIGHTLY = "tk-nightly-0123456789abcdef"


def write_keys(path: Path, keys: list[dict[str, Any]]) -> None:
    rewrite(path, json.dumps({"keys": keys}))


def rewrite(path: Path, text: str) -> None:
    """Write the file and move its mtime a second on (a coarse file-system clock could hide a quick rewrite)."""
    before = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text(text)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, max(st.st_mtime_ns, before + 1_000_000_000)))


BASE_KEYS = [
    {"name": "alpha", "secret": ALPHA},
    {"name": "gone", "secret": GONE, "revoked": True},
]


@pytest.fixture
def make(router_loop: LoopThread, served_model: ServedModel, tmp_path: Path) -> Iterator[Callable[..., Any]]:
    harnesses: list[RouterHarness] = []

    def build(keys: list[dict[str, Any]], step_s: float = 0.0, **config: object) -> RouterHarness:
        path = tmp_path / "keys.json"
        write_keys(path, keys)
        tokens = served_model.tokenizer.encode(" one two three four five six seven eight", False)
        harness = RouterHarness(
            router_loop,
            served_model,
            Script(tokens * 5, batch=1, step_s=step_s),
            http_port=0,
            api_keys_file=str(path),
            api_keys_reload_s=0.05,
            **config,
        )
        harnesses.append(harness)
        harness.add(FakePrefill, "p0")
        harness.add(FakeDecode, "d0")
        return harness.start()

    yield build
    for harness in harnesses:
        harness.close()


def sdk(harness: RouterHarness, api_key: str | None) -> Client:
    return Client(harness.address, timeout=10.0, retries=0, api_key=api_key)


def http_api(harness: RouterHarness, api_key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=harness.router.http_address + "/v1", api_key=api_key, max_retries=0)


def http(url: str, body: dict | None, headers: dict[str, str]) -> tuple[int, Any, Any]:
    """(status, JSON body, response headers) of a GET (no body) or POST, whatever the status."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read()), response.headers
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), exc.headers


async def bench_model(base_url: str) -> str:
    transport = OpenAITransport(base_url)
    try:
        return (await transport.served_model()).id
    finally:
        await transport.close()


def worker_calls(harness: RouterHarness) -> int:
    return sum(len(w.requests) for w in harness.workers)


def test_missing_wrong_and_revoked_keys_are_refused_and_reach_no_worker(
    make: Callable[..., RouterHarness], monkeypatch: pytest.MonkeyPatch
) -> None:
    harness = make(BASE_KEYS)
    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    for key, says in (
        (None, "requires an API key"),
        (BRAVO, "invalid API key"),
        (GONE, "'gone' was revoked"),
    ):
        with sdk(harness, key) as client:
            with pytest.raises(Unauthenticated, match=says):
                client.generate("hi", max_tokens=2)
            with pytest.raises(Unauthenticated):
                client.list_models()
        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        for path, body in (("/v1/completions", {"model": MODEL, "prompt": "hi"}), ("/v1/models", None)):
            status, reply, sent = http(harness.router.http_address + path, body, headers)
            assert status == 401 and sent["WWW-Authenticate"].startswith("Bearer")
            error = reply["error"]
            assert error["code"] == "invalid_api_key" and error["type"] == "authentication_error"
            assert says in error["message"]
    # bytes that are no GenerateRequest (field 1, the model name, holding invalid UTF-8): the key comes first
    with grpc.insecure_channel(harness.address) as channel:
        call = channel.unary_stream("/tandem.v1.Generation/Generate")
        for metadata, code in (
            (None, grpc.StatusCode.UNAUTHENTICATED),
            (ALPHA, grpc.StatusCode.INVALID_ARGUMENT),
        ):
            sent = () if metadata is None else (("authorization", f"Bearer {metadata}"),)
            with pytest.raises(grpc.RpcError) as raw:
                list(call(b"\x0a\x02\xff\xfe", metadata=sent, timeout=5))
            assert raw.value.code() == code
    with pytest.raises(openai.AuthenticationError) as info:  # what the openai package makes of it
        http_api(harness, BRAVO).completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert info.value.status_code == 401
    assert worker_calls(harness) == 0, "a request without a valid key reached a worker"
    assert harness.router.metrics.auth_failures == {"missing": 5, "invalid": 5, "revoked": 4}
    assert harness.router.metrics.rejections["unauthenticated"] == 14
    assert harness.router.metrics.rejections["invalid_argument"] == 1
    # the key in force works on both front doors, and health stays open
    with sdk(harness, ALPHA) as client:
        assert len(client.generate("hi", max_tokens=3, temperature=0).token_ids) == 3
    chat = http_api(harness, ALPHA).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert chat.usage is not None and chat.usage.completion_tokens == 3
    # Both are settled as each request ends, just after its answer reached the client: wait, bounded.
    wait_until(lambda: harness.router.metrics.outcomes["length"] == 2, what="both outcomes recorded")
    wait_until(  # Admin.Status needs no key
        lambda: harness.status().router.in_flight_requests == 0, what="no request in flight"
    )


def test_the_cli_and_sdk_take_the_key_from_the_env_variable_or_the_flag(
    make: Callable[..., RouterHarness], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    harness = make(BASE_KEYS)
    monkeypatch.setenv("TANDEM_API_KEY", ALPHA)
    with Client(harness.address, timeout=10.0, retries=0) as client:
        assert client.list_models()[0].id == MODEL
    generate = ["generate", "--server", harness.address, "--max-tokens", "2", "--json", "hi"]
    assert main(generate) == 0
    assert json.loads(capsys.readouterr().out)["finish_reason"] == "length"
    assert main([*generate, "--api-key", GONE]) == EXIT_RUNTIME  # the flag wins over the variable
    assert "was revoked" in capsys.readouterr().err
    assert asyncio.run(bench_model(harness.router.http_address)) == MODEL  # tandem bench --protocol openai
    monkeypatch.delenv("TANDEM_API_KEY")
    assert main(generate) == EXIT_RUNTIME
    assert "requires an API key" in capsys.readouterr().err
    assert main([*generate, "--api-key", ALPHA]) == 0


def test_a_key_added_to_the_file_works_and_a_revoked_one_stops_without_a_restart(
    make: Callable[..., RouterHarness], tmp_path: Path
) -> None:
    harness = make(BASE_KEYS)
    with sdk(harness, BRAVO) as client, pytest.raises(Unauthenticated):
        client.generate("hi", max_tokens=2)
    write_keys(
        tmp_path / "keys.json",
        [{"name": "alpha", "secret": ALPHA, "revoked": True}, {"name": "bravo", "secret": BRAVO}],
    )

    def bravo_works() -> bool:
        with sdk(harness, BRAVO) as client:
            try:
                return len(client.generate("hi", max_tokens=2).token_ids) == 2
            except Unauthenticated:
                return False

    wait_until(bravo_works, timeout_s=10, what="the reloaded key to be accepted")
    with sdk(harness, ALPHA) as client, pytest.raises(Unauthenticated, match="revoked"):
        client.generate("hi", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        http_api(harness, ALPHA).completions.create(model=MODEL, prompt="hi", max_tokens=2)
    # a broken file keeps the keys in force
    rewrite(tmp_path / "keys.json", "{not json")
    gate = harness.router._gate
    assert gate is not None
    wait_until(lambda: "not valid JSON" in gate._last_error, what="the router to read the broken file")
    assert bravo_works()


def test_a_key_over_its_rate_is_refused_with_a_retry_delay_while_another_key_is_served(
    make: Callable[..., RouterHarness],
) -> None:
    limited = {"name": "alpha", "secret": ALPHA, "limits": {"requests_per_s": 0.2, "requests_burst": 2}}
    harness = make([limited, {"name": "bravo", "secret": BRAVO}])
    with sdk(harness, ALPHA) as alpha, sdk(harness, BRAVO) as bravo:
        for _ in range(2):
            alpha.generate("hi", max_tokens=2)
        with pytest.raises(ResourceExhausted, match="'alpha' is over its quota") as info:
            alpha.generate("hi", max_tokens=2)
        assert info.value.retry_after_s is not None and 4.0 < info.value.retry_after_s <= 5.0
        for _ in range(5):  # bravo has no limits: served all the while
            assert len(bravo.generate("hi", max_tokens=2).token_ids) == 2
    with pytest.raises(openai.RateLimitError) as http_info:
        http_api(harness, ALPHA).completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert http_info.value.status_code == 429 and http_info.value.body["code"] == "rate_limit_exceeded"
    assert 4 <= int(http_info.value.response.headers["Retry-After"]) <= 5
    assert http_api(harness, BRAVO).completions.create(model=MODEL, prompt="hi", max_tokens=2).choices
    metrics = harness.router.metrics
    assert metrics.key_rejections == {"alpha:requests": 2}
    assert worker_calls(harness) == 2 * (2 + 5 + 1)  # a prefill and a decode call per served request


def test_a_full_queue_serves_interactive_before_batch_and_sheds_batch_first(
    make: Callable[..., RouterHarness],
) -> None:
    keys = [{"name": "alpha", "secret": ALPHA}, {"name": "nightly", "secret": NIGHTLY, "priority": "batch"}]
    # step_s 0.25: the holder's 40 tokens keep the only slot for 10 s while the test queues five requests one by
    # one, each confirmed by a status call; at 0.02 s that window was 0.8 s, thin on a loaded 2-core box.
    harness = make(keys, step_s=0.25, max_inflight=1, max_queue=4)
    decode = next(w for w in harness.workers if isinstance(w, FakeDecode))
    alpha, nightly = sdk(harness, ALPHA), sdk(harness, NIGHTLY)
    pool = ThreadPoolExecutor(max_workers=8)

    def send(client: Client, rid: str) -> Future[Any]:
        return pool.submit(client.generate, "hi", max_tokens=2, request_id=rid)

    def queued(n: int) -> Callable[[], bool]:
        return lambda: harness.status().router.queued_requests == n

    try:
        holder = alpha.stream("hi", max_tokens=40, request_id="holder")
        next(iter(holder))  # running: it holds the only slot
        batch = []
        for i in range(3):  # one at a time: their arrival order is the order under test
            batch.append(send(nightly, f"b{i}"))
            wait_until(queued(i + 1), what=f"batch request b{i} queued")
        urgent = [send(alpha, "i0")]
        wait_until(queued(4), what="the first interactive request queued")
        urgent.append(send(alpha, "i1"))  # the router is full: it takes the place of the newest batch (b2)
        with pytest.raises(ResourceExhausted, match="gave its place to an interactive one") as info:
            batch[2].result(timeout=10)
        assert info.value.retry_after_s == 1.0
        with pytest.raises(ResourceExhausted, match="router is full"):
            nightly.generate("hi", max_tokens=2)  # batch arriving at a full router: refused
        holder.close()
        for future in urgent + batch[:2]:
            future.result(timeout=20)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        alpha.close()
        nightly.close()
    order = [r.request_id.partition("#")[0] for r in decode.requests]  # "#n": the router's attempt number
    assert order == ["holder", "i0", "i1", "b0", "b1"], order
    metrics = harness.router.metrics
    assert metrics.key_rejections == {"nightly:shed": 1, "nightly:overload": 1}
    # Accepted requests are counted as each one ends, just after its last message reached the client: wait for
    # the router's bookkeeping (CI once read batch == 2 here, b1 not yet counted). b2 was accepted, then shed.
    wait_until(
        lambda: metrics.priorities["interactive"] == 3 and metrics.priorities["batch"] == 3,
        what="every accepted request counted by class",
        detail=lambda: str(dict(metrics.priorities)),
    )


def test_admin_scale_needs_an_admin_key(make: Callable[..., RouterHarness]) -> None:
    harness = make([*BASE_KEYS, {"name": "ops", "secret": BRAVO, "admin": True}])
    request = admin_pb2.ScaleRequest(
        targets=[admin_pb2.PoolTarget(role=admin_pb2.WORKER_ROLE_DECODE, replicas=2)]
    )
    with grpc.insecure_channel(harness.address) as channel:
        stub = admin_pb2_grpc.AdminStub(channel)
        for key, code in (
            (ALPHA, grpc.StatusCode.UNAUTHENTICATED),  # a key, but not an admin one
            (None, grpc.StatusCode.UNAUTHENTICATED),
            # the admin key passes; this router has no controller beside it, which is the next refusal
            (BRAVO, grpc.StatusCode.FAILED_PRECONDITION),
        ):
            metadata = () if key is None else (("authorization", f"Bearer {key}"),)
            with pytest.raises(grpc.RpcError) as info:
                stub.Scale(request, metadata=metadata, timeout=5)
            assert info.value.code() == code, info.value.details()
    assert main(["scale", "--server", harness.address, "--decode", "2", "--api-key", ALPHA]) == EXIT_RUNTIME
    assert harness.router.metrics.auth_failures == {"not_admin": 2, "missing": 1}


def test_under_overload_interactive_requests_keep_their_ttft_while_batch_requests_wait(
    make: Callable[..., RouterHarness],
) -> None:
    """Two classes with numbers: a backlog of batch requests several times the router's slots, and interactive
    requests arriving behind it. A batch request holds a slot for about 10 fake decode steps (0.2 s), so an
    interactive one (5 steps) waits for at most one slot to free, while the batch backlog drains at 2 per 0.2 s:
    slow enough that the backlog builds even when the 24 submissions straggle over most of a second (a clean
    clone's run on 2 busy cores never saw 16 queued when each held a slot for 0.1 s)."""
    keys = [{"name": "alpha", "secret": ALPHA}, {"name": "nightly", "secret": NIGHTLY, "priority": "batch"}]
    harness = make(keys, step_s=0.02, max_inflight=2, max_queue=64)
    alpha, nightly = sdk(harness, ALPHA), sdk(harness, NIGHTLY)
    pool = ThreadPoolExecutor(max_workers=24)
    try:
        backlog = [pool.submit(nightly.generate, "hi", max_tokens=10, timeout=60) for _ in range(24)]
        wait_until(lambda: harness.status().router.queued_requests >= 12, what="a batch backlog")
        interactive = [alpha.generate("hi", max_tokens=5).timings for _ in range(6)]  # one after another
        batch = [f.result(timeout=60).timings for f in backlog]
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        alpha.close()
        nightly.close()
    worst_interactive = max(t.time_to_first_token_seconds for t in interactive)
    batch_ttfts = sorted(t.time_to_first_token_seconds for t in batch)
    median_batch = batch_ttfts[len(batch_ttfts) // 2]
    print(
        f"TTFT interactive max {worst_interactive:.3f}s; batch median {median_batch:.3f}s, max {batch_ttfts[-1]:.3f}s"
    )
    assert worst_interactive < 0.6, interactive  # about one slot's service time, whatever the backlog
    assert median_batch > 2 * worst_interactive and batch_ttfts[-1] > 0.8, batch_ttfts
