"""Lockstep: the lead rank tells the others what each step runs, as raw integers, never pickle.

Only the lead schedules. Every step it publishes the HostBatch it built (model_runner's host-side inputs) and
then runs it; the other ranks receive the same batch and run it too, so every rank makes the same collectives
in the same order. Each message is a header and, for some kinds, a payload:

    header   int64 [7]:  kind, then per kind:
                         STEP     T tokens, B sequences, S sampling rows, W block-table width, P prompt-scoring
                                  rows, N their widest top-n (model_runtime.prompt_scores)
                         STOP     (nothing): the followers leave their loop
    payload  (STEP) int64 [3T + S + 2B + 1 + B*W + 2P], in this order:
             token_ids [T] | positions [T] | slots [T] | logits_indices [S] | query_start [B+1] | seq_lens [B]
             | block_tables [B, W] row-major | prompt_rows [P] | prompt_targets [P]
             (the int32 arrays travel widened to int64)

query_lens and the host lists are derived from query_start and seq_lens on arrival, so a received batch is
equal to the sent one field for field.

Transport. Every rank of an engine is on one node, so the lead writes each message once into a shared-memory
ring (model_runtime.parallel.shm_channel) that the followers poll: a step reaches them in microseconds, where a
gloo broadcast over loopback takes 100-250 us, late enough to hold up the step's first all-reduce. One ring
message per lead message:

    int64 [8]: the header, then where the payload is (PAYLOAD_HERE / PAYLOAD_ON_GLOO) | the payload's bytes

A payload larger than a slot (a step of a very long prompt batch) goes as before, as a gloo broadcast on the
host group right after its header; the header on the ring says so, so everything stays in the order the lead
issued it. The ring is set up at the first message, where the first broadcast used to be, not
in the constructors: the lead makes its publisher before the start-up collectives (TensorParallel.join, in
build_runner) and a follower its receiver after them, and the set-up's two collectives must pair up on every
rank. Where a ring cannot be made or mapped on any rank, or a rank passed shared_memory=False, every rank uses
the host group's broadcasts for everything (the reason is logged).

The ranks' KV agents (worker_host.rank_agents) talk to rank 0 over a socket of their own, not here: the step
loop never waits on KV bookkeeping.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch

from model_runtime.host_batch import HostBatch
from model_runtime.parallel.group import TPGroup
from model_runtime.parallel.shm_channel import ReaderExited, ShmReader, ShmWriter

log = logging.getLogger(__name__)

STEP, STOP = 1, 0
_HEADER = 7
PAYLOAD_HERE, PAYLOAD_ON_GLOO = 0, 1  # a ring message's sixth word
_FRAME_BYTES = (_HEADER + 1) * 8  # a ring message's payload starts here
_PATH_BYTES = 1024  # the set-up broadcasts the ring's path in this many bytes (an empty path: no ring)


class StepPublisher:
    """The lead's side: `publish(batch)` before running each step, `stop()` once at shutdown (safe twice).
    `shared_memory=False` sends everything over the host group's broadcasts (on every rank: the ranks agree)."""

    def __init__(self, group: TPGroup, shared_memory: bool = True) -> None:
        if not group.is_lead:
            raise ValueError(f"StepPublisher: only the lead rank publishes steps, this is rank {group.rank}")
        self._group = group
        self._shared_memory = shared_memory
        self._set_up = False  # the first message sets the transport up (see the module docstring)
        self._ring: ShmWriter | None = None
        self._stopped = False
        self.published = 0  # steps published so far: a follower has run step k once it ran k batches

    @property
    def on_shared_memory(self) -> bool:
        """Whether messages go over the shared-memory ring (known from the first message on)."""
        return self._ring is not None

    def publish(self, batch: HostBatch) -> None:
        if self._stopped:
            raise RuntimeError("StepPublisher: the other ranks were stopped; no step can run")
        header, payload = encode(batch)
        self._send(header, payload)
        self.published += 1

    def stop(self) -> None:
        """Release the other ranks from their loop."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self._send(torch.tensor([STOP] + [0] * (_HEADER - 1), dtype=torch.int64), None)
        finally:
            if self._ring is not None:
                self._ring.close()  # the followers' mappings outlive it: they still read the STOP

    def _send(self, header: torch.Tensor, payload: torch.Tensor | None) -> None:
        if not self._set_up:
            self._ring = _open_writer(self._group, self._shared_memory)
            self._set_up = True
        if self._ring is None:
            self._group.broadcast_host(header)
            if payload is not None:
                self._group.broadcast_host(payload)
        elif payload is not None and _FRAME_BYTES + payload.nbytes > self._ring.slot_bytes:
            self._ring_send(self._ring, header, PAYLOAD_ON_GLOO)
            self._group.broadcast_host(payload)
        else:
            self._ring_send(self._ring, header, PAYLOAD_HERE, payload)

    def _ring_send(
        self, ring: ShmWriter, header: torch.Tensor, where: int, payload: torch.Tensor | None = None
    ) -> None:
        frame = np.append(header.numpy(), where)
        try:
            ring.send(*((frame,) if payload is None else (frame, payload.numpy())))
        except ReaderExited as err:
            raise RuntimeError(
                f"StepPublisher: rank {err.reader + 1} (pid {err.pid}) exited; the engine cannot step without it"
            ) from err


class StepReceiver:
    """A follower rank's side: `receive()` waits for the lead's next step; None once the lead stopped."""

    def __init__(
        self,
        group: TPGroup,
        shared_memory: bool = True,
    ) -> None:
        if group.is_lead:
            raise ValueError("StepReceiver: the lead rank publishes steps, it does not receive them")
        self._group = group
        self._shared_memory = shared_memory
        self._set_up = False  # the lead's first message sets the transport up
        self._ring: ShmReader | None = None

    @property
    def on_shared_memory(self) -> bool:
        """Whether messages come over the shared-memory ring (known from the first message on)."""
        return self._ring is not None

    def receive(self) -> HostBatch | None:
        while True:
            header, inline = self._next()
            kind, t, b, s, w, p, _ = header
            if kind == STOP:
                if self._ring is not None:
                    self._ring.close()
                return None
            if kind == STEP:
                payload = self._payload(inline, 3 * t + s + 2 * b + 1 + b * w + 2 * p, torch.int64)
                return decode(torch.tensor(header, dtype=torch.int64), payload)
            raise RuntimeError(f"StepReceiver: unknown message kind {kind} from the lead rank")

    def _next(self) -> tuple[list[int], memoryview | None]:
        """The next message's header, and its payload's bytes when they came with it (None: on gloo)."""
        if not self._set_up:
            self._ring = _open_reader(self._group, self._shared_memory)
            self._set_up = True
        if self._ring is None:
            header = torch.empty(_HEADER, dtype=torch.int64)
            self._group.broadcast_host(header)
            return header.tolist(), None
        frame = self._ring.receive()
        words = np.frombuffer(frame, dtype=np.int64, count=_HEADER + 1).tolist()
        return words[:_HEADER], memoryview(frame)[_FRAME_BYTES:] if words[_HEADER] == PAYLOAD_HERE else None

    def _payload(self, inline: memoryview | None, count: int, dtype: torch.dtype) -> torch.Tensor:
        """The message's payload of `count` elements: from the ring message, or the host group's broadcast."""
        if inline is None:
            payload = torch.empty(count, dtype=dtype)
            self._group.broadcast_host(payload)
            return payload
        size = count * dtype.itemsize
        if len(inline) != size or count < 1:
            raise RuntimeError(f"StepReceiver: a payload of {len(inline)} bytes where its header says {size}")
        return torch.frombuffer(inline, dtype=dtype)


def _open_writer(group: TPGroup, wanted: bool) -> ShmWriter | None:
    """The lead's half of the ring's set-up (two host-group collectives, paired with _open_reader): make the
    ring, broadcast its path, learn whether every follower mapped it, then remove its name either way."""
    ring = _create_ring(group.size - 1) if wanted else None
    path = np.zeros(_PATH_BYTES, dtype=np.uint8)  # all zeros: no ring
    if ring is not None:
        name = os.fsencode(ring.path)
        path[: len(name)] = np.frombuffer(name, dtype=np.uint8)
    group.broadcast_host(torch.from_numpy(path))
    attached = _agree(group, ring is not None)
    if ring is None:
        return None
    ring.unlink()  # every follower has mapped it, or never will
    if not all(attached):
        missing = [rank for rank, ok in enumerate(attached) if not ok]
        log.warning(
            "step_sync: ranks %s cannot map the shared-memory ring; steps go over the host group", missing
        )
        ring.close()
        return None
    log.info("step_sync: the lead's messages go over a shared-memory ring (%d bytes a slot)", ring.slot_bytes)
    return ring


def _create_ring(num_readers: int) -> ShmWriter | None:
    """A ring whose path fits the set-up's broadcast, or None (the reason logged)."""
    try:
        ring = ShmWriter.create(num_readers)
    except OSError as err:
        log.warning("step_sync: no shared-memory ring (%s); steps go over the host group", err)
        return None
    if len(os.fsencode(ring.path)) > _PATH_BYTES:
        log.warning(
            "step_sync: the ring's path %s is too long to send; steps go over the host group", ring.path
        )
        ring.close()
        return None
    return ring


