"""KV handoff over the tcp transport between two processes on 127.0.0.1.

The parent process runs a KVReceiver (the decode side); a spawned child runs a KVSender (the prefill side),
building its own cache from a seed and reporting plain values (reason names, checksums) back. For the
dead/stopped-receiver cases the roles swap. A few protocol attacks use a raw socket speaking the wire format.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import secrets
import signal
import threading
import time

import pytest

from kv_transfer import FailureReason, KVReceiver, KVSender
from kv_transfer.frames import FrameConnection, Watch, encode_frame
from kv_transfer.pairing import make_hello
from model_runtime.kv_layout import KVLayout
from tandem_api.tandem.v1 import kv_pb2
from tests.e2e.kv_tcp_peer import (
    CHUNK,
    FIRST,
    NUM_BLOCKS,
    Peer,
    ShuffledFreeList,
    checksum,
    config,
    make_cache,
    make_layout,
    receiver_peer,
    send_cmd,
    wait_results,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def peer():
    p = Peer()
    yield p
    p.conn.send({"op": "exit"})
    p.proc.join(10)
    if p.proc.is_alive():
        p.proc.kill()


# --- data moves bit-exact ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn"])  # FP8: codes move as bytes
@pytest.mark.parametrize(("num_tokens", "mode"), [(3, "all"), (11, "groups"), (27, "all")])
def test_handoff_bytes_identical(peer, dtype, num_tokens, mode):
    layout = make_layout(dtype)
    cache, alloc = make_cache(layout, seed=99), ShuffledFreeList(NUM_BLOCKS, seed=num_tokens)
    with KVReceiver(layout, cache, alloc, config()) as receiver:
        lease = receiver.reserve(f"req-{num_tokens}", num_tokens)
        others = [b for b in range(1, NUM_BLOCKS) if b not in lease.block_ids]
        before = checksum(cache, others)
        cmd = send_cmd(receiver, lease, dtype, mode)
        sent = peer.run(**cmd)
        (result,) = wait_results(receiver)
        stats = receiver.stats()
    assert sent["ok"], sent
    assert sent["released"] == 1 and sent["released_ids"] == cmd["ids"]
    assert result.ok and result.first_token == FIRST
    assert len(lease.block_ids) % 2 == 1 and cmd["ids"] != ",".join(map(str, lease.block_ids))
    assert checksum(cache, lease.block_ids) == sent["checksum"]
    assert checksum(cache, others) == before  # nothing outside the lease was written
    assert stats.transfers_ok == 1 and stats.bytes_ok == layout.bytes_per_block * len(lease.block_ids)
    assert len(alloc.free_ids) == alloc.total - len(lease.block_ids)  # landed blocks are the caller's


# --- aborts from either side at every phase ---------------------------------------------------------------
@pytest.mark.parametrize("mode", ["abort_before_data", "abort_mid", "abort_after_data"])
def test_sender_abort_at_each_phase_frees_both_sides(peer, mode):
    layout = make_layout("float32")
    cache, alloc = make_cache(layout, 5), ShuffledFreeList(NUM_BLOCKS, 1)
    with KVReceiver(layout, cache, alloc, config()) as receiver:
        lease = receiver.reserve("req", 27)
        before = checksum(cache, lease.block_ids)
        sent = peer.run(**send_cmd(receiver, lease, "float32", mode, pace_ms=5))
        (result,) = wait_results(receiver)
    assert sent["failure"] == "SENDER_ABORTED" and sent["released"] == 1
    assert result.failure is FailureReason.SENDER_ABORTED, result
    assert alloc.all_free
    if mode == "abort_before_data":
        assert checksum(cache, lease.block_ids) == before


@pytest.mark.parametrize("phase", ["before_begin", "mid_stream", "after_data"])
def test_receiver_abort_at_each_phase_frees_both_sides(peer, phase):
    layout = make_layout("float32")
    cache, alloc = make_cache(layout, 5), ShuffledFreeList(NUM_BLOCKS, 2)
    with KVReceiver(layout, cache, alloc, config()) as receiver:
        lease = receiver.reserve("req", 27)
        if phase == "before_begin":
            assert receiver.abort("req", "client cancelled")
            results = wait_results(receiver)
            sent = peer.run(**send_cmd(receiver, lease, "float32", "all"))
        elif phase == "mid_stream":
            peer.start(**send_cmd(receiver, lease, "float32", "all", pace_ms=20))
            peer.wait_event("streaming")
            assert receiver.abort(lease.handle)
            sent = peer.result()
            results = wait_results(receiver)
        else:
            peer.start(**send_cmd(receiver, lease, "float32", "wait_go"))
            peer.wait_event("data_sent")
            assert receiver.abort("req")
            results = wait_results(receiver)
            assert alloc.all_free  # freed before the sender says another word
            peer.conn.send(("go",))
            sent = peer.result()
        assert not receiver.poll()  # exactly one result per lease
    assert sent["failure"] == "RECEIVER_ABORTED" and sent["released"] == 1, sent
    assert results[0].failure is FailureReason.RECEIVER_ABORTED
    assert alloc.all_free


def test_sender_abort_before_begin_never_touches_the_receiver():
    """A send still queued behind another is aborted: it never connects; the lease stays the decode side's."""
    layout = make_layout("float32")
    cache, alloc = make_cache(layout, 5), ShuffledFreeList(NUM_BLOCKS, 11)
    gate, released = threading.Event(), []
    with KVReceiver(layout, cache, alloc, config()) as receiver:
        first, second = receiver.reserve("first", 11), receiver.reserve("second", 11)
        with KVSender(layout, make_cache(layout, 11), config(max_inflight_sends=1), on_release=released.append,
                      chunk_hook=lambda *_: gate.wait(10)) as sender:  # fmt: skip
            busy = sender.send(receiver.target(first), [1, 2, 3], 11, FIRST)
            queued = sender.send(receiver.target(second), [4, 5, 6], 11, FIRST)
            queued.abort("cancelled while queued")
            gate.set()
            assert busy.result(10).ok
            aborted = queued.result(10)
        assert aborted.failure is FailureReason.SENDER_ABORTED and aborted in released
        assert receiver.stats().active_leases == 1  # "second" was never claimed: still reserved
        assert receiver.abort("second")
        outcomes = {r.request_id: r.failure for r in wait_results(receiver, 2)}
        assert outcomes == {"first": None, "second": FailureReason.RECEIVER_ABORTED}


