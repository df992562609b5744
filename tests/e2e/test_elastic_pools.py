"""Placement that follows the work, on a real cluster: `tandem serve` with 2 prefill + 1 decode workers (real Ray,
real gRPC, the embedded model on CPU), shared by every test here.

Prefix-aware placement: once a prefill worker holds a long shared system prompt in its prefix cache (and has
reported its block hashes), every request with that prefix goes there, and usage.cached_prompt_tokens and the
worker's tandem_prefix_cache_hit_tokens_total show the reuse.

Local prefill (router.local_prefill_max_tokens = 8 here): a prompt that leaves at most 8 tokens to compute on
its decode worker, because it is short or because that worker's prefix cache holds the rest, is prefilled on the
decode worker; the router counts it in tandem_placements_total{reason="local_short" | "local_cached"}.

Scaling at run time (last: it resizes the shared cluster): `tandem scale` adds a decode worker under load, which
joins and serves, then shrinks both pools back; the removed workers drain. No request fails, and afterwards no
KV block, lease or router request is left.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem_api.tandem.v1 import admin_pb2, admin_pb2_grpc
from tandem_client import ChatMessage, Client
from tests.e2e.cluster import ServeProcess, make_cluster
from tests.e2e.load import Load
from tests.loopback import free_port
from tests.polling import wait_until

pytestmark = pytest.mark.e2e

BLOCK = 16  # tests.e2e.cluster.engine_section
LOCAL_MAX = 8  # router.local_prefill_max_tokens
SYSTEM = " ".join(
    f"Rule {i}: answer in one short sentence, cite no sources, and never mention rule {i + 1}."
    for i in range(20)
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    tmp = tmp_path_factory.mktemp("elastic")
    file_sd = tmp / "targets.json"
    router = {"local_prefill_max_tokens": LOCAL_MAX}
    with make_cluster(
        tmp, prefill=2, decode=1, metrics_port=free_port(), metrics_file_sd=file_sd, router=router
    ) as serve:
        yield serve


def workers(address: str) -> dict[str, admin_pb2.WorkerInfo]:
    """The router's view of each worker (the raw message: it has fields the SDK does not surface)."""
    with grpc.insecure_channel(address) as channel:
        status = admin_pb2_grpc.AdminStub(channel).Status(admin_pb2.StatusRequest(), timeout=5)
    return {w.worker_id: w for w in status.workers}


def settled(address: str, **expected: int) -> dict[str, admin_pb2.WorkerInfo]:
    """The router's view once its polls show `expected` requests_total per worker."""

    def check() -> dict[str, admin_pb2.WorkerInfo] | None:
        view = workers(address)
        return view if all(view[w].requests_total == n for w, n in expected.items()) else None

    return wait_until(check, 10, f"requests_total {expected}", lambda: str(workers(address)))


def quiet_view(address: str) -> dict[str, admin_pb2.WorkerInfo]:
    """The router's view once its polls stop changing (two reads 1.5 s apart, three polls, agree on every
    worker's requests_total): an earlier test's requests may still be on their way into the counts."""
    last: dict[str, int] = {}

    def check() -> dict[str, admin_pb2.WorkerInfo] | None:
        nonlocal last
        view = workers(address)
        counts = {w: info.requests_total for w, info in view.items()}
        same, last = counts == last, counts
        if not same:
            time.sleep(1.5)
        return view if same else None

    return wait_until(check, 30, "a settled view of the workers", lambda: str(workers(address)))


def counter(file_sd: Path, component: str, name: str, **labels: str) -> list[float]:
    """The counter `name` (without _total) of each target of `component`, scraped from its /metrics."""
    groups = {g["labels"]["component"]: g["targets"] for g in json.loads(file_sd.read_text())}
    values = []
    for target in groups[component]:
        with urllib.request.urlopen(f"http://{target}/metrics", timeout=5) as reply:
            text = reply.read().decode()
        for family in text_string_to_metric_families(text):
            if family.name == name:
                values += [
                    s.value
                    for s in family.samples
                    if s.name.endswith("_total") and labels.items() <= s.labels.items()
                ]
    return values