def _open_reader(group: TPGroup, wanted: bool) -> ShmReader | None:
    """A follower's half of the set-up: map the ring whose path the lead broadcasts, and agree on using it."""
    message = torch.empty(_PATH_BYTES, dtype=torch.uint8)
    group.broadcast_host(message)
    path = os.fsdecode(message.numpy().tobytes().rstrip(b"\0"))
    ring = None
    if path and wanted:
        try:
            ring = ShmReader.attach(path, group.rank - 1)
        except (OSError, ValueError) as err:
            log.warning("step_sync: rank %d cannot map the shared-memory ring (%s)", group.rank, err)
    if all(_agree(group, ring is not None)):
        return ring
    if ring is not None:
        ring.close()
    return None


def _agree(group: TPGroup, ok: bool) -> list[bool]:
    """Every rank's `ok`, in rank order (the lead's first)."""
    return [bool(row.item()) for row in group.all_gather_host(torch.tensor([int(ok)], dtype=torch.int64))]


def _unpack(row: torch.Tensor, rank: int) -> list[int]:
    count = int(row[0])
    if not 0 <= count < row.numel():
        raise RuntimeError(
            f"StepPublisher.gather: rank {rank} sent a count of {count} for {row.numel() - 1} words"
        )
    return row[1 : 1 + count].tolist()


