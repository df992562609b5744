"""A one-writer, many-reader message ring in shared memory: the lead rank's messages to the ranks of its node.

A gloo broadcast over loopback TCP takes 100-250 us one way; a follower rank that learns of a decode step that
late launches it late, and the lead's GPU waits for it at the step's first all-reduce. Every rank of an engine
runs on one node, so the lead writes each message once into a file in /dev/shm that every rank maps, and each
follower polls for it there: a message crosses in a few microseconds.

    writer = ShmWriter.create(num_readers)     the lead: a new file, named at random
    reader = ShmReader.attach(writer.path, r)  reader r (0 <= r < num_readers), once the writer made it
    writer.unlink()                            once every reader attached: nothing is left if a process dies
    writer.send(part, ...)  /  reader.receive() -> bytearray
    close()                                    on both, safe twice

The file (every int64 field aligned, so that each is written by one 8-byte store):

    header   word 0 magic, 1 version, 2 slots K, 3 slot bytes C, 4 writer pid, 5 readers N
             reader r at byte 64 * (1 + r), a cache line of its own:  consumed up to (int64) | pid (int64)
    slot s   at header_bytes + s * slot_stride:  sequence number (int64) | length (int64) | payload [C]

Message n (n = 1, 2, ...) goes to slot (n - 1) % K. The writer waits until every reader has consumed message
n - K (the slot's last), then writes payload and length, and the sequence number n last: that store publishes
the message. A reader waits for its next slot's sequence number to be n, copies the payload out and only then
raises its consumed counter, which frees the slot. Neither side takes a lock; the only shared stores are the
writer's (the slots) and each reader's own counter.

Waiting spins while messages flow and sleeps once they stop (SPIN_S, BACKOFF_*). A side that waits long checks
that its peer process still exists, so a dead lead or follower is an error instead of a hang.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import time
import uuid
from collections.abc import Callable

import numpy as np

MAGIC = 0x54414E44454D5348  # "TANDEMSH"
VERSION = 1
NUM_SLOTS = 8  # how far the lead may run ahead of its slowest follower before it waits
# A decode step of 256 sequences with 2,048-token block tables (256 x 128 ids) or a prefill step of 8,192 tokens
# is 0.2-0.3 MiB; larger payloads (long contexts' block tables) take the gloo path. 8 MiB of /dev/shm an
# engine: a container's default /dev/shm is 64 MiB.
SLOT_BYTES = 1 << 20

# Waiting. While steps flow (one every 5-50 ms) a reader must see each within tens of microseconds, which only
# polling gives; so it polls for SPIN_S after its last message, yielding the core between polls (sched_yield:
# time.sleep(0) is no yield on Linux but a real sleep, 50-70 us of timer slack, as long as the gloo broadcast
# this replaces). SPIN_S is longer than the slowest step, so a steady stream never leaves the polling phase.
# Past it the engine is idle (for seconds or days) and polling would burn a core all that time: the reader
# sleeps instead, from BACKOFF_FIRST_S doubling up to BACKOFF_MAX_S, so a step after a pause is <= ~1 ms late.
SPIN_S = 0.1
BACKOFF_FIRST_S = 50e-6
BACKOFF_MAX_S = 1e-3
LIVENESS_S = 1.0  # a side that waited this long checks that its peer process exists, then again as often

_WORDS = 6  # header words before the readers' lines
_LINE = 64  # bytes: one cache line per reader's counter, so readers do not contend for one line
_SLOT_HEAD = 16  # bytes: sequence number, length


class ReaderExited(RuntimeError):
    """The writer waited for a reader to free a slot, and that reader's process is gone."""

    def __init__(self, reader: int, pid: int) -> None:
        super().__init__(f"ShmWriter: reader {reader} (pid {pid}) exited without reading its messages")
        self.reader = reader
        self.pid = pid


