"""KV handoff over nccl and cuda_ipc between two processes (the parent receives, a spawned child runs a real
KVSender): bytes identical, aborts and forged handles free everything, a sender killed after its claim.
Peers that misbehave on purpose are in test_kv_rogue_peers_gpu.py.
"""

from __future__ import annotations

import os
import random
import secrets
import time

import pytest

from kv_transfer import FailureReason, KVReceiver, KVSender
from kv_transfer.pairing import TRANSPORT_TO_PROTO
from tandem_api.tandem.v1 import kv_pb2
from tests.gpu.kv_gpu_support import (
    FIRST,
    KINDS,
    MARKS,
    NCCL_ONLY,
    NUM_BLOCKS,
    FreeList,
    checksum,
    config,
    devices,
    layout_of,
    make_cache,
    spawn,
    wait_results,
)

pytestmark = MARKS


# --- the child: a real KVSender that keeps its pairs across commands ---------------------------------------
def _sender_peer(conn, kind: str, device: str) -> None:
    cache = make_cache(7, device)
    with KVSender(layout_of(), cache, config(kind)) as sender:
        while (cmd := conn.recv()) is not None:
            target = kv_pb2.KVTarget.FromString(bytes.fromhex(cmd["target"]))
            ids = [int(x) for x in cmd["ids"].split(",")]
            if cmd["mode"] == "kill_after_claim":
                sender.open(target, ids, cmd["num_tokens"])
                time.sleep(1.0)
                os.kill(os.getpid(), 9)
            if cmd["mode"] == "all":
                handle = sender.send(target, ids, cmd["num_tokens"], FIRST)
            else:
                handle = sender.open(target, ids, cmd["num_tokens"])
                if cmd["mode"] == "groups":
                    for begin, end in ((0, 1), (1, 3), (3, 4)):
                        handle.send_layers(begin, end)
                    handle.finish(FIRST)
                else:  # abort_before_data
                    time.sleep(0.5)
                    handle.abort("test abort")
            result = handle.result(timeout=60)
            conn.send(
                dict(
                    ok=result.ok,
                    failure=result.failure.name if result.failure else "",
                    message=result.message,
                    checksum=checksum(cache, ids),
                    phases=sorted(result.phases),
                )
            )


@pytest.fixture(scope="module", params=KINDS)
def sender_peer(request):
    kind = request.param
    conn, proc = spawn(_sender_peer, kind, devices(kind)[1])
    yield kind, conn
    conn.send(None)
    proc.join(30)
    proc.kill()


def command(receiver: KVReceiver, lease, mode: str) -> dict:
    ids = random.Random(len(lease.block_ids)).sample(range(1, NUM_BLOCKS), len(lease.block_ids))
    return dict(
        target=receiver.target(lease).SerializeToString().hex(),
        ids=",".join(map(str, ids)),
        num_tokens=lease.num_tokens,
        mode=mode,
    )


def ask(conn, cmd: dict, timeout: float = 90.0) -> dict:
    conn.send(cmd)
    assert conn.poll(timeout), "sender peer went silent"
    return conn.recv()


@pytest.mark.parametrize(("num_tokens", "mode"), [(16, "all"), (112, "all"), (100, "groups")])
def test_handoff_bytes_identical(sender_peer, num_tokens, mode):
    kind, conn = sender_peer
    cache, alloc = make_cache(99, devices(kind)[0]), FreeList(num_tokens)
    with KVReceiver(layout_of(), cache, alloc, config(kind)) as receiver:
        for _ in range(2):  # the second transfer reuses the pair
            lease = receiver.reserve(f"req-{num_tokens}", num_tokens)
            sent = ask(conn, command(receiver, lease, mode))
            (result,) = wait_results(receiver)
            assert sent["ok"], sent
            assert result.ok and result.first_token == FIRST
            assert checksum(cache, lease.block_ids) == sent["checksum"]
            alloc.free(lease.block_ids)


@NCCL_ONLY
def test_workers_holding_cuda_ipc_and_nccl_move_each_lease_over_the_transport_it_names():
    """transfer.kinds [cuda_ipc, nccl] on both sides (two GPUs of one node): each lease names its transport, the
    sender opens a channel of that transport, and both kinds move the bytes intact, alternating, each reusing
    its pair the second time."""
    conn, proc = spawn(_sender_peer, "cuda_ipc,nccl", "cuda:1")
    try:
        cache, alloc = make_cache(99, "cuda:0"), FreeList(5)
        with KVReceiver(layout_of(), cache, alloc, config("cuda_ipc,nccl")) as receiver:
            assert receiver.transports == ("cuda_ipc", "nccl")
            for i, kind in enumerate(("nccl", "cuda_ipc", "nccl", "cuda_ipc")):
                lease = receiver.reserve(f"req-{i}", 48, transport=kind)
                assert receiver.target(lease).transport == TRANSPORT_TO_PROTO[kind]
                sent = ask(conn, command(receiver, lease, "all"))
                (result,) = wait_results(receiver)
                assert sent["ok"] and result.ok, (kind, sent, result)
                assert checksum(cache, lease.block_ids) == sent["checksum"]
                alloc.free(lease.block_ids)
            assert receiver.stats().transfers_ok == 4
    finally:
        conn.send(None)
        proc.join(30)
        proc.kill()