def encode(batch: HostBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """A step as (header, payload) int64 CPU tensors."""
    b, w = batch.block_tables.shape
    p = int(batch.prompt_rows.shape[0])
    header = [STEP, batch.num_tokens, b, int(batch.logits_indices.shape[0]), w, p, batch.prompt_top_n]
    parts = (
        batch.token_ids,
        batch.positions,
        batch.slots,
        batch.logits_indices,
        batch.query_start,
        batch.seq_lens,
        batch.block_tables.ravel(),
        batch.prompt_rows,
        batch.prompt_targets,
    )
    payload = np.concatenate(parts).astype(np.int64, copy=False)
    return torch.tensor(header, dtype=torch.int64), torch.from_numpy(payload)


def decode(header: torch.Tensor, payload: torch.Tensor) -> HostBatch:
    """The HostBatch that `encode` turned into (header, payload)."""
    _, t, b, s, w, p, top_n = header.tolist()
    sizes = (t, t, t, s, b + 1, b, b * w, p, p)
    token_ids, positions, slots, logits_indices, query_start, seq_lens, tables, rows, targets = np.split(
        payload.numpy(), np.cumsum(sizes)[:-1]
    )
    return HostBatch(
        token_ids=token_ids,
        positions=positions,
        slots=slots,
        query_start=query_start.astype(np.int32),
        seq_lens=seq_lens.astype(np.int32),
        block_tables=tables.astype(np.int32).reshape(b, w),
        logits_indices=logits_indices,
        query_lens=np.diff(query_start).tolist(),
        seq_lens_list=seq_lens.tolist(),
        prompt_rows=rows,
        prompt_targets=targets,
        prompt_top_n=top_n,
    )