def test_a_shared_system_prompt_is_reused_and_routed_to_the_worker_that_holds_it(cluster) -> None:
    def ask(client: Client, question: str):
        messages = [ChatMessage("system", SYSTEM), ChatMessage("user", question)]
        return client.generate(messages=messages, max_tokens=4, temperature=0)

    before = {w: info.requests_total for w, info in workers(cluster.address).items()}
    with Client(cluster.address) as client:
        first = ask(client, "What is the capital of France?")
        assert first.usage.prompt_tokens > 20 * BLOCK and first.usage.cached_prompt_tokens == 0
        view = wait_until(
            lambda: {w: i for w, i in workers(cluster.address).items() if i.requests_total > before[w]},
            what="the first request in the router's view",
        )
        holder = next(w for w in view if w.startswith("prefill"))
        other = "prefill-1" if holder == "prefill-0" else "prefill-0"
        # The holder's prefix report reaches the router with a status poll (0.5 s apart).
        wait_until(lambda: workers(cluster.address)[holder].indexed_prefix_blocks >= 20, what="the report")
        results = []
        for c in "ABCDE":
            # A loaded host can make a status poll time out; placement skips a worker whose polls fail.
            wait_until(lambda: workers(cluster.address)[holder].state == admin_pb2.WORKER_STATE_READY)
            results.append(ask(client, f"Name a country in Europe whose name starts with {c}."))

    # The system prompt's full blocks (the chat template's first tokens included) come from the cache.
    shared = first.usage.prompt_tokens - 2 * BLOCK
    for result in results:
        assert result.usage.cached_prompt_tokens >= shared - BLOCK, (result.usage, workers(cluster.address))
        assert result.usage.cached_prompt_tokens % BLOCK == 0
    settled(cluster.address, **{holder: before[holder] + 6, other: before[other]})
    assert cluster.metrics_file_sd is not None
    hits = wait_until(
        lambda: [
            h for h in counter(cluster.metrics_file_sd, "prefill", "tandem_prefix_cache_hit_tokens") if h > 0
        ],
        what="a prefix-hit metric",
    )
    assert hits == [sum(r.usage.cached_prompt_tokens for r in results)]