class _Mapping:
    """The file mapped, and int64 views of its header, its readers' lines and its slots' heads."""

    def __init__(self, fd: int, size: int) -> None:
        # np.frombuffer views hold the map's buffer: mmap refuses to close under a live view, where a view
        # made otherwise (np.ndarray(buffer=...)) would be left pointing at unmapped memory.
        self.map = mmap.mmap(fd, size)
        self.words = np.frombuffer(self.map, dtype=np.int64, count=_WORDS)
        num_readers, num_slots, slot_bytes = int(self.words[5]), int(self.words[2]), int(self.words[3])
        lines = np.frombuffer(self.map, dtype=np.int64, count=num_readers * _LINE // 8, offset=_LINE)
        self.consumed = lines[0 :: _LINE // 8]  # word 0 of each reader's line
        self.pids = lines[1 :: _LINE // 8]  # word 1
        self.slot_bytes = slot_bytes
        self.stride = _slot_stride(slot_bytes)
        self.first_slot = _header_bytes(num_readers)
        self.slots = [  # [sequence number, length] of each slot
            np.frombuffer(self.map, dtype=np.int64, count=2, offset=self.first_slot + s * self.stride)
            for s in range(num_slots)
        ]
        self.bytes = np.frombuffer(self.map, dtype=np.uint8)

    def sequence(self, slot: int) -> int:
        """The number of the last message published in `slot` (0: none yet)."""
        return int(self.slots[slot][0])

    def payload_at(self, slot: int) -> int:
        return self.first_slot + slot * self.stride + _SLOT_HEAD

    def close(self) -> None:
        del self.words, self.consumed, self.pids, self.slots, self.bytes  # else the map cannot close
        self.map.close()


class ShmWriter:
    """The writer's side of a ring: `send` copies one message in, waiting while its slot is still being read."""

    def __init__(self, path: str, mapping: _Mapping, num_readers: int) -> None:
        self.path = path
        self._m: _Mapping | None = mapping
        self._num_readers = num_readers
        self._sent = 0
        self._linked = True

    @classmethod
    def create(cls, num_readers: int, num_slots: int = NUM_SLOTS, slot_bytes: int = SLOT_BYTES) -> ShmWriter:
        """A new ring file for `num_readers` readers. Raises OSError when it cannot be made (no room in the
        directory: the space is reserved here, so a full /dev/shm fails now and not at a later write)."""
        if num_readers < 1 or num_slots < 1 or slot_bytes < 1:
            raise ValueError(
                f"ShmWriter: readers {num_readers}, slots {num_slots}, slot bytes {slot_bytes}: each must be >= 1"
            )
        size = _header_bytes(num_readers) + num_slots * _slot_stride(slot_bytes)
        directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        path = os.path.join(directory, f"tandem-ring-{uuid.uuid4().hex}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, size)
            else:
                os.ftruncate(fd, size)
            header = np.array([0, VERSION, num_slots, slot_bytes, os.getpid(), num_readers], dtype=np.int64)
            os.pwrite(fd, header.tobytes(), 0)
            mapping = _Mapping(fd, size)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)  # the mapping keeps the file open
        mapping.words[0] = MAGIC  # last: a reader that sees the magic sees the rest of the header
        return cls(path, mapping, num_readers)

    @property
    def slot_bytes(self) -> int:
        """The largest message `send` takes."""
        return self._mapping().slot_bytes

    def send(self, *parts: bytes | bytearray | memoryview | np.ndarray) -> None:
        """Publish the concatenation of `parts` (each a contiguous buffer) as the next message. Raises
        ValueError when it is larger than a slot, and ReaderExited when a reader that holds its slot is gone."""
        m = self._mapping()
        views = [np.frombuffer(part, dtype=np.uint8) for part in parts]
        size = sum(view.size for view in views)
        if size > m.slot_bytes:
            raise ValueError(f"ShmWriter.send: a message of {size} bytes; a slot holds {m.slot_bytes}")
        seq = self._sent + 1
        slot = (seq - 1) % len(m.slots)
        if int(m.consumed.min()) < seq - len(m.slots):  # a reader still has the slot's last message
            _wait(lambda: int(m.consumed.min()) >= seq - len(m.slots), time.monotonic(), self._check_readers)
        at = m.payload_at(slot)
        for view in views:
            m.bytes[at : at + view.size] = view
            at += view.size
        head = m.slots[slot]
        head[1] = size
        # The publish: the sequence number is stored after the payload and the length. x86 does not reorder
        # stores with other stores (nor loads with loads, on the reader's side); ARM does, and would need a
        # release fence here and an acquire fence after the reader's load.
        head[0] = seq
        self._sent = seq

    def unlink(self) -> None:
        """Remove the file's name (safe twice): the readers that attached keep their mapping."""
        if self._linked:
            self._linked = False
            os.unlink(self.path)

    def close(self) -> None:
        """Unmap the ring and remove its file if still there (safe twice)."""
        self.unlink()
        if self._m is not None:
            self._m.close()
            self._m = None

    def _mapping(self) -> _Mapping:
        if self._m is None:
            raise RuntimeError("ShmWriter: the ring was closed")
        return self._m

    def _check_readers(self) -> None:
        m = self._mapping()
        for reader in range(self._num_readers):
            pid = int(m.pids[reader])
            # pid 0: not attached yet, nothing to check (the owner attaches every reader before sending)
            if int(m.consumed[reader]) < self._sent + 1 - len(m.slots) and pid and not process_exists(pid):
                raise ReaderExited(reader, pid)


class ShmReader:
    """Reader r's side of a ring: `receive` waits for the next message and returns a copy of it."""

    def __init__(self, mapping: _Mapping, reader: int) -> None:
        self._m: _Mapping | None = mapping
        self._reader = reader
        self.writer_pid = int(mapping.words[4])
        self._next = int(mapping.consumed[reader]) + 1
        self._last = time.monotonic()  # when the last message came: polling or sleeping is timed from it

    @classmethod
    def attach(cls, path: str, reader: int) -> ShmReader:
        """Map the ring at `path` as reader `reader`. Raises OSError when the file cannot be opened or mapped,
        ValueError when it is no ring of this version, has no such reader, or its writer is no process here."""
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            header = os.pread(fd, _WORDS * 8, 0)
            if len(header) < _WORDS * 8:
                raise ValueError(f"ShmReader: {path} is too short to be a ring")
            magic, version, num_slots, slot_bytes, writer_pid, num_readers = np.frombuffer(
                header, np.int64
            ).tolist()
            if magic != MAGIC or version != VERSION:
                raise ValueError(f"ShmReader: {path} is not a version {VERSION} ring")
            if size != _header_bytes(num_readers) + num_slots * _slot_stride(slot_bytes):
                raise ValueError(f"ShmReader: {path} is {size} bytes, not what its header describes")
            if not 0 <= reader < num_readers:
                raise ValueError(f"ShmReader: reader {reader}, but the ring at {path} has {num_readers}")
            if not process_exists(writer_pid):
                raise ValueError(f"ShmReader: the ring's writer (pid {writer_pid}) is no process seen here")
            mapping = _Mapping(fd, size)
        finally:
            os.close(fd)
        mapping.pids[reader] = os.getpid()
        return cls(mapping, reader)

    def receive(self) -> bytearray:
        """The next message: a copy, so the slot is free once this returns. Raises RuntimeError naming the
        writer's pid when the writer's process is gone."""
        m = self._mapping()
        seq = self._next
        slot = (seq - 1) % len(m.slots)
        if m.sequence(slot) < seq:
            # The wait holds the mapping, not a view of it: a traceback that outlives an error (the writer died)
            # would otherwise hold the map's buffer and keep close() from unmapping it.
            _wait(lambda: m.sequence(slot) >= seq, self._last, self._check_writer)
        if m.sequence(slot) != seq:
            raise RuntimeError(
                f"ShmReader: slot holds message {m.sequence(slot)}, reader {self._reader} wants {seq}"
            )
        size = int(m.slots[slot][1])
        message = bytearray(size)
        if size:
            at = m.payload_at(slot)
            np.frombuffer(message, dtype=np.uint8)[:] = m.bytes[at : at + size]
        m.consumed[self._reader] = seq  # after the copy: this frees the slot for the writer
        self._next = seq + 1
        self._last = time.monotonic()
        return message

    def close(self) -> None:
        """Unmap the ring (safe twice)."""
        if self._m is not None:
            self._m.close()
            self._m = None

    def _mapping(self) -> _Mapping:
        if self._m is None:
            raise RuntimeError("ShmReader: the ring was closed")
        return self._m

    def _check_writer(self) -> None:
        if not process_exists(self.writer_pid):
            raise RuntimeError(
                f"ShmReader: the lead rank's process (pid {self.writer_pid}) exited; no more messages will come"
            )


def _wait(ready: Callable[[], bool], since: float, check_peer: Callable[[], None]) -> None:
    """Poll `ready` until it holds: yielding between polls until SPIN_S after `since`, then sleeping ever
    longer (up to BACKOFF_MAX_S); `check_peer` runs every LIVENESS_S and raises when the peer is gone."""
    started = time.monotonic()
    next_check = started + LIVENESS_S
    pause = BACKOFF_FIRST_S
    while not ready():
        now = time.monotonic()
        if now >= next_check:
            check_peer()
            next_check = now + LIVENESS_S
        if now - since < SPIN_S:
            os.sched_yield()
        else:
            time.sleep(pause)
            pause = min(2 * pause, BACKOFF_MAX_S)


def process_exists(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie, dead but not yet reaped by its parent, is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: it exists
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rsplit(b")", 1)[1].split()[0]  # after "pid (command)"
    except OSError:
        return True  # no /proc (not Linux): kill's answer is all there is
    return state not in (b"Z", b"X")


def _header_bytes(num_readers: int) -> int:
    return _LINE * (1 + num_readers)


def _slot_stride(slot_bytes: int) -> int:
    return -(-(_SLOT_HEAD + slot_bytes) // _LINE) * _LINE  # rounded up to whole cache lines
