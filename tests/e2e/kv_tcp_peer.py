"""The peer side of the two-process tcp KV handoff tests (test_kv_transfer_tcp.py): the layout and cache both
sides build from a seed, a scattered thread-safe block pool, and the spawned child processes (a sender driven
by plain commands over a pipe, a receiver that parks until it is killed). Child targets live here so that a
spawned interpreter imports them without the test module."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import random
import threading
import time

import torch

from kv_transfer import FirstToken, KVReceiver, KVSender, TransferConfig
from model_runtime.kv_layout import KVLayout
from tandem_api.tandem.v1 import kv_pb2

NUM_BLOCKS = 40
CHUNK = 512
FIRST = FirstToken(7, -0.25, ((7, -0.25), (3, -1.5)))


def make_layout(dtype: str, kv_heads: int = 2) -> KVLayout:
    return KVLayout(
        num_layers=4,
        num_kv_heads=kv_heads,
        head_dim=8,
        block_size=4,
        num_blocks=NUM_BLOCKS,
        dtype=dtype,
    )


def make_cache(layout: KVLayout, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(layout.cache_shape, generator=gen).to(getattr(torch, layout.dtype))


def checksum(cache: torch.Tensor, ids) -> str:
    gathered = cache[:, :, list(ids)].contiguous()
    return hashlib.sha256(gathered.view(torch.uint8).numpy().tobytes()).hexdigest()


def config(**kw) -> TransferConfig:
    base = dict(
        chunk_bytes=CHUNK,
        poll_interval_s=0.01,
        connect_timeout_s=3.0,
        transfer_timeout_s=20.0,
        lease_ttl_s=20.0,
    )
    return TransferConfig(**{**base, **kw})


class ShuffledFreeList:
    """A thread-safe block pool handing out scattered ids; it refuses double frees."""

    def __init__(self, num_blocks: int, seed: int) -> None:
        self.free_ids = list(range(1, num_blocks))
        random.Random(seed).shuffle(self.free_ids)
        self.total = len(self.free_ids)
        self.lock = threading.Lock()

    def allocate(self, n: int) -> list[int] | None:
        with self.lock:
            if len(self.free_ids) < n:
                return None
            out, self.free_ids = self.free_ids[:n], self.free_ids[n:]
            return out

    def free(self, ids) -> None:
        with self.lock:
            if set(ids) & set(self.free_ids):
                raise AssertionError(f"double free of {ids}")
            self.free_ids.extend(ids)

    @property
    def all_free(self) -> bool:
        return len(self.free_ids) == self.total


# --- the child: a sender peer driven by plain commands ----------------------------------------------------
def _sender_peer(conn) -> None:
    lock = threading.Lock()

    def event(name: str) -> None:
        with lock:
            conn.send(("event", name))

    while True:
        cmd = conn.recv()
        if cmd["op"] == "exit":
            return
        result = _peer_send(cmd, event, conn)
        with lock:
            conn.send(("result", result))


def _peer_send(cmd: dict, event, conn) -> dict:
    layout = make_layout(cmd["dtype"], cmd.get("kv_heads", 2))
    cache = make_cache(layout, cmd["seed"])
    ids = [int(x) for x in cmd["ids"].split(",")]
    mode, pace = cmd["mode"], cmd.get("pace_ms", 0) / 1000
    total = layout.bytes_per_block * len(ids)
    box, data_sent, released = [], threading.Event(), []

    def hook(_request_id: str, sent: int) -> None:
        if sent == CHUNK:
            event("streaming")
        if mode == "abort_mid" and sent >= 3 * CHUNK and box:
            box[0].abort("test: abort mid-stream")
        if sent == total:
            data_sent.set()
        time.sleep(pace)

    target = kv_pb2.KVTarget.FromString(bytes.fromhex(cmd["target"]))
    with KVSender(layout, cache, config(), on_release=released.append, chunk_hook=hook) as sender:
        n_tokens, timeout = cmd["num_tokens"], cmd.get("timeout_s", 20.0)
        if mode in ("all", "abort_mid"):
            handle = sender.send(target, ids, n_tokens, FIRST, timeout)
            box.append(handle)
        else:
            handle = sender.open(target, ids, n_tokens, timeout)
            box.append(handle)
            _drive_layers(mode, handle, layout, data_sent, event, conn)
        result = handle.result(timeout=30)
    return dict(
        ok=result.ok,
        failure=result.failure.name if result.failure else "",
        message=result.message,
        released=len(released),
        released_ids=",".join(map(str, released[0].src_block_ids)) if released else "",
        checksum=checksum(cache, ids),
    )


def _drive_layers(mode: str, handle, layout: KVLayout, data_sent, event, conn) -> None:
    layers = layout.num_layers
    if mode == "groups":
        for begin, end in ((0, 1), (1, 3), (3, layers)):
            handle.send_layers(begin, end)
        handle.finish(FIRST)
    elif mode == "abort_before_data":
        time.sleep(0.5)  # connect + claim take milliseconds on loopback
        handle.abort("test: abort before data")
    elif mode == "abort_after_data":
        handle.send_layers(0, layers)
        data_sent.wait(10)
        time.sleep(0.2)
        handle.abort("test: abort after data")
    elif mode == "wait_go":
        handle.send_layers(0, layers)
        data_sent.wait(10)
        event("data_sent")
        assert conn.recv() == ("go",)
        handle.finish(FIRST)


class Peer:
    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_sender_peer, args=(child,), daemon=True)
        self.proc.start()

    def start(self, **cmd) -> None:
        self.conn.send({"op": "send", **cmd})

    def next(self, timeout: float = 30.0):
        assert self.conn.poll(timeout), "peer process went silent"
        return self.conn.recv()

    def wait_event(self, name: str) -> None:
        while True:
            kind, value = self.next()
            assert kind == "event", f"peer finished before {name}: {value}"
            if value == name:
                return

    def result(self) -> dict:
        while True:
            kind, value = self.next()
            if kind == "result":
                return value

    def run(self, **cmd) -> dict:
        self.start(**cmd)
        return self.result()


def wait_results(receiver: KVReceiver, n: int = 1, timeout: float = 15.0):
    end, out = time.monotonic() + timeout, []
    while len(out) < n and time.monotonic() < end:
        out += receiver.poll()
        time.sleep(0.01)
    assert len(out) == n, f"expected {n} results, got {out}"
    return out


def send_cmd(receiver: KVReceiver, lease, dtype: str, mode: str, **kw) -> dict:
    n = len(lease.block_ids)
    src_ids = random.Random(n).sample(range(1, NUM_BLOCKS), n)
    return dict(
        target=receiver.target(lease).SerializeToString().hex(),
        ids=",".join(map(str, src_ids)),
        num_tokens=lease.num_tokens,
        dtype=dtype,
        seed=11,
        mode=mode,
        **kw,
    )


def receiver_peer(conn, dtype: str, num_tokens: int) -> None:
    layout = make_layout(dtype)
    receiver = KVReceiver(layout, make_cache(layout, 5), ShuffledFreeList(NUM_BLOCKS, 7), config())
    lease = receiver.reserve("req", num_tokens)
    conn.send(receiver.target(lease).SerializeToString().hex())
    conn.recv()  # park until killed
