"""cuda_ipc leases armed behind a doorbell (kv_transfer.doorbell), between two processes: the parent receives
and arms, a spawned child runs a real KVSender. Bytes identical whether the sender rings all layers at once or
group by group; a lease armed for another sender lands through its frames; an armed lease that ends before any
sender claimed it gives back every block, and its slot rests before it is armed again.
"""

from __future__ import annotations

import random
import secrets

import pytest

from kv_transfer import FailureReason, KVReceiver, KVSender
from tandem_api.tandem.v1 import kv_pb2
from tests.gpu.kv_gpu_support import (
    FIRST,
    MARKS,
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


def _sender(conn, device: str) -> None:
    cache = make_cache(7, device)
    with KVSender(layout_of(), cache, config("cuda_ipc")) as sender:
        conn.send(sender.instance_id)
        while (cmd := conn.recv()) is not None:
            target = kv_pb2.KVTarget.FromString(cmd["target"])
            ids = cmd["ids"]
            if cmd["mode"] == "all":
                handle = sender.send(target, ids, cmd["num_tokens"], FIRST)
            else:  # layer groups, as a prefill worker streams them
                handle = sender.open(target, ids, cmd["num_tokens"])
                for begin, end in ((0, 1), (1, 3), (3, 4)):
                    handle.send_layers(begin, end)
                handle.finish(FIRST)
            result = handle.result(timeout=60)
            conn.send(dict(ok=result.ok, failure=str(result.failure), checksum=checksum(cache, ids)))


@pytest.fixture(scope="module")
def peer():
    conn, proc = spawn(_sender, devices("cuda_ipc")[1])
    assert conn.poll(60), "the sender process did not start"
    sender_id = conn.recv()
    yield conn, sender_id
    conn.send(None)
    proc.join(30)
    proc.kill()


def _send(conn, receiver: KVReceiver, lease, mode: str, target: kv_pb2.KVTarget | None = None) -> dict:
    ids = random.Random(len(lease.block_ids)).sample(range(1, NUM_BLOCKS), len(lease.block_ids))
    target = target or receiver.target(lease)
    conn.send(dict(target=target.SerializeToString(), ids=ids, num_tokens=lease.num_tokens, mode=mode))
    assert conn.poll(90), "the sender went silent"
    return conn.recv()


def _lands(conn, receiver: KVReceiver, cache, alloc, lease, mode: str, armed: bool, target=None):
    """Sends `lease`'s blocks and waits for its result: it landed, armed or not as `armed` says, with the
    sender's bytes in the lease's blocks, which then go back to `alloc`. Returns the result."""
    sent = _send(conn, receiver, lease, mode, target)
    (result,) = wait_results(receiver)
    assert sent["ok"] and result.ok and bool(result.armed) == armed, (sent, result)
    assert checksum(cache, lease.block_ids) == sent["checksum"]
    alloc.free(lease.block_ids)
    return result


def test_armed_leases_land_intact_and_unarmed_ones_still_do(peer):
    conn, sender_id = peer
    cache, alloc = make_cache(99, devices("cuda_ipc")[0]), FreeList(3)
    with KVReceiver(layout_of(), cache, alloc, config("cuda_ipc")) as receiver:
        # A first transfer sets the pair (and its doorbell page) up: its lease could not be armed.
        lease = receiver.reserve("cold", 32, sender=sender_id)
        assert not receiver.target(lease).HasField("armed")
        assert _send(conn, receiver, lease, "all")["ok"]
        (result,) = wait_results(receiver)
        assert result.ok and not result.armed
        alloc.free(lease.block_ids)

        for i, (tokens, mode) in enumerate([(16, "all"), (112, "all"), (100, "groups"), (64, "groups")]):
            lease = receiver.reserve(f"armed-{i}", tokens, sender=sender_id)
            target = receiver.target(lease)
            assert target.HasField("armed") and target.armed.sender_id == sender_id
            assert _lands(conn, receiver, cache, alloc, lease, mode, armed=True).first_token == FIRST

        # No pair with that sender: not armed at all.
        lease = receiver.reserve("unknown", 48, sender=secrets.token_bytes(16))
        assert not receiver.target(lease).HasField("armed")
        assert _send(conn, receiver, lease, "all")["ok"]
        (result,) = wait_results(receiver)
        assert result.ok and not result.armed
        alloc.free(lease.block_ids)

        # Armed, but the target reaches a sender it does not name: that one ignores the slot, and the receiver
        # ends the chain and copies from the frames.
        lease = receiver.reserve("other", 48, sender=sender_id)
        target = receiver.target(lease)
        target.armed.sender_id = secrets.token_bytes(16)
        _lands(conn, receiver, cache, alloc, lease, "groups", armed=False, target=target)
        # The sender the lease was armed for left the slot unused (as one that cannot open the page would):
        # nothing more is armed for it, so its transfers are not copied twice.
        lease = receiver.reserve("after-unused", 16, sender=sender_id)
        assert not receiver.target(lease).HasField("armed")
        _lands(conn, receiver, cache, alloc, lease, "all", armed=False)
        assert alloc.all_free


def test_an_armed_lease_that_ends_unclaimed_frees_its_blocks_and_its_slot_rests(peer):
    conn, sender_id = peer
    cache, alloc = make_cache(5, devices("cuda_ipc")[0]), FreeList(4)
    with KVReceiver(layout_of(), cache, alloc, config("cuda_ipc", doorbell_slots=1)) as receiver:
        lease = receiver.reserve("warm", 16, sender=sender_id)
        assert _send(conn, receiver, lease, "all")["ok"]
        wait_results(receiver)
        alloc.free(lease.block_ids)

        before = cache.clone()
        lease = receiver.reserve("dropped", 80, sender=sender_id)
        assert receiver.target(lease).HasField("armed")
        assert receiver.abort("dropped")
        (result,) = wait_results(receiver)
        assert not result.ok and result.failure is FailureReason.RECEIVER_ABORTED
        assert alloc.all_free  # given back only after the released chain ended
        # The released chain copied the sender's padding block into the dropped lease's blocks, nowhere else.
        others = [b for b in range(NUM_BLOCKS) if b not in lease.block_ids and b != 0]
        assert checksum(cache, others) == checksum(before, others)

        # Its slot rests in quarantine (its sender might still write into it): the next lease goes unarmed.
        lease = receiver.reserve("after", 48, sender=sender_id)
        assert not receiver.target(lease).HasField("armed")
        _lands(conn, receiver, cache, alloc, lease, "groups", armed=False)
