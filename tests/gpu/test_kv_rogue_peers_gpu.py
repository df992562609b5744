"""KV handoff with "rogue" peers that speak the wire protocol by hand to misbehave where a real peer never would:
a receiver that takes a transfer without posting its receives (the sender's deadline must abort the communicator
and the next transfer must build a new one), a sender that stalls after the receiver posted its receive (the
lease must expire, the communicator be dropped, the blocks freed), a sender naming blocks outside its own cache;
and an NCCL init whose peer never comes must not freeze the process.
"""

from __future__ import annotations

import contextlib
import hashlib
import secrets
import socket
import threading
import time

import pytest
import torch

from kv_transfer import FailureReason, KVReceiver, KVSender
from kv_transfer.frames import FrameConnection, Watch, expect
from kv_transfer.pairing import TRANSPORT_TO_PROTO, format_message, make_hello
from kv_transfer.transport import device_uuid
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


# --- rogue peers -----------------------------------------------------------------------------------------
def _hello(fc: FrameConnection, watch: Watch, instance: bytes, kind: str, cache) -> kv_pb2.KVHello:
    fc.send_frame(make_hello(layout_of(), instance, kind, device_uuid(cache)), watch)
    return expect(fc.read_frame(watch), "hello", FailureReason.PROTOCOL_ERROR).hello


def _begin(kind: str, target) -> kv_pb2.KVFrame:
    n = target.num_blocks
    begin = kv_pb2.KVBegin(
        handle=target.handle,
        request_id=target.request_id,
        num_blocks=n,
        num_tokens=target.num_tokens,
        num_bytes=layout_of().bytes_per_block * n,
    )
    if kind == "cuda_ipc":
        begin.src_block_ids.extend(
            [NUM_BLOCKS - 1] * (n - 1) + [NUM_BLOCKS]
        )  # the last id is outside the cache
    return kv_pb2.KVFrame(begin=begin)


def _rogue_sender(conn, kind: str, device: str) -> None:
    """Claims the lease, sets the pair up, announces a part, then never delivers it."""
    from kv_transfer.cuda_ipc import IpcSenderTransport
    from kv_transfer.nccl import SENDER_RANK, _nccl, _uid_bytes, init_comm

    torch.cuda.set_device(device)
    cache, instance = make_cache(7, device), secrets.token_bytes(16)
    conn.send("ready")  # started: the parent's short lease only begins now
    target = kv_pb2.KVTarget.FromString(bytes.fromhex(conn.recv()))
    fc = FrameConnection(socket.create_connection((target.host, target.port)), 0.01)
    watch = Watch(time.monotonic() + 60, FailureReason.DEADLINE_EXCEEDED, "rogue")
    _hello(fc, watch, instance, kind, cache)
    if kind == "nccl":
        uid = _uid_bytes(_nccl().get_unique_id())
        fc.send_frame(
            kv_pb2.KVFrame(pair_setup=kv_pb2.KVPairSetup(nccl=kv_pb2.KVNcclSetup(unique_id=uid))), watch
        )
        expect(fc.read_frame(watch), "pair_setup_ack", FailureReason.PROTOCOL_ERROR)
        _comm = init_comm(uid, SENDER_RANK, torch.device(device), 60)  # kept alive, never used
    else:
        IpcSenderTransport(layout_of(), cache, config(kind)).ensure_pair(b"", False, fc, watch, 0.0)
    fc.send_frame(_begin(kind, target), watch)
    n = target.num_blocks
    part = kv_pb2.KVPart(layer_begin=0, layer_end=4, num_bytes=layout_of().bytes_per_block * n)
    fc.send_frame(kv_pb2.KVFrame(part=part), watch)
    last = fc.read_frame(watch)  # nccl: the receiver's verdict once its lease runs out; cuda_ipc: the refusal
    frames = [f"{last.WhichOneof('body')}:{last.abort.reason or last.error.code}"]
    if kind == "nccl":
        fc.close()
        fc = FrameConnection(socket.create_connection((target.host, target.port)), 0.01)
        frames.append(f"pair_ready={_hello(fc, watch, instance, kind, cache).pair_ready}")
    conn.send(frames)
    conn.recv()


@pytest.mark.parametrize("kind", KINDS)
def test_rogue_sender_is_contained(kind):
    """nccl: a sender stalling after the receive was posted; cuda_ipc: a sender naming blocks outside its cache.
    Nothing outside the lease is written, and nothing at all once its blocks are free (the aborted nccl receive
    may leave garbage in the lease's own blocks before they are freed: they are free blocks then)."""
    cache, alloc = make_cache(99, devices(kind)[0]), FreeList(3)
    conn, proc = spawn(_rogue_sender, kind, devices(kind)[1])
    with KVReceiver(layout_of(), cache, alloc, config(kind, lease_ttl_s=6.0)) as receiver:
        try:
            assert conn.poll(90) and conn.recv() == "ready"
            lease = receiver.reserve("rogue", 112)
            others = sorted(set(range(1, NUM_BLOCKS)) - set(lease.block_ids))
            before = checksum(cache, others)
            conn.send(receiver.target(lease).SerializeToString().hex())
            assert conn.poll(90)
            frames = conn.recv()
            (result,) = wait_results(receiver)
        finally:
            proc.kill()
        assert checksum(cache, others) == before and alloc.all_free
        cache[:, :, list(lease.block_ids)] = 3.0  # the blocks' next owner writes them
        torch.cuda.synchronize()
        time.sleep(0.3)
        assert bool((cache[:, :, list(lease.block_ids)] == 3.0).all()), "a write landed after the free"
    if kind == "nccl":
        expired = FailureReason.LEASE_EXPIRED.value
        assert frames == [f"abort:{expired}", "pair_ready=False"], frames
        assert result.failure is FailureReason.LEASE_EXPIRED
    else:
        mismatch = FailureReason.DESCRIPTOR_MISMATCH.value
        assert frames == [f"error:{mismatch}"] and result.failure is FailureReason.DESCRIPTOR_MISMATCH


