"""Lockstep: the lead rank tells the others what each step runs, as raw integers over torch.distributed.

Only the lead schedules. Every step it publishes the HostBatch it built (model_runner's host-side inputs) and
then runs it; the other ranks receive the same batch and run it too, so every rank makes the same collectives
in the same order. Two broadcasts on the host group, never pickle:

    header   int64 [5]:  kind (STEP or STOP), T tokens, B sequences, S sampling rows, W block-table width
    payload  int64 [3T + S + 2B + 1 + B*W], in this order:
             token_ids [T] | positions [T] | slots [T] | logits_indices [S] | query_start [B+1] | seq_lens [B]
             | block_tables [B, W] row-major       (the int32 arrays travel widened to int64)

query_lens and the host lists are derived from query_start and seq_lens on arrival, so a received batch is
equal to the sent one field for field.
"""

from __future__ import annotations

import numpy as np
import torch

from model_runtime.host_batch import HostBatch
from model_runtime.parallel.group import TPGroup

STEP, STOP = 1, 0
_HEADER = 5


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

    def stop(self) -> None:
        """Release the other ranks from their loop."""
        if self._stopped:
            return
        self._stopped = True
        self._group.broadcast_host(torch.tensor([STOP, 0, 0, 0, 0], dtype=torch.int64))


class StepReceiver:
    """A follower rank's side: `receive()` waits for the lead's next step; None once the lead stopped."""

    def __init__(self, group: TPGroup) -> None:
        if group.is_lead:
            raise ValueError("StepReceiver: the lead rank publishes steps, it does not receive them")
        self._group = group

    def receive(self) -> HostBatch | None:
        header = torch.empty(_HEADER, dtype=torch.int64)
        self._group.broadcast_host(header)
        kind, t, b, s, w = header.tolist()
        if kind == STOP:
            return None
        if kind != STEP:
            raise RuntimeError(f"StepReceiver: unknown message kind {kind} from the lead rank")
        payload = torch.empty(3 * t + s + 2 * b + 1 + b * w, dtype=torch.int64)
        self._group.broadcast_host(payload)
        return decode(header, payload)


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