def test_short_or_mostly_cached_prompts_are_prefilled_on_the_decode_worker(cluster) -> None:
    file_sd = cluster.metrics_file_sd
    assert file_sd is not None

    def placements(reason: str) -> float:
        return sum(counter(file_sd, "router", "tandem_placements", reason=reason))

    def tcp_pairs_on_one_node() -> float:  # one local Ray node: every pair is "same", over the CPU transport
        return sum(counter(file_sd, "router", "tandem_kv_pairs", transport="tcp", nodes="same"))

    long_prompt = [(7 * i) % 5000 + 100 for i in range(25 * BLOCK)]  # 400 raw token ids: 25 full blocks
    view = quiet_view(cluster.address)
    before = {w: info.requests_total for w, info in view.items()}
    indexed_before = view["decode-0"].indexed_prefix_blocks  # the earlier tests' prompts may be there too
    local_before = {r: placements(r) for r in ("local_short", "local_cached", "prefill_worker")}
    pairs_before = tcp_pairs_on_one_node()
    with Client(cluster.address) as client:
        short = client.generate(token_ids=[100, 200, 300, 400, 500], max_tokens=3, temperature=0)
        first = client.generate(token_ids=long_prompt, max_tokens=3, temperature=0)
        # The decode worker now holds the long prompt's blocks (landed KV joins its prefix cache); once the
        # router knows, the same prompt plus 3 tokens leaves 3 to compute there.
        wait_until(
            lambda: workers(cluster.address)["decode-0"].indexed_prefix_blocks >= indexed_before + 25,
            what="the report",
        )
        cached = client.generate(token_ids=[*long_prompt, 1, 2, 3], max_tokens=3, temperature=0)
        # The same prompt, scored: the engine reads no cache for it, so the router counts all 403 tokens and
        # sends it to a prefill worker.
        scored = client.generate(token_ids=[*long_prompt, 1, 2, 3], max_tokens=0, prompt_logprobs=0)

    assert len(short.token_ids) == len(first.token_ids) == len(cached.token_ids) == 3
    assert cached.usage.cached_prompt_tokens == 25 * BLOCK  # reused by the decode worker's own engine
    assert scored.usage.cached_prompt_tokens == 0 and len(scored.prompt_logprobs) == 25 * BLOCK + 2
    assert placements("local_short") == local_before["local_short"] + 1
    assert placements("local_cached") == local_before["local_cached"] + 1
    assert placements("prefill_worker") == local_before["prefill_worker"] + 2
    # a pair each for the long prompt and the scored one (its first token ends it: no KV moves)
    assert tcp_pairs_on_one_node() == pairs_before + 2
    # Only the long prompt and the scored one reached a prefill worker; the other three ran on the decode worker.
    view = wait_until(
        lambda: (v := workers(cluster.address))["decode-0"].requests_total == before["decode-0"] + 3 and v,
        timeout_s=20,
        what="three requests on decode-0",
    )
    assert sum(view[w].requests_total - before[w] for w in before if w.startswith("prefill")) == 2, view


def tandem(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "tandem_cli.cli", *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def pools(address: str) -> dict[str, tuple[int, int, int, int]]:
    """role -> (target, ready, starting, draining), from `tandem status --json`."""
    status = json.loads(tandem("status", "--server", address, "--json"))
    return {p["role"]: (p["target"], p["ready"], p["starting"], p["draining"]) for p in status["pools"]}


def test_scale_up_and_down_under_load_loses_no_request_and_leaks_nothing(cluster) -> None:
    address = cluster.address
    assert pools(address) == {"prefill": (2, 2, 0, 0), "decode": (1, 1, 0, 0)}
    with Load(address) as load:
        wait_until(lambda: load.ok >= 3, 60, "the load running")
        assert "decode" in tandem("scale", "--server", address, "--decode", "2")
        wait_until(
            lambda: pools(address)["decode"] == (2, 2, 0, 0),
            240,
            "decode-1 serving",
            lambda: str(pools(address)),
        )
        # Placement by work sends the newcomer its share at once.
        wait_until(lambda: workers(address)["decode-1"].requests_total >= 2, 60, "decode-1 taking requests")
        served_before_shrink = load.ok
        tandem("scale", "--server", address, "--prefill", "1", "--decode", "1")
        shrunk = {"prefill": (1, 1, 0, 0), "decode": (1, 1, 0, 0)}
        wait_until(lambda: pools(address) == shrunk, 90, "both pools back to 1", lambda: str(pools(address)))
        wait_until(lambda: load.ok >= served_before_shrink + 3, 60, "requests after the shrink")
    assert load.errors == [], load.errors[:5]
    assert load.ok > 0
    text = tandem("status", "--server", address)
    assert "TARGET" in text and "decode-1" not in text and "prefill-1" not in text, text

    def idle() -> bool:
        view = workers(address)
        return set(view) == {"prefill-0", "decode-0"} and all(
            w.kv_blocks_used == 0 and w.active_leases == 0 for w in view.values()
        )

    wait_until(idle, 10, "no KV block or lease held", lambda: str(workers(address)))
    with grpc.insecure_channel(address) as channel:
        router = admin_pb2_grpc.AdminStub(channel).Status(admin_pb2.StatusRequest(), timeout=5).router
    assert router.in_flight_requests == 0 and router.queued_requests == 0
