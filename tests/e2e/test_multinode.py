"""Tandem on a Ray cluster of three nodes on one machine (tests/e2e/ray_nodes.py), and the loss of one of them.

    head  127.0.0.2  tandem.io/pool=prefill   the prefill worker (pinned by a Ray label)
    B     127.0.0.3  {decode_slot: 1}         one decode worker (pinned by a custom resource)
    C     127.0.0.4  {decode_slot: 1}         the other decode worker
    B2    127.0.0.5  {decode_slot: 1}         joins after B is lost (a replacement machine)

`tandem serve --config` joins the cluster through `ray.address`; every prompt is computed on the head and its KV
crosses to a decode worker on another node, and the greedy tokens equal the engine's offline. The deployment
allows `transfer.kinds: [cuda_ipc, nccl, tcp]`: CPU workers hold tcp alone, so every pair runs over tcp. Its
caches are FP8 (`cache.dtype: fp8_e4m3`, the offline reference's too): the KV crosses nodes as e4m3 codes. B's raylet is then killed under load: every request ends (served, resumed on C, or with a
clear status), nothing is left held, the controller replaces B's worker and says why the replacement cannot be
placed, and once B2 joins the replacement starts there and serves.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml

from deploy.config import load_config
from model_runtime.llm import LLM
from tandem_api.tandem.v1 import worker_pb2, worker_pb2_grpc
from tandem_client import Client
from tests.e2e.cluster import ServeProcess
from tests.e2e.faults_support import assert_all_idle, greedy, offline_engine, workers
from tests.e2e.load import Load, RequestKind
from tests.e2e.ray_nodes import RayNode, multinode_head
from tests.polling import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
PROMPTS = [
    "Name three rivers of Europe.",
    "What is a raylet?",
    "Count from one to five.",
    "Say hello in French.",
]
MAX_TOKENS = 12
NUM_BLOCKS = 192
DECODE_LOAD = RequestKind("decode", max_tokens=24)
CACHE_DTYPE = "fp8_e4m3"


@pytest.fixture(scope="module")
def offline() -> Iterator[LLM]:
    with offline_engine(NUM_BLOCKS, cache_dtype=CACHE_DTYPE) as llm:
        yield llm


class Nodes:
    """The test's Ray nodes; every one is stopped, and its leftovers killed, however the test ends."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.head = multinode_head(root, {}, {"tandem.io/pool": "prefill"})
        self.all = [self.head]

    def join(self, name: str, node_ip: str) -> RayNode:
        node = RayNode(self.head, self.root / name, node_ip, {"decode_slot": 1})
        self.all.append(node)
        node.start()
        return node

    def stop(self) -> list[str]:
        for node in reversed(self.all):
            node.stop()
        left = [p for node in self.all for p in node.leftovers()]
        for node in self.all:
            node.kill_leftovers()
        return left


@pytest.fixture
def nodes() -> Iterator[Nodes]:
    # A short private dir: Ray's unix socket paths must stay under 107 bytes.
    root = Path(tempfile.mkdtemp(prefix="tandem-nodes-", dir="/tmp"))
    found = Nodes(root)
    try:
        found.head.start()
        yield found
    finally:
        left = found.stop()
        shutil.rmtree(root, ignore_errors=True)
    assert left == [], f"Ray processes outlived their nodes: {left}"


def config_for(head_address: str) -> dict:
    """Joins the test's cluster; the controller quick to notice."""
    return {
        "ray": {"address": head_address},
        "controller": {"health_interval_s": 0.5, "drain_timeout_s": 10},
    }


def check_greedy(address: str, offline: LLM) -> None:
    with Client(address) as client:
        for prompt in PROMPTS:
            got = client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, timeout=120)
            assert list(got.token_ids) == greedy(offline, prompt, MAX_TOKENS), prompt


def layout_fingerprint(worker) -> str:
    """The worker's own status (the SDK's WorkerInfo leaves the KV layout out)."""
    stub = (
        worker_pb2_grpc.PrefillWorkerStub
        if worker.role.name == "PREFILL"
        else worker_pb2_grpc.DecodeWorkerStub
    )
    with grpc.insecure_channel(worker.address) as channel:
        return str(stub(channel).Status(worker_pb2.WorkerStatusRequest(), timeout=10).layout_fingerprint)


def node_ip(address: str) -> str:
    return address.rpartition(":")[0]


def restarting(cluster: ServeProcess, worker_id: str) -> bool:
    return any(f"worker {worker_id} restarting (1)" in line for line in cluster.lines)


def active_pairs(address: str):
    with Client(address) as client:
        return client.status().router.active_pairs


def decode_pool(address: str):
    with Client(address) as client:
        return next(p for p in client.status().pools if p.role.name == "DECODE")