def _rogue_nccl_receiver(conn, device: str) -> None:
    """Round 1 takes a transfer without posting its receives; round 2 behaves. Reports pair setups seen."""
    from kv_transfer.nccl import RECEIVER_RANK, _nccl, init_comm
    from kv_transfer.slicing import slices

    torch.cuda.set_device(device)
    cache, instance, layout = make_cache(5, device), secrets.token_bytes(16), layout_of()
    server = socket.create_server(("127.0.0.1", 0))
    target = kv_pb2.KVTarget(
        host="127.0.0.1",
        port=server.getsockname()[1],
        handle=secrets.token_bytes(16),
        request_id="r",
        layout_fingerprint=layout.fingerprint(),
        format=format_message(layout),
        num_blocks=7,
        num_tokens=112,
        transport=TRANSPORT_TO_PROTO["nccl"],
        receiver_id=instance,
    )
    conn.send(target.SerializeToString().hex())
    setups, comm = 0, None
    for round_ in (1, 2):
        fc = FrameConnection(server.accept()[0], 0.01)
        watch = Watch(time.monotonic() + 60, FailureReason.DEADLINE_EXCEEDED, "rogue")
        fc.read_frame(watch)  # hello
        fc.send_frame(
            make_hello(layout, instance, "nccl", device_uuid(cache), pair_ready=comm is not None), watch
        )
        received = []
        while (frame := fc.read_frame(watch)).WhichOneof("body") != "done":
            if frame.HasField("pair_setup"):
                setups += 1
                fc.send_frame(kv_pb2.KVFrame(pair_setup_ack=kv_pb2.KVPairSetupAck()), watch)
                if comm is not None:
                    comm.abort()  # its peer aborted: destroy() could wait on it
                comm = init_comm(
                    bytes(frame.pair_setup.nccl.unique_id), RECEIVER_RANK, torch.device(device), 60
                )
            elif frame.HasField("part") and round_ == 2:
                for piece in slices(layout, frame.part.layer_begin, frame.part.layer_end, 7):
                    staging = torch.empty(piece.num_bytes(layout), dtype=torch.uint8, device=device)
                    stream = torch.cuda.current_stream().cuda_stream
                    comm.recv(staging.data_ptr(), staging.numel(), _nccl().NCCL_UINT8, 0, stream)
                    received.append(staging)
        if round_ == 1:
            with contextlib.suppress(Exception):  # the sender gives up at its deadline (abort or close)
                fc.read_frame(watch)
        else:
            torch.cuda.synchronize()
            fc.send_frame(kv_pb2.KVFrame(ack=kv_pb2.KVAck()), watch)
            digest = hashlib.sha256(torch.cat(received).cpu().numpy().tobytes()).hexdigest()
            conn.send((setups, digest))
        fc.close()
    conn.recv()


@NCCL_ONLY
def test_sender_deadline_aborts_the_communicator_and_the_next_transfer_rebuilds_it():
    conn, proc = spawn(_rogue_nccl_receiver, "cuda:1")
    try:
        assert conn.poll(60)
        target = kv_pb2.KVTarget.FromString(bytes.fromhex(conn.recv()))
        cache, ids = make_cache(7, "cuda:0"), [9, 3, 20, 21, 22, 40, 2]
        with KVSender(layout_of(), cache, config("nccl")) as sender:
            start = time.monotonic()
            first = sender.send(target, ids, 112, FIRST, timeout_s=8.0).result(timeout=30)
            assert first.failure is FailureReason.DEADLINE_EXCEEDED and time.monotonic() - start < 15, first
            second = sender.send(target, ids, 112, FIRST, timeout_s=30.0).result(timeout=60)
        assert second.ok, second
        assert conn.poll(30)
        setups, digest = conn.recv()
        assert setups == 2  # the aborted communicator was replaced
        assert (
            digest
            == hashlib.sha256(
                cache[:, :, ids].contiguous().cpu().view(torch.uint8).numpy().tobytes()
            ).hexdigest()
        )
    finally:
        proc.kill()


def _blocked_init(conn, device: str) -> None:
    """Start an NCCL init whose peer never comes; count how often the main thread runs meanwhile."""
    from kv_transfer.nccl import _nccl, _uid_bytes, init_comm

    torch.cuda.set_device(device)
    uid = _uid_bytes(_nccl().get_unique_id())
    threading.Thread(target=init_comm, args=(uid, 0, torch.device(device), 600.0), daemon=True).start()
    ticks, end = 0, time.monotonic() + 2.0
    while time.monotonic() < end:
        ticks += 1
        time.sleep(0.001)
    conn.send(ticks)
    conn.recv()


@NCCL_ONLY
def test_a_blocked_nccl_init_leaves_other_threads_running():
    """init_comm's timeout (and every other transfer of the process) relies on CuPy releasing the GIL while
    ncclCommInitRank waits for its peer."""
    conn, proc = spawn(_blocked_init, "cuda:0")
    try:
        assert conn.poll(60), "the process froze while an NCCL init waited for its peer: the GIL is held"
        assert conn.recv() > 500
    finally:
        proc.kill()
