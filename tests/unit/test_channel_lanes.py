"""kv_transfer.channels: how many control connections a sender keeps to one receiver, and on which lane.

An exclusive transport (nccl) carries one transfer per pair at a time; transfer.nccl_lanes lets a sender run
that many to one receiver at once, each on a connection of its own lane, whose pair both sides key by
(instance id, lane). nccl needs GPUs, so the pool here drives a real KVReceiver over tcp on 127.0.0.1 through
the tcp sender transport marked exclusive: the connections, hellos and lanes are real, only the bytes would
move over tcp. The receiver's side of the lane (the pair key it derives from the hello) is checked too.
"""

from __future__ import annotations

import secrets
import threading
import time

import pytest
import torch

from kv_transfer import KVReceiver, TransferConfig
from kv_transfer.channels import ChannelPool
from kv_transfer.contracts import FailureReason
from kv_transfer.frames import Watch
from kv_transfer.pairing import pair_key
from kv_transfer.tcp import TcpReceiverTransport, TcpSenderTransport
from model_runtime.kv_layout import KVLayout

pytestmark = pytest.mark.timeout(60)


class ExclusiveTcp(TcpSenderTransport):
    exclusive = True  # as nccl: one transfer per pair at a time


class Blocks:
    def __init__(self, n: int) -> None:
        self.free_ids = list(range(1, n))

    def allocate(self, n: int):
        out, self.free_ids = self.free_ids[:n], self.free_ids[n:]
        return out

    def free(self, ids) -> None:
        self.free_ids.extend(ids)


LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, num_blocks=32, dtype="float32")


@pytest.fixture
def receiver():
    cache = torch.zeros(LAYOUT.cache_shape)
    with KVReceiver(LAYOUT, cache, Blocks(32), TransferConfig(kinds=("tcp",))) as rx:
        yield rx


def make_pool(lanes: int, exclusive: bool = True) -> ChannelPool:
    config = TransferConfig(kinds=("tcp",), nccl_lanes=lanes, poll_interval_s=0.005)
    cache = torch.zeros(LAYOUT.cache_shape)
    transport = (ExclusiveTcp if exclusive else TcpSenderTransport)(LAYOUT, cache, config)
    return ChannelPool(LAYOUT, config, {"tcp": transport}, secrets.token_bytes(16), "")


def watch(seconds: float = 10.0) -> Watch:
    return Watch(time.monotonic() + seconds, FailureReason.DEADLINE_EXCEEDED, "test")


def test_lanes_bound_the_connections_to_one_receiver_and_a_freed_lane_is_taken_again(receiver) -> None:
    pool = make_pool(lanes=2)
    target = receiver.target(receiver.reserve("r", 4))
    a = pool.acquire(target, "tcp", watch(), time.monotonic())
    b = pool.acquire(target, "tcp", watch(), time.monotonic())
    assert (a.lane, b.lane) == (0, 1)
    assert a.peer_id == bytes(target.receiver_id) and b.peer_id == pair_key(bytes(target.receiver_id), 1)

    got: list = []
    third = threading.Thread(
        target=lambda: got.append(pool.acquire(target, "tcp", watch(), time.monotonic()))
    )
    third.start()
    time.sleep(0.3)
    assert not got, "a third transfer must wait while both lanes are busy"
    pool.release(b, reusable=True)
    third.join(10)
    assert got == [b], "the waiting transfer takes the idle channel of the lane that came back"

    pool.release(a, reusable=False)  # a failed transfer: its connection closes, its lane is free again
    again = pool.acquire(target, "tcp", watch(), time.monotonic())
    assert again.lane == 0 and again is not a
    pool.release(again, reusable=True)
    pool.release(b, reusable=True)
    pool.close()


def test_a_transfer_waiting_for_a_lane_keeps_its_deadline(receiver) -> None:
    pool = make_pool(lanes=1)
    target = receiver.target(receiver.reserve("r", 4))
    held = pool.acquire(target, "tcp", watch(), time.monotonic())
    started = time.monotonic()
    with pytest.raises(Exception) as failure:
        pool.acquire(target, "tcp", watch(0.3), time.monotonic())
    assert getattr(failure.value, "reason", None) is FailureReason.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 5
    pool.release(held, reusable=True)
    pool.close()


def test_a_non_exclusive_transport_opens_a_channel_per_transfer_all_on_lane_0(receiver) -> None:
    pool = make_pool(lanes=1, exclusive=False)
    target = receiver.target(receiver.reserve("r", 4))
    channels = [pool.acquire(target, "tcp", watch(), time.monotonic()) for _ in range(3)]
    assert [c.lane for c in channels] == [0, 0, 0]
    assert len({id(c.conn) for c in channels}) == 3
    for channel in channels:
        pool.release(channel, reusable=True)
    pool.close()


def test_the_receiver_keys_an_exclusive_transports_pair_by_lane() -> None:
    """The receiving side derives the same key from the hello's lane, for exclusive transports only."""
    peer = secrets.token_bytes(16)
    assert pair_key(peer, 0) == peer
    assert pair_key(peer, 1) != pair_key(peer, 2) != peer
    assert TcpReceiverTransport.exclusive is False
    from kv_transfer.nccl import NcclReceiverTransport, NcclSenderTransport

    assert NcclReceiverTransport.exclusive and NcclSenderTransport.exclusive
