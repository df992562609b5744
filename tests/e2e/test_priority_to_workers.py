"""The router carries each request's priority class (its API key's) to the workers: PrefillRequest.priority and
DecodeRequest.priority, which the workers' schedulers order their waiting prompts by. Real RouterServer, fake
workers that record the requests they get (tests/e2e/fake_workers.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from router.model import ServedModel
from tandem_api.tandem.v1 import worker_pb2
from tests.e2e.fake_workers import FakeColocated, FakeDecode, FakePrefill, LoopThread, RouterHarness, Script

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]
INTERACTIVE_KEY = "tk-chat-0123456789abcdef"
BATCH_KEY = "tk-nightly-0123456789abcdef"


@pytest.fixture
def keyed(router_loop: LoopThread, served_model: ServedModel, tmp_path: Path) -> Iterator[RouterHarness]:
    path = tmp_path / "keys.json"
    keys = [
        {"name": "chat", "secret": INTERACTIVE_KEY, "priority": "interactive"},
        {"name": "nightly", "secret": BATCH_KEY, "priority": "batch"},
    ]
    path.write_text(json.dumps({"keys": keys}))
    tokens = served_model.tokenizer.encode(" one two three four", False)
    harness = RouterHarness(router_loop, served_model, Script(tokens), api_keys_file=str(path))
    harness.add(FakePrefill, "p0")
    harness.add(FakeDecode, "d0")
    harness.start()
    yield harness
    harness.close()


def test_the_keys_class_reaches_the_prefill_and_the_decode_worker(keyed: RouterHarness) -> None:
    prefill, decode = keyed.workers
    for key in (BATCH_KEY, INTERACTIVE_KEY):
        with keyed.client(api_key=key) as client:
            assert client.generate("hello", max_tokens=3).text
    assert [r.priority for r in prefill.requests] == [
        worker_pb2.PRIORITY_CLASS_BATCH,
        worker_pb2.PRIORITY_CLASS_INTERACTIVE,
    ]
    assert [r.priority for r in decode.requests] == [
        worker_pb2.PRIORITY_CLASS_BATCH,
        worker_pb2.PRIORITY_CLASS_INTERACTIVE,
    ]


def test_without_keys_requests_go_to_the_workers_as_interactive(
    router_loop: LoopThread, served_model: ServedModel
) -> None:
    tokens = served_model.tokenizer.encode(" one two three four", False)
    harness = RouterHarness(router_loop, served_model, Script(tokens))
    worker = harness.add(FakeColocated, "c0")
    harness.start()
    try:
        assert harness.sdk is not None and harness.sdk.generate("hello", max_tokens=3).text
        assert [r.priority for r in worker.requests] == [worker_pb2.PRIORITY_CLASS_INTERACTIVE]
    finally:
        harness.close()
