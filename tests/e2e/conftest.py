"""Fixtures the e2e tests share: the standard cluster, and the router tests' served model and event loop.

`standard_cluster` is one `tandem serve` with the standard settings (1 prefill + 1 decode worker, 256 KV blocks
each, the embedded model, the router's /metrics, its file_sd target list and the OpenAI HTTP API on) for the
tests that only send requests to such a cluster and leave it as they found it (test_bench_cli, test_fuzz,
test_observability, test_openai_api).
Starting one costs most of a minute on the 2-core CI box. Tests that kill or stop workers, drain, or need other
settings or a count of requests from a fresh start (drain, faults, overload, soak, service) start their own.

The cluster is up only while its users run: collection moves the modules that use it next to each other (where
the first of them was; the order inside each module is kept), and it stops after the last test that uses it,
so it never idles beside the clusters those other tests start.
"""

from __future__ import annotations

import json
from collections.abc import Generator, Iterator

import pytest

from router.model import ServedModel
from tests.e2e.cluster import ServeProcess
from tests.e2e.fake_workers import LoopThread
from tests.loopback import free_ports

STANDARD = "standard_cluster"
RUNNING = pytest.StashKey[ServeProcess]()


@pytest.fixture(scope="session")
def standard_cluster(request: pytest.FixtureRequest, tmp_path_factory) -> Iterator[ServeProcess]:
    tmp = tmp_path_factory.mktemp("standard-cluster")
    file_sd = tmp / "targets" / "tandem.json"
    metrics_port, http_port = free_ports(2)
    serve = ServeProcess(
        tmp, prefill=1, decode=1, metrics_port=metrics_port, metrics_file_sd=file_sd, http_port=http_port
    )
    with serve:
        request.config.stash[RUNNING] = serve
        yield serve
    assert_stopped_cleanly(serve)


def assert_stopped_cleanly(serve: ServeProcess) -> None:
    assert serve.exit_code == 0, "".join(serve.lines[-30:])
    assert serve.metrics_file_sd is not None
    assert json.loads(serve.metrics_file_sd.read_text()) == [], "a clean stop leaves an empty target list"


def uses_standard(item: pytest.Item) -> bool:
    return STANDARD in getattr(item, "fixturenames", ())


@pytest.hookimpl(trylast=True)  # after -k / -m deselection
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules with a test on the standard cluster run back to back, where the first of them was."""
    users = {getattr(item, "module", None) for item in items if uses_standard(item)}
    if len(users) < 2:
        return
    first = next(i for i, item in enumerate(items) if getattr(item, "module", None) in users)
    moved = [item for item in items if getattr(item, "module", None) in users]
    rest = [item for item in items if getattr(item, "module", None) not in users]
    items[:] = rest[:first] + moved + rest[first:]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    """Stop the standard cluster once the last test that uses it is done (its module's fixtures first)."""
    result = yield
    serve = item.config.stash.get(RUNNING, None)
    if serve is not None and serve.exit_code is None and uses_standard(item):
        later = item.session.items[item.session.items.index(item) + 1 :]
        if not any(uses_standard(other) for other in later):
            serve.stop()
            assert_stopped_cleanly(serve)
    return result


# --- the router tests (test_router_grpc, test_router_dispatch) ---------------------------------------------
@pytest.fixture(scope="session")
def served_model() -> ServedModel:
    """SmolLM2's tokenizer and limits as the router serves them (immutable; loading takes seconds)."""
    return ServedModel.load("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def router_loop() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.close()
