"""Fixtures the e2e tests share: the standard cluster, and the router tests' served model and event loop.

`standard_cluster` is one `tandem serve` with the standard settings (2 prefill + 2 decode workers, 256 KV blocks
each, the embedded model, the router's /metrics, its file_sd target list and the OpenAI HTTP API on). Starting
one costs most of a minute on the 2-core CI box, so every test that can runs on this one:

    leaves it as it found it   standard_cluster                    test_bench_cli, test_fuzz, test_observability,
                                                                   test_openai_api, test_service
    kills or hangs workers     standard_cluster_replacing_workers  test_faults (TestPairs): the controller replaces
                                                                   each, the fixture waits until every pool is back

and they run in that order (collection moves them next to each other, where the first of them was; the order
among tests of one kind is kept), so a test never sees a worker that an earlier test replaced unless it asked
for the cluster after faults. The cluster stops after the last test that uses it, so it never idles beside the
clusters other tests start, and the session checks that stop (exit 0, an empty target list). Tests that need
other settings (router limits, KV pool sizes, a controller that stays away, pools that change size) or a fresh
start (overload, soak, elastic pools, autoscaler, test_faults' TestStall, and test_drain, which stops its
cluster and then finds every process of it gone) start their own.
"""

from __future__ import annotations

import json
from collections.abc import Generator, Iterator

import pytest

from router.model import ServedModel
from tandem_client import Client
from tests.e2e.cluster import STANDARD_DECODE, STANDARD_PREFILL, ServeProcess
from tests.e2e.fake_workers import LoopThread
from tests.loopback import free_ports
from tests.polling import wait_until

STANDARD = "standard_cluster"
REPLACING_WORKERS = "standard_cluster_replacing_workers"
RUNNING = pytest.StashKey[ServeProcess]()


@pytest.fixture(scope="session")
def standard_cluster(request: pytest.FixtureRequest, tmp_path_factory) -> Iterator[ServeProcess]:
    tmp = tmp_path_factory.mktemp("standard-cluster")
    file_sd = tmp / "targets" / "tandem.json"
    metrics_port, http_port = free_ports(2)
    serve = ServeProcess(
        tmp,
        prefill=STANDARD_PREFILL,
        decode=STANDARD_DECODE,
        metrics_port=metrics_port,
        metrics_file_sd=file_sd,
        http_port=http_port,
    )
    with serve:
        request.config.stash[RUNNING] = serve
        yield serve
    assert_stopped_cleanly(serve)


@pytest.fixture
def standard_cluster_replacing_workers(standard_cluster: ServeProcess) -> Iterator[ServeProcess]:
    """The standard cluster for a test that kills or hangs its workers: it runs after every test that needs
    the cluster as it started, and on return every pool is back at full strength (the controller replaced each
    victim: same ids, new processes and addresses, counters from zero)."""
    yield standard_cluster
    wait_until(
        lambda: pools_settled(standard_cluster.address),
        120,
        "every pool of the standard cluster back at full strength",
        lambda: "".join(standard_cluster.lines[-15:]),
        every_s=0.2,
    )


def pools_settled(address: str) -> bool:
    """Every pool has its target of ready workers, nothing starting or draining."""
    with Client(address) as client:
        pools = client.status(timeout=5).pools
    return bool(pools) and all(p.ready == p.target and not p.starting and not p.draining for p in pools)


def assert_stopped_cleanly(serve: ServeProcess) -> None:
    assert serve.exit_code == 0, "".join(serve.lines[-30:])
    assert serve.metrics_file_sd is not None
    assert json.loads(serve.metrics_file_sd.read_text()) == [], "a clean stop leaves an empty target list"


def uses_standard(item: pytest.Item) -> bool:
    return STANDARD in getattr(item, "fixturenames", ())


def replaces_workers(item: pytest.Item) -> bool:
    return REPLACING_WORKERS in getattr(item, "fixturenames", ())


@pytest.hookimpl(trylast=True)  # after -k / -m deselection
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests on the standard cluster run back to back, where the first of them was: those that leave it as
    they found it, then those that replace its workers (collection order within each)."""
    users = [item for item in items if uses_standard(item)]
    if not users:
        return
    first = items.index(users[0])
    rest = [item for item in items if not uses_standard(item)]
    users.sort(key=replaces_workers)  # stable: collection order within each kind
    items[:] = rest[:first] + users + rest[first:]


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