# --- handles: forged, reused, expired; lease expiry; layout mismatch ---------------------------------------
def test_forged_reused_and_expired_handles_fail_closed(peer):
    layout = make_layout("float32")
    cache, alloc = make_cache(layout, 5), ShuffledFreeList(NUM_BLOCKS, 3)
    with KVReceiver(layout, cache, alloc, config()) as receiver:
        lease = receiver.reserve("req", 11)
        before = checksum(cache, list(range(1, NUM_BLOCKS)))
        forged = send_cmd(receiver, lease, "float32", "all")
        target = receiver.target(lease)
        target.handle = secrets.token_bytes(16)
        forged["target"] = target.SerializeToString().hex()
        assert peer.run(**forged)["failure"] == "UNKNOWN_HANDLE"
        assert checksum(cache, list(range(1, NUM_BLOCKS))) == before  # no write anywhere

        real = send_cmd(receiver, lease, "float32", "all")
        assert peer.run(**real)["ok"]
        wait_results(receiver)
        after_landing = checksum(cache, lease.block_ids)
        reuse = dict(real, seed=12)  # same handle, different bytes
        assert peer.run(**reuse)["failure"] == "HANDLE_REUSED"
        assert checksum(cache, lease.block_ids) == after_landing

        short = receiver.reserve("short", 5, ttl_s=0.2)
        (expired,) = wait_results(receiver)  # the reaper ends it with no traffic at all
        assert expired.failure is FailureReason.LEASE_EXPIRED and expired.request_id == "short"
        late = peer.run(**send_cmd(receiver, short, "float32", "all"))
        assert late["failure"] == "LEASE_EXPIRED" and late["released"] == 1
    assert len(alloc.free_ids) == alloc.total - len(lease.block_ids)


def test_layout_mismatch_is_refused_naming_the_field(peer):
    layout = make_layout("float32")
    with KVReceiver(layout, make_cache(layout, 5), ShuffledFreeList(NUM_BLOCKS, 4), config()) as receiver:
        lease = receiver.reserve("req", 4)
        sent = peer.run(**send_cmd(receiver, lease, "float32", "all", kv_heads=4))
    assert (
        sent["failure"] == "LAYOUT_MISMATCH" and "num_kv_heads" in sent["message"] and sent["released"] == 1
    )


def test_an_fp8_cache_refuses_a_bfloat16_sender_naming_the_dtype(peer):
    layout = make_layout("float8_e4m3fn")
    with KVReceiver(layout, make_cache(layout, 5), ShuffledFreeList(NUM_BLOCKS, 4), config()) as receiver:
        lease = receiver.reserve("req", 4)
        sent = peer.run(**send_cmd(receiver, lease, "bfloat16", "all"))
    assert sent["failure"] == "LAYOUT_MISMATCH" and "dtype" in sent["message"], sent
    assert sent["released"] == 1


