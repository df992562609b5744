"""The real RouterServer on 127.0.0.1 with SmolLM2's tokenizer, through the real SDK: input errors, models,
health, reflection, Admin.Status and RouterControl.SetWorkers. Routing itself: test_router_dispatch.py."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from router.model import ServedModel
from tandem_api.tandem.v1 import admin_pb2, worker_pb2, worker_pb2_grpc
from tandem_client import ChatMessage, InvalidArgument, NotFound, Unavailable
from tests.e2e.fake_workers import FakeDecode, FakePrefill, LoopThread, RouterHarness, Script
from tests.loopback import health
from tests.polling import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def make(router_loop: LoopThread, served_model: ServedModel) -> Iterator:
    harnesses: list[RouterHarness] = []

    def build(**config: object) -> RouterHarness:
        harness = RouterHarness(
            router_loop,
            served_model,
            Script(served_model.tokenizer.encode(" Hi there", False) + [2]),
            **config,
        )
        harnesses.append(harness)
        return harness

    yield build
    for harness in harnesses:
        harness.close()


@pytest.mark.parametrize(
    ("kwargs", "prefix"),
    [
        ({"prompt": "hi", "temperature": -1.0}, "sampling.temperature: must be a finite number >= 0"),
        ({"prompt": "hi", "top_p": 0.0}, "sampling.top_p: must be in (0, 1]"),
        ({"token_ids": [1, 70000]}, "input.token_ids: 70000 is outside the vocabulary [0, 49152)"),
        (
            {"messages": [ChatMessage("user", "hi"), ChatMessage("wizard", "x")]},
            "input.chat.messages[1].role:",
        ),
        ({"prompt": "hi", "stop": ("",)}, "sampling.stop: each stop string must be 1..256 characters"),
        ({"prompt": "hi", "max_tokens": 9000}, "sampling.max_tokens: 9000 plus the prompt's"),
        (
            {"token_ids": [42] * 9000},
            "input: 9000 tokens leave no room for output in the model's context of 8192",
        ),
        ({"prompt": ""}, "input.text: must not be empty"),
    ],
)
def test_invalid_input_is_invalid_argument_naming_the_field(make, kwargs: dict, prefix: str) -> None:
    harness = make().start()
    with harness.client() as client, pytest.raises(InvalidArgument) as info:
        client.generate(**kwargs)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details.startswith(prefix), info.value.details
    metrics = harness.router.metrics  # recorded just after the status went out
    wait_until(lambda: metrics.rejections["invalid_argument"] == 1, what="the rejection to be counted")
    assert not metrics.outcomes


def test_unknown_model_is_not_found_and_list_models_names_the_served_one(make) -> None:
    harness = make().start()
    with harness.client() as client:
        (info,) = client.list_models()
        assert (info.id, info.max_model_len, info.vocab_size) == ("smollm2-135m-instruct", 8192, 49152)
        with pytest.raises(NotFound, match="model: unknown model 'gpt-9'; serving 'smollm2-135m-instruct'"):
            client.generate("hi", model="gpt-9")
        with pytest.raises(Unavailable, match="no worker can take the request"):
            client.generate("hi", model="smollm2-135m-instruct")  # valid, but there are no workers


def test_health_follows_the_workers_that_can_serve(make) -> None:
    harness = make()
    decode = harness.add(FakeDecode, "d0")
    prefill = harness.add(FakePrefill, "p0")
    harness.start(wait_ready=False)
    router = harness.router
    wait_until(lambda: health(harness.address) == SERVING, what="SERVING with a prefill/decode pair")
    assert health(harness.address, "tandem.v1.Generation") == SERVING
    router_loop = harness.loop
    router_loop.run(_call(router.set_workers, [decode.endpoint()]))  # a decode worker alone cannot serve
    wait_until(lambda: health(harness.address) == NOT_SERVING, what="NOT_SERVING without a prefill worker")
    assert health(harness.address, "tandem.v1.Generation") == NOT_SERVING
    router.set_workers([decode.endpoint(), prefill.endpoint()])  # from this (non-loop) thread
    wait_until(lambda: health(harness.address) == SERVING, what="SERVING again")
    prefill.state = admin_pb2.WORKER_STATE_DRAINING
    wait_until(lambda: health(harness.address) == NOT_SERVING, what="NOT_SERVING once prefill drains")


async def _call(fn, *args):  # run a plain function on the router's loop thread
    return fn(*args)


def test_health_is_not_serving_without_workers(make) -> None:
    harness = make().start()
    assert health(harness.address) == NOT_SERVING
    assert health(harness.address, "tandem.v1.Generation") == NOT_SERVING


def test_reflection_lists_the_services(make) -> None:
    harness = make().start()
    with grpc.insecure_channel(harness.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        names = {s.name for r in responses for s in r.list_services_response.service}
    assert {
        "tandem.v1.Generation",
        "tandem.v1.Admin",
        "tandem.v1.RouterControl",
        "grpc.health.v1.Health",
    } <= names


def test_status_reports_polled_workers_and_marks_a_silent_one_dead(make) -> None:
    harness = make(dead_after_failed_polls=2)
    harness.add(FakeDecode, "d0", free_blocks=40)
    prefill = harness.add(FakePrefill, "p0")
    harness.start()
    status = harness.status()
    d0 = next(w for w in status.workers if w.worker_id == "d0")
    assert (d0.role, d0.state, d0.kv_blocks_total, d0.kv_blocks_used) == ("decode", "ready", 47, 7)
    assert d0.address.startswith("127.0.0.1:") and 0 <= d0.last_heartbeat_age_seconds < 1.0
    assert (status.router.queued_requests, status.router.in_flight_requests) == (0, 0)
    harness.loop.run(prefill.stop())
    wait_until(
        lambda: any(w.worker_id == "p0" and w.state == "dead" for w in harness.status().workers),
        what="p0 DEAD after its polls fail",
    )
    p0 = next(w for w in harness.status().workers if w.worker_id == "p0")
    assert p0.last_heartbeat_age_seconds > 0.05
    wait_until(
        lambda: health(harness.address) == NOT_SERVING, what="NOT_SERVING without a live prefill worker"
    )


def test_set_workers_rpc_replaces_membership_and_ignores_older_generations(make) -> None:
    harness = make()
    decode = harness.add(FakeDecode, "d0")
    prefill = harness.add(FakePrefill, "p0")
    harness.start()
    with grpc.insecure_channel(harness.address) as channel:
        control = worker_pb2_grpc.RouterControlStub(channel)
        control.SetWorkers(worker_pb2.WorkerSet(workers=[decode.endpoint()], generation=5), timeout=5)
        assert [w.worker_id for w in harness.status().workers] == ["d0"]
        control.SetWorkers(worker_pb2.WorkerSet(workers=[prefill.endpoint()], generation=4), timeout=5)
        assert [w.worker_id for w in harness.status().workers] == ["d0"]  # older: ignored
        control.SetWorkers(
            worker_pb2.WorkerSet(workers=[decode.endpoint(), prefill.endpoint()], generation=5)
        )
        assert sorted(w.worker_id for w in harness.status().workers) == ["d0", "p0"]
        bad = worker_pb2.WorkerEndpoint(worker_id="x", role=admin_pb2.WORKER_ROLE_DECODE, address="nohost")
        with pytest.raises(grpc.RpcError) as info:
            control.SetWorkers(worker_pb2.WorkerSet(workers=[bad], generation=6), timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("workers[0].address: must be host:port")
    with pytest.raises(ValueError, match=r"workers\[1\].worker_id: 'd0' appears twice"):
        harness.router.set_workers([decode.endpoint(), decode.endpoint()])
