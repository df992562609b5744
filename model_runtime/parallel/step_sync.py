"""Lockstep: the lead rank tells the others what each step runs, as raw integers over torch.distributed.

Only the lead schedules. Every step it publishes the HostBatch it built (model_runner's host-side inputs) and
then runs it; the other ranks receive the same batch and run it too, so every rank makes the same collectives
in the same order. Broadcasts on the host group, never pickle:

    header   int64 [5]:  kind, then per kind:
                         STEP     T tokens, B sequences, S sampling rows, W block-table width
                         STOP     (nothing): the followers leave their loop
                         CONTROL  N bytes: a message for the followers' own agents follows as uint8 [N]
                         GATHER   W words: every rank then contributes int64 [W] to an all-gather
    payload  (STEP) int64 [3T + S + 2B + 1 + B*W], in this order:
             token_ids [T] | positions [T] | slots [T] | logits_indices [S] | query_start [B+1] | seq_lens [B]
             | block_tables [B, W] row-major       (the int32 arrays travel widened to int64)

query_lens and the host lists are derived from query_start and seq_lens on arrival, so a received batch is
equal to the sent one field for field.

CONTROL and GATHER are the two directions of a channel between the lead and whatever runs beside each follower's
step loop (a rank's KV agent, for a worker whose ranks each send or receive their own heads). CONTROL carries
bytes the receiving side parses itself (a protobuf message; the channel never interprets them). GATHER brings
back what the followers queued for the lead, as integer words: a follower answers with a count and up to W - 1
words, the rest stays queued for the next GATHER. Both happen between two steps, on the lead's thread, so they
are ordered with the steps exactly as the lead issued them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from model_runtime.host_batch import HostBatch
from model_runtime.parallel.group import TPGroup

STEP, STOP, CONTROL, GATHER = 1, 0, 2, 3
_HEADER = 5
MAX_CONTROL_BYTES = 1 << 20  # a control message names requests, blocks and peers; never KV data


class StepPublisher:
    """The lead's side: `publish(batch)` before running each step, `stop()` once at shutdown (safe twice)."""

    def __init__(self, group: TPGroup) -> None:
        if not group.is_lead:
            raise ValueError(f"StepPublisher: only the lead rank publishes steps, this is rank {group.rank}")
        self._group = group
        self._stopped = False

    def publish(self, batch: HostBatch) -> None:
        if self._stopped:
            raise RuntimeError("StepPublisher: the other ranks were stopped; no step can run")
        header, payload = encode(batch)
        self._group.broadcast_host(header)
        self._group.broadcast_host(payload)

    def control(self, message: bytes) -> None:
        """Hand `message` to every follower's `on_control`, between two steps."""
        if self._stopped:
            raise RuntimeError("StepPublisher: the other ranks were stopped; no message can reach them")
        if not 0 < len(message) <= MAX_CONTROL_BYTES:
            raise ValueError(
                f"StepPublisher.control: {len(message)} bytes; a message is 1 to {MAX_CONTROL_BYTES}"
            )
        self._group.broadcast_host(torch.tensor([CONTROL, len(message), 0, 0, 0], dtype=torch.int64))
        self._group.broadcast_host(torch.frombuffer(bytearray(message), dtype=torch.uint8))

    def gather(self, width: int) -> list[list[int]]:
        """What each follower queued for the lead (rank 1, 2, ... in order): at most width - 1 words each."""
        if self._stopped:
            raise RuntimeError("StepPublisher: the other ranks were stopped; they report nothing")
        if width < 2:
            raise ValueError(f"StepPublisher.gather: width must be >= 2 (a count and a word), got {width}")
        self._group.broadcast_host(torch.tensor([GATHER, width, 0, 0, 0], dtype=torch.int64))
        rows = self._group.all_gather_host(torch.zeros(width, dtype=torch.int64))  # the lead reports nothing
        return [_unpack(row, rank) for rank, row in enumerate(rows) if rank != self._group.rank]

    def stop(self) -> None:
        """Release the other ranks from their loop."""
        if self._stopped:
            return
        self._stopped = True
        self._group.broadcast_host(torch.tensor([STOP, 0, 0, 0, 0], dtype=torch.int64))


class StepReceiver:
    """A follower rank's side: `receive()` waits for the lead's next step; None once the lead stopped.

    Control messages and gathers that come before the step are served on the way: `on_control(message)` gets
    each message's bytes, `reports(max_words)` returns up to max_words words the follower queued for the lead
    (and keeps the rest). A follower without them fails on the first such message: nothing is dropped silently.
    """

    def __init__(
        self,
        group: TPGroup,
        on_control: Callable[[bytes], None] | None = None,
        reports: Callable[[int], Sequence[int]] | None = None,
    ) -> None:
        if group.is_lead:
            raise ValueError("StepReceiver: the lead rank publishes steps, it does not receive them")
        self._group = group
        self._on_control = on_control
        self._reports = reports

    def receive(self) -> HostBatch | None:
        while True:
            header = torch.empty(_HEADER, dtype=torch.int64)
            self._group.broadcast_host(header)
            kind, t, b, s, w = header.tolist()
            if kind == STOP:
                return None
            if kind == STEP:
                payload = torch.empty(3 * t + s + 2 * b + 1 + b * w, dtype=torch.int64)
                self._group.broadcast_host(payload)
                return decode(header, payload)
            if kind == CONTROL:
                self._control(t)
            elif kind == GATHER:
                self._gather(t)
            else:
                raise RuntimeError(f"StepReceiver: unknown message kind {kind} from the lead rank")

    def _control(self, size: int) -> None:
        message = torch.empty(size, dtype=torch.uint8)
        self._group.broadcast_host(message)
        if self._on_control is None:
            raise RuntimeError(
                f"StepReceiver: rank {self._group.rank} got a control message and has no handler"
            )
        self._on_control(message.numpy().tobytes())

    def _gather(self, width: int) -> None:
        words = list(self._reports(width - 1)) if self._reports is not None else []
        if len(words) > width - 1:
            raise RuntimeError(f"StepReceiver: {len(words)} report words for a gather of {width - 1}")
        row = torch.zeros(width, dtype=torch.int64)
        row[0] = len(words)
        row[1 : 1 + len(words)] = torch.tensor(words, dtype=torch.int64)
        self._group.all_gather_host(row)


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
    header = [STEP, batch.num_tokens, b, int(batch.logits_indices.shape[0]), w]
    parts = (
        batch.token_ids,
        batch.positions,
        batch.slots,
        batch.logits_indices,
        batch.query_start,
        batch.seq_lens,
        batch.block_tables.ravel(),
    )
    payload = np.concatenate(parts).astype(np.int64, copy=False)
    return torch.tensor(header, dtype=torch.int64), torch.from_numpy(payload)


def decode(header: torch.Tensor, payload: torch.Tensor) -> HostBatch:
    """The HostBatch that `encode` turned into (header, payload)."""
    _, t, b, s, w = header.tolist()
    sizes = (t, t, t, s, b + 1, b, b * w)
    token_ids, positions, slots, logits_indices, query_start, seq_lens, tables = np.split(
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
    )