def test_workers_allowed_several_transports_hold_the_ones_a_cpu_can_use_and_leases_name_theirs():
    """transfer.kinds [cuda_ipc, nccl, tcp] on CPU caches: both sides hold tcp alone; a lease names its transport
    (the first held unless asked), one the receiver lacks is refused at reserve, and a target naming one the
    sender lacks fails before any connection (TRANSPORT_MISMATCH). Both sides in this process."""
    layout = make_layout("float32")
    several = config(kinds=("cuda_ipc", "nccl", "tcp"))
    cache, src = make_cache(layout, 1), make_cache(layout, 2)
    alloc = ShuffledFreeList(NUM_BLOCKS, 3)
    with KVReceiver(layout, cache, alloc, several) as receiver, KVSender(layout, src, several) as sender:
        assert receiver.transports == ("tcp",) and sender.transports == ("tcp",)
        with pytest.raises(ValueError, match="holds tcp, not 'nccl'"):
            receiver.reserve("refused", 5, transport="nccl")
        lease = receiver.reserve("r1", 5)
        target = receiver.target(lease)
        assert lease.transport == "tcp" and target.transport == kv_pb2.KV_TRANSPORT_TCP
        sent = sender.send(target, [3, 7], 5, FIRST).future.result(timeout=20)
        (landed,) = wait_results(receiver)
        assert sent.ok and landed.ok and checksum(cache, lease.block_ids) == checksum(src, [3, 7])
        other = receiver.target(receiver.reserve("r2", 5))
        other.transport = kv_pb2.KV_TRANSPORT_NCCL
        refused = sender.send(other, [3, 7], 5, FIRST).future.result(timeout=20)
        assert refused.failure is FailureReason.TRANSPORT_MISMATCH and "target=nccl" in refused.message
        assert receiver.abort("r2")
    assert alloc.total - len(alloc.free_ids) == len(lease.block_ids)  # only the landed lease's blocks are out


# --- dead and stopped peers ------------------------------------------------------------------------------
def test_sender_killed_mid_stream_frees_the_lease():
    victim = Peer()
    try:
        layout = make_layout("float32")
        alloc = ShuffledFreeList(NUM_BLOCKS, 6)
        with KVReceiver(layout, make_cache(layout, 5), alloc, config()) as receiver:
            lease = receiver.reserve("req", 27)
            victim.start(**send_cmd(receiver, lease, "float32", "all", pace_ms=50))
            victim.wait_event("streaming")
            os.kill(victim.proc.pid, signal.SIGKILL)
            start = time.monotonic()
            (result,) = wait_results(receiver)
        assert result.failure is FailureReason.CONNECTION_LOST
        assert time.monotonic() - start < 5 and alloc.all_free
    finally:
        victim.proc.kill()


@pytest.mark.parametrize("fate", ["killed", "stopped"])
def test_receiver_dead_or_stopped_mid_stream_releases_sender_blocks(fate):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver_peer, args=(child, "float32", 27), daemon=True)
    proc.start()
    try:
        assert parent.poll(30)
        target = kv_pb2.KVTarget.FromString(bytes.fromhex(parent.recv()))
        layout = make_layout("float32")
        streaming, released = threading.Event(), []
        hook = lambda _rid, sent: (streaming.set(), time.sleep(0.02))  # noqa: E731
        # A stopped receiver's kernel still buffers these few KiB, so the sender then waits for an ack that never
        # comes: only its deadline can end the transfer. A killed one resets the connection.
        with KVSender(
            layout,
            make_cache(layout, 11),
            config(chunk_bytes=CHUNK),
            on_release=released.append,
            chunk_hook=hook,
        ) as sender:
            handle = sender.send(target, list(range(1, 8)), 27, FIRST, timeout_s=2.0)
            assert streaming.wait(10)
            os.kill(proc.pid, signal.SIGKILL if fate == "killed" else signal.SIGSTOP)
            result = handle.result(timeout=10)
        expected = {"killed": FailureReason.CONNECTION_LOST, "stopped": FailureReason.DEADLINE_EXCEEDED}[fate]
        assert result.failure is expected, result
        assert released == [result] and result.seconds < 5
    finally:
        proc.kill()
        proc.join(5)