def test_aborts_and_forged_handles_free_everything(sender_peer):
    kind, conn = sender_peer
    cache, alloc = make_cache(99, devices(kind)[0]), FreeList(1)
    with KVReceiver(layout_of(), cache, alloc, config(kind)) as receiver:
        lease = receiver.reserve("a", 112)
        assert ask(conn, command(receiver, lease, "abort_before_data"))["failure"] == "SENDER_ABORTED"
        assert wait_results(receiver)[0].failure is FailureReason.SENDER_ABORTED

        lease = receiver.reserve("b", 112)
        assert receiver.abort("b")
        assert ask(conn, command(receiver, lease, "all"))["failure"] == "RECEIVER_ABORTED"

        lease = receiver.reserve("c", 112)
        before = checksum(cache, range(1, NUM_BLOCKS))
        forged = command(receiver, lease, "all")
        target = receiver.target(lease)
        target.handle = secrets.token_bytes(16)
        forged["target"] = target.SerializeToString().hex()
        refused = ask(conn, forged)
        assert refused["failure"] == "UNKNOWN_HANDLE"
        assert checksum(cache, range(1, NUM_BLOCKS)) == before
        assert receiver.abort("c")
        wait_results(receiver, 2)

        # The refusals drained the transfer (nccl: the receiver posted the receives the sends expected), so the
        # connection and the communicator carried on: the next transfer needs neither a connect nor a pair setup.
        assert "channel" in refused["phases"] and "connect" not in refused["phases"], refused
        lease = receiver.reserve("d", 112)
        after = ask(conn, command(receiver, lease, "all"))
        (landed,) = wait_results(receiver)
        assert after["ok"] and landed.ok and checksum(cache, lease.block_ids) == after["checksum"]
        assert "channel" in after["phases"] and "connect" not in after["phases"], after
        alloc.free(lease.block_ids)
    assert alloc.all_free


@pytest.mark.parametrize("kind", KINDS)
def test_sender_killed_after_claim_frees_the_lease(kind):
    cache, alloc = make_cache(99, devices(kind)[0]), FreeList(2)
    conn, proc = spawn(_sender_peer, kind, devices(kind)[1])
    try:
        with KVReceiver(layout_of(), cache, alloc, config(kind)) as receiver:
            lease = receiver.reserve("warm", 16)  # a first transfer sets the pair up
            assert ask(conn, command(receiver, lease, "all"))["ok"]
            wait_results(receiver)
            alloc.free(lease.block_ids)
            lease = receiver.reserve("k", 112)
            conn.send(command(receiver, lease, "kill_after_claim"))
            (result,) = wait_results(receiver, timeout=60)
        assert result.failure is FailureReason.CONNECTION_LOST and alloc.all_free
    finally:
        proc.kill()


def _overlapping_sender(conn, lanes: int) -> None:
    """Opens transfer A and sends its first layer group only (as a prefill streaming layer groups does while
    its step runs), then sends transfer B whole to the same receiver; A finishes after B's result is in."""
    cache = make_cache(7, "cuda:1")
    with KVSender(layout_of(), cache, config("nccl", nccl_lanes=lanes)) as sender:
        cmd = conn.recv()
        (ta, ids_a), (tb, ids_b) = [
            (kv_pb2.KVTarget.FromString(bytes.fromhex(t)), [int(x) for x in ids.split(",")])
            for t, ids in cmd["transfers"]
        ]
        first = sender.open(ta, ids_a, cmd["num_tokens"])
        first.send_layers(0, 1)
        second = sender.send(tb, ids_b, cmd["num_tokens"], FIRST, timeout_s=5.0)
        b = second.result(timeout=30)
        first.send_layers(1, 4)
        first.finish(FIRST)
        a = first.result(timeout=60)
        conn.send(
            dict(
                a_ok=a.ok,
                b_ok=b.ok,
                b_failure=b.failure.name if b.failure else "",
                sums=[checksum(cache, ids_a), checksum(cache, ids_b)],
            )
        )


@NCCL_ONLY
@pytest.mark.parametrize("lanes", [2, 1])
def test_a_second_nccl_transfer_to_one_receiver_runs_beside_one_that_is_still_streaming(lanes):
    """transfer.nccl_lanes: with two lanes, B lands while A (same sender, same receiver) holds its lane waiting
    for its next layer group; with one lane, B can only wait for A, and its 5 s deadline runs out first."""
    conn, proc = spawn(_overlapping_sender, lanes)
    try:
        cache, alloc = make_cache(99, "cuda:0"), FreeList(3)
        with KVReceiver(layout_of(), cache, alloc, config("nccl")) as receiver:
            leases = [receiver.reserve(f"req-{name}", 48) for name in ("a", "b")]
            transfers = []
            for i, lease in enumerate(leases):
                ids = random.Random(i).sample(range(1, NUM_BLOCKS), len(lease.block_ids))
                transfers.append((receiver.target(lease).SerializeToString().hex(), ",".join(map(str, ids))))
            sent = ask(conn, dict(transfers=transfers, num_tokens=48))
            assert sent["a_ok"], sent
            if lanes == 1:
                assert not sent["b_ok"] and sent["b_failure"] == "DEADLINE_EXCEEDED", sent
                return
            assert sent["b_ok"], sent
            results = {r.request_id: r for r in wait_results(receiver, 2)}
            assert results["req-a"].ok and results["req-b"].ok
            assert checksum(cache, leases[0].block_ids) == sent["sums"][0]
            assert checksum(cache, leases[1].block_ids) == sent["sums"][1]
    finally:
        proc.join(30)
        proc.kill()