def test_pools_on_chosen_nodes_survive_the_loss_of_one(nodes: Nodes, tmp_path: Path, offline: LLM) -> None:
    b = nodes.join("b", "127.0.0.3")
    nodes.join("c", "127.0.0.4")
    serve = ServeProcess(tmp_path, prefill=1, decode=2, num_blocks=NUM_BLOCKS, env=nodes.head.env)
    config = yaml.safe_load(serve.config_path.read_text())
    config.update(config_for(nodes.head.gcs_address))
    config["prefill"]["ray_labels"] = {"tandem.io/pool": "prefill"}
    config["decode"]["ray_resources"] = {"decode_slot": 1}
    config["transfer"] = {"kinds": ["cuda_ipc", "nccl", "tcp"]}
    for role in ("prefill", "decode"):
        config[role]["engine"]["cache"]["dtype"] = CACHE_DTYPE
    serve.config_path.write_text(yaml.safe_dump(config))
    assert load_config(serve.config_path).ray.address == nodes.head.gcs_address

    with serve as cluster:
        try:
            _scenario(cluster, nodes, b, offline)
        finally:
            print("".join(cluster.lines[-120:]))  # shown with a failing test


def _scenario(cluster: ServeProcess, nodes: Nodes, b: RayNode, offline: LLM) -> None:
    # 1. Each pool on its nodes; every prompt's KV crosses from the head to another node.
    found = workers(cluster.address)
    placed = {w.worker_id: node_ip(w.address) for w in found.values()}
    assert placed["prefill-0"] == "127.0.0.2", placed
    assert sorted([placed["decode-0"], placed["decode-1"]]) == ["127.0.0.3", "127.0.0.4"], placed
    assert len({w.node_id for w in found.values()}) == 3, "each worker on its own Ray node"
    # Every worker's KV layout is the offline FP8 engine's: FP8 blocks (codes and their scales) on every node.
    assert offline.engine.layout.quantized
    assert {layout_fingerprint(w) for w in found.values()} == {offline.engine.layout.fingerprint()}
    check_greedy(cluster.address, offline)
    on_b = next(wid for wid, ip in placed.items() if ip == "127.0.0.3")

    # 2. B is lost under load.
    with Load(cluster.address, clients=3, kind=DECODE_LOAD, max_requests=40, timeout_s=90) as load:
        wait_until(lambda: load.ok >= 3, 120, "the load to get going")
        # `tandem status` lists the pairs in use: each crosses from the head to B or C, over tcp.
        pairs = wait_until(lambda: active_pairs(cluster.address), 30, "a pair in use")
        assert {(p.prefill_worker_id, p.kv_transport, p.nodes) for p in pairs} == {
            ("prefill-0", "tcp", "cross")
        }
        assert {p.decode_worker_id for p in pairs} <= {"decode-0", "decode-1"}, pairs
        before = load.ok
        b.kill_raylet()
        lost = time.monotonic()
        # Whichever the controller learns first, Ray's word that node B is gone or the heartbeat of B's worker
        # failing (the worker's process died with its raylet), it takes the worker out and starts another.
        wait_until(lambda: restarting(cluster, on_b), 30, "the controller to replace B's worker")
        seen_after_s = time.monotonic() - lost
        pool = wait_until(lambda: (p := decode_pool(cluster.address)).waiting and p, 30, "the wait reason")
        assert pool.ready == 1 and pool.starting == 1, pool
        assert pool.waiting == f"{on_b}: every node with {{decode_slot: 1}} has it in use", pool.waiting
        wait_until(lambda: load.ok >= before + 6, 120, "requests to be served again after the loss")
    assert load.ok + len(load.errors) >= before + 6
    unclear = [e for e in load.errors if "UNAVAILABLE" not in e]
    assert unclear == [], f"requests that ended without a clear status: {unclear}"
    said = [line.strip() for line in cluster.lines if "is gone" in line or "failed its health check" in line]
    print(
        f"B's worker replaced {seen_after_s:.1f} s after the kill ({said}); {load.ok} served, {load.errors}"
    )
    assert_all_idle(cluster.address)
    alive = workers(cluster.address)
    assert on_b not in alive and len(alive) == 2, sorted(alive)

    # 3. A replacement machine joins: the waiting worker starts there, and serves.
    nodes.join("b2", "127.0.0.5")
    wait_until(lambda: decode_pool(cluster.address).ready == 2, 180, "the replacement to serve", every_s=1.0)
    assert decode_pool(cluster.address).waiting == ""
    replaced = workers(cluster.address)[on_b]
    assert node_ip(replaced.address) == "127.0.0.5", replaced.address
    check_greedy(cluster.address, offline)
    assert_all_idle(cluster.address)
    assert cluster.stop() == 0
