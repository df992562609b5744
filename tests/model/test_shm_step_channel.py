"""The shared-memory ring (model_runtime.parallel.shm_channel) that carries the lead's messages to the other
ranks, alone between processes and under step_sync, where it must deliver what the host group's broadcasts do.

Every ring here is written by one process and read by others: the file, the counters and the polling are
shared only through the mapping, as between an engine's ranks."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch.multiprocessing as mp

from model_runtime.host_batch import HostBatch
from model_runtime.parallel.group import TPGroup
from model_runtime.parallel.shm_channel import SLOT_BYTES, ShmReader, ShmWriter
from model_runtime.parallel.step_sync import StepPublisher, StepReceiver, encode
from tests.model import tp_ranks

pytestmark = pytest.mark.model

CAPACITY = 4096  # the ring tests' slot: small, so that messages at and past it are cheap
WIDE_TABLE = 300_000  # block-table columns that make a step's payload larger than a real slot


def ring_messages(seed: int, count: int) -> list[bytes]:
    """Messages of every size from empty to exactly CAPACITY, with bytes of every value."""
    rng = random.Random(seed)
    sizes = [0, 1, CAPACITY, 8] + [rng.randrange(CAPACITY + 1) for _ in range(count - 5)] + [CAPACITY]
    return [rng.randbytes(size) for size in sizes]


def read_ring(path: str, reader: int, count: int, slow_for: int, queue: Any) -> None:
    """A reader process: attach, say so, then read `count` messages (the first `slow_for` of them slowly, so
    that the writer laps the ring and must wait for it) and send them back."""
    ring = ShmReader.attach(path, reader)
    queue.put(("attached", reader, os.getpid()))
    got = []
    for i in range(count):
        if i < slow_for:
            time.sleep(0.003)
        got.append(bytes(ring.receive()))
    ring.close()
    queue.put(("read", reader, got))


def write_then_wait(queue: Any, go: Any) -> None:
    """A writer process: make a ring for one reader, send one message once told, then wait to be killed."""
    ring = ShmWriter.create(1, num_slots=2, slot_bytes=CAPACITY)
    queue.put(ring.path)
    go.wait()
    ring.unlink()
    ring.send(b"first")
    time.sleep(600)


def attach_and_idle(path: str, queue: Any) -> None:
    """A reader process that attaches and never reads, until it is killed."""
    ShmReader.attach(path, 0)
    queue.put(os.getpid())
    time.sleep(600)


def context() -> Any:
    return mp.get_context("forkserver")


def raised_within(fn: Any, timeout_s: float) -> BaseException | None:
    """What fn() raised (None if it returned), run on a thread; fails the test if it still runs after timeout_s.
    The ring fn waits on stays mapped then: the caller closes it only after this returned."""
    raised: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as err:  # handed to the test, which asserts on it
            raised.append(err)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        pytest.fail(f"still waiting after {timeout_s} s: a dead peer must raise, not hang")
    return raised[0] if raised else None


def test_ring_delivers_every_message_once_in_order_to_every_reader_across_wrap_around() -> None:
    messages = ring_messages(seed=1, count=60)
    writer = ShmWriter.create(2, num_slots=4, slot_bytes=CAPACITY)
    ctx = context()
    queue = ctx.Queue()
    # Reader 1 is slow for its first 20 messages: the writer, 4 slots ahead at most, laps the ring and waits.
    readers = [
        ctx.Process(target=read_ring, args=(writer.path, r, len(messages), 20 * r, queue), daemon=True)
        for r in range(2)
    ]
    try:
        for proc in readers:
            proc.start()
        attached = {queue.get(timeout=60)[1] for _ in readers}
        assert attached == {0, 1}
        writer.unlink()
        assert not os.path.exists(writer.path), "the ring's file must be gone once every reader attached"
        for i, message in enumerate(messages):
            if i == 30:
                with pytest.raises(ValueError, match=f"{CAPACITY + 1} bytes"):
                    writer.send(b"x" * (CAPACITY + 1))  # refused whole: no sequence number is used up
            writer.send(message[:5], memoryview(message)[5:])  # parts are concatenated
        got = dict(queue.get(timeout=60)[1:] for _ in readers)
    finally:
        writer.close()
        for proc in readers:
            proc.join(timeout=10)
            proc.kill()
    for reader in (0, 1):
        assert len(got[reader]) == len(messages)
        for i, (received, sent) in enumerate(zip(got[reader], messages)):
            assert received == sent, f"reader {reader}, message {i}: {len(received)} bytes, sent {len(sent)}"


def test_a_reader_whose_writer_died_raises_naming_the_writers_pid() -> None:
    ctx = context()
    queue, go = ctx.Queue(), ctx.Event()
    writer = ctx.Process(target=write_then_wait, args=(queue, go), daemon=True)
    writer.start()
    path = queue.get(timeout=60)
    try:
        reader = ShmReader.attach(path, 0)
    finally:
        go.set()  # the writer unlinks the file whether or not the reader attached
    assert reader.writer_pid == writer.pid
    assert bytes(reader.receive()) == b"first"
    writer.kill()
    writer.join(timeout=10)
    err = raised_within(reader.receive, timeout_s=10)
    reader.close()
    assert isinstance(err, RuntimeError) and f"pid {writer.pid}" in str(err), err


def test_a_writer_whose_reader_died_raises_naming_the_readers_pid() -> None:
    writer = ShmWriter.create(1, num_slots=2, slot_bytes=CAPACITY)
    ctx = context()
    queue = ctx.Queue()
    reader = ctx.Process(target=attach_and_idle, args=(writer.path, queue), daemon=True)
    reader.start()
    try:
        pid = queue.get(timeout=60)
    finally:
        writer.unlink()
    writer.send(b"one")
    writer.send(b"two")  # both slots now hold a message the reader has not read
    reader.kill()
    reader.join(timeout=10)
    err = raised_within(lambda: writer.send(b"three"), timeout_s=10)
    writer.close()
    assert isinstance(err, RuntimeError) and f"reader 0 (pid {pid})" in str(err), err


# --- step_sync over real ranks ----------------------------------------------------------------------------
def fingerprint(batch: HostBatch) -> tuple:
    """Every field of a step, exactly (arrays by dtype, shape and a digest of their bytes)."""
    fields = []
    for field in dataclasses.fields(batch):
        value = getattr(batch, field.name)
        if isinstance(value, np.ndarray):
            value = (str(value.dtype), value.shape, hashlib.sha256(np.ascontiguousarray(value)).hexdigest())
        fields.append((field.name, value))
    return tuple(fields)


def lockstep_script() -> list[HostBatch]:
    """Steps in a fixed order, one of them too large for a ring slot (its payload goes on gloo)."""
    prefill, decode = tp_ranks.prefill_then_decode([[5, 9, 14], [11, 4]])
    wide = dataclasses.replace(prefill, block_tables=np.pad(prefill.block_tables, ((0, 0), (0, WIDE_TABLE))))
    return [prefill, wide, decode, prefill, decode]


def lockstep(group: TPGroup, batches: list[HostBatch]) -> Any:
    """The same steps over shared memory and then over gloo alone, then STOP. Per transport, the lead returns
    whether it was on shared memory; a follower returns that and the fingerprints of the steps it got, in order."""
    results = []
    for shared_memory in (True, False):
        if group.is_lead:
            publisher = StepPublisher(group, shared_memory=shared_memory)
            for batch in batches:
                publisher.publish(batch)
            publisher.stop()
            results.append((publisher.on_shared_memory, publisher.published))
        else:
            receiver = StepReceiver(group, shared_memory=shared_memory)
            got = []
            while (step := receiver.receive()) is not None:
                got.append(fingerprint(step))
            results.append((receiver.on_shared_memory, got))
    return results


@pytest.mark.parametrize("tp", [2, 3])
def test_step_sync_over_shared_memory_delivers_what_gloo_does(tp: int) -> None:
    batches = lockstep_script()
    assert encode(batches[1])[1].nbytes > SLOT_BYTES, "the wide step must overflow a ring slot"
    lead, *followers = tp_ranks.run_ranks(lockstep, tp, batches, timeout_s=120)
    expected = [fingerprint(batch) for batch in batches]
    assert lead == [(True, len(batches)), (False, len(batches))], (
        "the ring first, then gloo alone; all published"
    )
    for rank, ((on_shm, got_shm), (on_gloo, got_gloo)) in enumerate(followers, start=1):
        assert (on_shm, on_gloo) == (True, False), f"rank {rank}'s transports"
        assert got_shm == expected, f"rank {rank} got other steps over shared memory"
        assert got_gloo == expected, f"rank {rank} got other steps over gloo"