# --- protocol attacks with a raw socket ------------------------------------------------------------------
def raw_claim(receiver: KVReceiver, layout: KVLayout, lease, num_bytes: int | None = None) -> FrameConnection:
    import socket

    conn = FrameConnection(socket.create_connection(receiver.endpoint, timeout=2), 0.01)
    watch = Watch(time.monotonic() + 5, FailureReason.DEADLINE_EXCEEDED, "test")
    n = len(lease.block_ids)
    begin = kv_pb2.KVBegin(
        handle=lease.handle,
        request_id=lease.request_id,
        num_blocks=n,
        num_tokens=lease.num_tokens,
        num_bytes=num_bytes or layout.bytes_per_block * n,
    )
    conn.send_frame(make_hello(layout, secrets.token_bytes(16), "tcp", ""), watch)
    conn.send_frame(kv_pb2.KVFrame(begin=begin), watch)
    assert conn.read_frame(watch).HasField("hello")
    return conn


def test_stalled_sender_lease_expiry_frees_blocks_and_no_stale_write_lands():
    layout = make_layout("float32")
    cache, alloc = make_cache(layout, 5), ShuffledFreeList(NUM_BLOCKS, 8)
    with KVReceiver(layout, cache, alloc, config()) as receiver:
        lease = receiver.reserve("req", 27, ttl_s=0.5)
        conn = raw_claim(receiver, layout, lease)
        watch = Watch(time.monotonic() + 5, FailureReason.DEADLINE_EXCEEDED, "test")
        layer_bytes = layout.bytes_per_block_layer * len(lease.block_ids)
        conn.send_frame(
            kv_pb2.KVFrame(part=kv_pb2.KVPart(layer_begin=0, layer_end=4, num_bytes=4 * layer_bytes)), watch
        )
        conn.sock.sendall((layer_bytes).to_bytes(4, "big") + b"\x01" * (layer_bytes // 2))  # then stall
        (result,) = wait_results(receiver)
        assert result.failure is FailureReason.LEASE_EXPIRED and alloc.all_free
        cache[:, :, list(lease.block_ids)] = 123.0  # the blocks' next owner writes them
        with contextlib.suppress(OSError):  # the stalled sender wakes up and sends the rest of the layer
            conn.sock.sendall(b"\x02" * (layer_bytes - layer_bytes // 2))
        time.sleep(0.3)
        assert bool((cache[:, :, list(lease.block_ids)] == 123.0).all()), (
            "a stale write landed after the free"
        )
        conn.close()


def test_byte_count_disagreeing_with_the_lease_fails_closed():
    layout = make_layout("float32")
    cache, alloc = make_cache(layout, 5), ShuffledFreeList(NUM_BLOCKS, 9)
    with KVReceiver(layout, cache, alloc, config()) as receiver:
        lease = receiver.reserve("req", 11)
        before = checksum(cache, lease.block_ids)
        conn = raw_claim(receiver, layout, lease, num_bytes=layout.bytes_per_block * 3 + 8)
        reply = conn.read_frame(Watch(time.monotonic() + 5, FailureReason.DEADLINE_EXCEEDED, "test"))
        conn.close()
        (result,) = wait_results(receiver)
    assert reply.error.code == FailureReason.DESCRIPTOR_MISMATCH.value and "num_bytes" in reply.error.message
    assert result.failure is FailureReason.DESCRIPTOR_MISMATCH and alloc.all_free
    assert checksum(cache, lease.block_ids) == before


def test_garbage_on_the_control_port_is_refused_and_the_receiver_survives(peer):
    import socket

    layout = make_layout("float32")
    with KVReceiver(layout, make_cache(layout, 5), ShuffledFreeList(NUM_BLOCKS, 10), config()) as receiver:
        with socket.create_connection(receiver.endpoint, timeout=2) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\n\r\n" + encode_frame(kv_pb2.KVFrame(ack=kv_pb2.KVAck())))
            assert b"bad frame magic" in sock.recv(4096)
        lease = receiver.reserve("req", 4)
        assert peer.run(**send_cmd(receiver, lease, "float32", "all"))["ok"]


# --- control connections are kept and reused -------------------------------------------------------------
def _send_one(sender: KVSender, receiver: KVReceiver, cache, landing, rid: str, forge: bool = False):
    """One transfer of `cache`'s blocks into the lease of `rid`; `landing` is the receiver's cache."""
    lease = receiver.reserve(rid, 11)
    target = receiver.target(lease)
    if forge:
        target.handle = secrets.token_bytes(16)
    ids = list(range(1, 1 + len(lease.block_ids)))
    sent = sender.send(target, ids, 11, FIRST).result(timeout=20)
    if forge:
        assert receiver.abort(rid)
    (landed,) = wait_results(receiver)
    if landed.ok:
        assert checksum(landing, lease.block_ids) == checksum(cache, ids)
    return sent, landed


def test_a_warm_channel_carries_the_next_transfer_and_a_failure_closes_it():
    layout = make_layout("float32")
    cache, alloc = make_cache(layout, 21), ShuffledFreeList(NUM_BLOCKS, 4)
    with (
        KVReceiver(layout, landing := make_cache(layout, 22), alloc, config()) as receiver,
        KVSender(layout, cache, config()) as sender,
    ):
        first, _ = _send_one(sender, receiver, cache, landing, "a")
        second, landed = _send_one(sender, receiver, cache, landing, "b")
        assert first.ok and second.ok and landed.ok
        assert "connect" in first.phases and "channel" not in first.phases  # cold: connect + handshake
        assert "channel" in second.phases and "connect" not in second.phases  # warm: the same connection
        assert set(landed.phases) == {"claim", "read", "post", "stream", "stream_cpu", "land"}
        assert landed.phases["read"] + landed.phases["post"] <= landed.phases["stream"]  # parts of it
        additive = {k: v for k, v in second.phases.items() if k != "tail"}  # tail spans stream and ack
        assert abs(sum(additive.values()) - second.seconds) < 1e-3  # the phases account for the time
        assert second.phases["ack"] <= second.phases["tail"] <= second.seconds  # finish() came with send()
        forged, failed = _send_one(sender, receiver, cache, landing, "c", forge=True)
        assert (
            forged.failure is FailureReason.UNKNOWN_HANDLE
            and failed.failure is FailureReason.RECEIVER_ABORTED
        )
        after, landed = _send_one(sender, receiver, cache, landing, "d")
        assert (
            after.ok and landed.ok and "connect" in after.phases
        )  # the failed transfer's connection was closed
        stats = sender.stats()
    assert (
        stats.transfers_ok == 3 and stats.phases["channel"].count == 1 and stats.phases["connect"].count == 2
    )


def test_an_idle_channel_is_closed_by_the_receiver_and_replaced():
    layout = make_layout("float32")
    cache, alloc = make_cache(layout, 23), ShuffledFreeList(NUM_BLOCKS, 5)
    with (
        KVReceiver(layout, landing := make_cache(layout, 24), alloc, config(idle_timeout_s=0.3)) as receiver,
        KVSender(layout, cache, config()) as sender,
    ):
        first, _ = _send_one(sender, receiver, cache, landing, "a")
        time.sleep(0.6)  # past the receiver's idle timeout: it closed the connection
        second, landed = _send_one(sender, receiver, cache, landing, "b")
    assert first.ok and second.ok and landed.ok and "connect" in second.phases


def test_an_exclusive_transport_with_one_lane_takes_turns_on_one_connection():
    """nccl's rule (one transfer at a time per pair) with transfer.nccl_lanes 1, checked through the pool with
    the tcp transport marked exclusive: a second transfer waits for the first to finish, then reuses its
    connection. (Several lanes: tests/unit/test_channel_lanes.py.)"""
    layout = make_layout("float32")
    cache, alloc = make_cache(layout, 25), ShuffledFreeList(NUM_BLOCKS, 6)
    with (
        KVReceiver(layout, make_cache(layout, 26), alloc, config()) as receiver,
        KVSender(layout, cache, config(nccl_lanes=1)) as sender,
    ):
        sender._transports["tcp"].exclusive = True  # type: ignore[attr-defined]
        first_lease, second_lease = receiver.reserve("a", 11), receiver.reserve("b", 11)
        first_ids, second_ids = [1, 2, 3], [4, 5, 6]
        first = sender.open(receiver.target(first_lease), first_ids, 11)  # holds the connection until finish
        time.sleep(0.3)
        second = sender.send(receiver.target(second_lease), second_ids, 11, FIRST)
        time.sleep(0.3)
        assert not second.done()  # waiting for its turn, not on a second connection
        first.send_layers(0, layout.num_layers)
        first.finish(FIRST)
        a, b = first.result(timeout=20), second.result(timeout=20)
        results = {r.request_id: r for r in wait_results(receiver, 2)}
    assert a.ok and b.ok and results["a"].ok and results["b"].ok
    assert "connect" in a.phases and "connect" not in b.phases and b.phases["channel"] >= 0.25
