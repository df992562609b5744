"""One step's inputs on the host: a SchedulerOutput flattened into numpy arrays, before any device work.

The model runner builds a HostBatch every step, then either pads it into the decode CUDA graphs' static buffers
or packs it into two copies for an eager forward. Everything here is plain Python and numpy (tested on CPU).
Cost is per request, not per token: token ids are sliced, never concatenated whole; positions and slots are
vectorized; block tables are cached across steps (HostBlockTables), so a decode step converts no block ids.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from model_runtime.attention.base import (
    PER_PROMPT_MAX_CHUNKS,
    PER_PROMPT_MIN_TOKENS,
    MixedPlan,
    PrefillGroup,
    Rows,
)
from model_runtime.config import DECODE_GATHER_MAX_STEP_TOKENS
from model_runtime.cuda_graphs import DecodeRows
from model_runtime.kv_layout import NULL_BLOCK
from model_runtime.prompt_scores import PromptSpan, plan_rows, span_of
from model_runtime.request import Request, SchedulerOutput

_NO_ROWS = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class HostBatch:
    """One step on the host. T tokens of B sequences; S of the sequences sample."""

    token_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slots: np.ndarray  # [T] int64
    query_start: np.ndarray  # [B + 1] int32
    seq_lens: np.ndarray  # [B] int32
    block_tables: np.ndarray  # [B, W] int32, W = blocks of the longest sequence, padded with the null block
    logits_indices: np.ndarray  # [S] int64: the last token row of each sampling chunk
    query_lens: list[int]
    seq_lens_list: list[int]
    # Rows whose logits score prompt tokens (model_runtime.prompt_scores; empty unless a request asked), the
    # tokens they score and the widest top-n asked; `prompt_spans` maps them back to their requests (the lead's
    # host only: tensor-parallel ranks receive the arrays, not the spans).
    prompt_rows: np.ndarray = field(default_factory=lambda: _NO_ROWS)
    prompt_targets: np.ndarray = field(default_factory=lambda: _NO_ROWS)
    prompt_top_n: int = 0
    prompt_spans: tuple[PromptSpan, ...] = ()

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def decode_only(self) -> bool:
        return max(self.query_lens) == 1

    @property
    def samples_every_row(self) -> bool:
        return int(self.logits_indices.shape[0]) == self.num_tokens

    def mixed_plan(self, block_size: int, decode_gather_tokens: int = 0) -> HostMixedPlan | None:
        """The prefill / decode split of a step with a chunk of more than one token (None for decode-only);
        `decode_gather_tokens`: see mixed_plan."""
        if self.decode_only:
            return None
        return mixed_plan(self.query_lens, self.seq_lens, self.block_tables, block_size, decode_gather_tokens)

    def decode_rows(self) -> DecodeRows:
        if not self.decode_only:
            raise ValueError("HostBatch.decode_rows: the step has a chunk of more than one token")
        return DecodeRows(self.token_ids, self.positions, self.slots, self.seq_lens, self.block_tables)


@dataclass(frozen=True)
class HostRows:
    """attention.base.Rows on the host: [start, stop), or `index` when the rows are not contiguous."""

    start: int
    stop: int
    index: np.ndarray | None  # int64

    @classmethod
    def of(cls, rows: np.ndarray) -> HostRows:
        """From strictly increasing row numbers (chunks in step order): contiguous iff they span n rows."""
        n = int(rows.shape[0])
        start = int(rows[0]) if n else 0
        if n == 0 or int(rows[-1]) - start == n - 1:
            return cls(start, start + n, None)
        return cls(start, int(rows[-1]) + 1, rows.astype(np.int64))


@dataclass(frozen=True)
class HostPrefillGroup:
    """attention.base.PrefillGroup on the host (numpy); see there for each field."""

    rows: HostRows
    cu_q: np.ndarray  # int32
    cu_k: np.ndarray  # int32
    context_slots: np.ndarray | None  # int64
    query_lens: list[int]
    seq_lens: list[int]
    starts: list[int]


@dataclass(frozen=True)
class HostMixedPlan:
    """attention.base.MixedPlan on the host (numpy); see there for each field.

    The device copy is made in two moves so that a caller can pack every array into one buffer per dtype:
    int64_arrays() and int32_arrays() list them, bind() takes device tensors of the same arrays in the same
    order (views into the caller's buffers) and builds the MixedPlan."""

    long_fresh: HostPrefillGroup | None
    fresh: HostPrefillGroup | None
    cached: HostPrefillGroup | None
    decode_rows: HostRows | None
    decode_seqs: np.ndarray | None  # int64
    num_rows: int
    covered: bool

    def _groups(self) -> list[HostPrefillGroup]:
        return [g for g in (self.long_fresh, self.fresh, self.cached) if g is not None]

    def int64_arrays(self) -> list[np.ndarray]:
        arrays = []
        for group in self._groups():
            arrays += [a for a in (group.rows.index, group.context_slots) if a is not None]
        if self.decode_rows is not None and self.decode_rows.index is not None:
            arrays.append(self.decode_rows.index)
        if self.decode_seqs is not None:
            arrays.append(self.decode_seqs)
        return arrays

    def int32_arrays(self) -> list[np.ndarray]:
        return [a for group in self._groups() for a in (group.cu_q, group.cu_k)]

    def bind(self, int64: list[torch.Tensor], int32: list[torch.Tensor]) -> MixedPlan:
        """The device plan from device copies of int64_arrays() and int32_arrays(), in their order."""
        i64, i32 = iter(int64), iter(int32)

        def rows(host: HostRows) -> Rows:
            return Rows(host.start, host.stop, None if host.index is None else next(i64))

        def group(host: HostPrefillGroup | None) -> PrefillGroup | None:
            if host is None:
                return None
            at = rows(host.rows)
            slots = None if host.context_slots is None else next(i64)
            return PrefillGroup(
                rows=at,
                cu_q=next(i32),
                cu_k=next(i32),
                max_q=max(host.query_lens),
                max_k=max(host.seq_lens),
                context_slots=slots,
                query_lens=host.query_lens,
                seq_lens=host.seq_lens,
                starts=host.starts,
            )

        long_fresh, fresh, cached = group(self.long_fresh), group(self.fresh), group(self.cached)
        decode_rows = None if self.decode_rows is None else rows(self.decode_rows)
        decode_seqs = None if self.decode_seqs is None else next(i64)
        return MixedPlan(long_fresh, fresh, cached, decode_rows, decode_seqs, self.num_rows, self.covered)

    def to_device(self, device: torch.device | str) -> MixedPlan:
        """One copy per array; the model runner packs its copies instead (this is for tests and tools)."""

        def put(arrays: list[np.ndarray]) -> list[torch.Tensor]:
            return [torch.from_numpy(a).to(device) for a in arrays]

        return self.bind(put(self.int64_arrays()), put(self.int32_arrays()))


def mixed_plan(
    query_lens: list[int],
    seq_lens: np.ndarray,
    block_tables: np.ndarray,
    block_size: int,
    decode_gather_tokens: int = 0,
) -> HostMixedPlan:
    """The split of a step's B chunks (query_lens, seq_lens [B], block_tables [B, W]) into prompt chunks by
    group (attention.base.MixedPlan) and single-token decode chunks; chunks with no query or no context are
    padding and in none of them. Decode chunks whose contexts total at most `decode_gather_tokens` join the
    cached group, in a step of at most DECODE_GATHER_MAX_STEP_TOKENS tokens (config.DECODE_GATHER_MAX_TOKENS
    says why; 0: never)."""
    qlens = np.asarray(query_lens, dtype=np.int64)
    slens = np.asarray(seq_lens, dtype=np.int64)
    live = (qlens > 0) & (slens > 0)
    starts = np.concatenate([[0], np.cumsum(qlens)[:-1]]).astype(np.int64)
    prompt = live & (qlens > 1)
    fresh = prompt & (qlens == slens)
    long_fresh = fresh & (qlens >= PER_PROMPT_MIN_TOKENS)
    if int(long_fresh.sum()) > PER_PROMPT_MAX_CHUNKS:
        long_fresh[:] = False
    num_rows = int(qlens.sum())
    single = live & (qlens == 1)
    gather = (
        num_rows <= DECODE_GATHER_MAX_STEP_TOKENS and 0 < int(slens[single].sum()) <= decode_gather_tokens
    )
    gathered = single if gather else np.zeros_like(single)
    dec = np.flatnonzero(single & ~gathered)

    def group(chunks: np.ndarray, gather: bool) -> HostPrefillGroup | None:
        if len(chunks) == 0:
            return None
        ql, sl = qlens[chunks], slens[chunks]
        cu_k = np.concatenate([[0], np.cumsum(sl)]).astype(np.int32)
        slots = None
        if gather:  # every context position p of chunk i: slot table[i, p // bs] * bs + p % bs
            seq = np.repeat(chunks, sl)
            pos = np.arange(int(cu_k[-1]), dtype=np.int64) - np.repeat(cu_k[:-1].astype(np.int64), sl)
            slots = block_tables[seq, pos // block_size].astype(np.int64) * block_size + pos % block_size
        return HostPrefillGroup(
            rows=HostRows.of(_concat_ranges(starts[chunks], ql)),
            cu_q=np.concatenate([[0], np.cumsum(ql)]).astype(np.int32),
            cu_k=cu_k,
            context_slots=slots,
            query_lens=ql.tolist(),
            seq_lens=sl.tolist(),
            starts=starts[chunks].tolist(),
        )

    return HostMixedPlan(
        long_fresh=group(np.flatnonzero(long_fresh), gather=False),
        fresh=group(np.flatnonzero(fresh & ~long_fresh), gather=False),
        cached=group(np.flatnonzero((prompt & ~fresh) | gathered), gather=True),
        decode_rows=HostRows.of(starts[dec]) if len(dec) else None,
        decode_seqs=dec.astype(np.int64) if len(dec) else None,
        num_rows=num_rows,
        covered=not bool(((qlens > 0) & ~live).any()),
    )


def _concat_ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """[s0, s0+1, ..., s0+l0-1, s1, ...] without a Python loop."""
    offsets = np.repeat(starts - np.concatenate([[0], np.cumsum(lens)[:-1]]), lens)
    return np.arange(int(lens.sum()), dtype=np.int64) + offsets


def chunk_tokens(request: Request, start: int, end: int) -> list[int]:
    """Tokens [start, end) of prompt + output, without building the whole concatenation (a decode step reads
    one token; `Request.all_token_ids` would copy the whole sequence)."""
    prompt, output = request.prompt_token_ids, request.output_token_ids
    p = len(prompt)
    if end <= p:
        return prompt[start:end]
    if start >= p:
        return output[start - p : end - p]
    return prompt[start:] + output[: end - p]


class HostBlockTables:
    """Block tables of recent requests kept on the host across steps, so a step converts only the block ids
    appended since the last one (for a decode step, usually none) instead of every id of every sequence.

    Relies on `Request.block_ids` changing only by in-place `extend`: the scheduler replaces the list
    (preemption, admission) rather than editing it, and a replaced or shortened list rebuilds the row.
    Rows of requests absent from a step are recycled when the store runs out of rows.
    """

    def __init__(self, max_blocks: int, rows: int) -> None:
        self._store = np.zeros((max(1, rows), max(1, max_blocks)), dtype=np.int32)
        self._rows: dict[str, _TableRow] = {}
        self._free = list(range(self._store.shape[0]))
        self._step = 0

    def gather(self, requests: list[Request], width: int) -> np.ndarray:
        """[len(requests), width] block table (a copy), rows in request order, padded with the null block."""
        self._step += 1
        rows = [self._sync(r) for r in requests]
        return self._store[rows, :width]

    def _sync(self, request: Request) -> int:
        ids = request.block_ids
        entry = self._rows.get(request.request_id)
        if entry is None or not entry.mirrors(ids, self._store):
            entry = self._assign(request.request_id, ids)
        if len(ids) > entry.synced:
            if len(ids) > self._store.shape[1]:
                self._store = np.pad(self._store, ((0, 0), (0, len(ids) - self._store.shape[1])))
            self._store[entry.row, entry.synced : len(ids)] = ids[entry.synced :]
            entry.synced = len(ids)
        entry.step = self._step
        return entry.row

    def _assign(self, request_id: str, ids: list[int]) -> _TableRow:
        old = self._rows.pop(request_id, None)
        row = old.row if old is not None else self._take_row()
        self._store[row] = NULL_BLOCK
        entry = _TableRow(row, ids, 0, self._step)
        self._rows[request_id] = entry
        return entry

    def _take_row(self) -> int:
        if not self._free:
            stale = [rid for rid, e in self._rows.items() if e.step < self._step]
            for rid in stale:
                self._free.append(self._rows.pop(rid).row)
        if not self._free:  # more live sequences than rows: grow
            n = self._store.shape[0]
            self._store = np.pad(self._store, ((0, n), (0, 0)))
            self._free.extend(range(n, 2 * n))
        return self._free.pop()


@dataclass
class _TableRow:
    row: int
    source: list[int]  # the request's block_ids list object this row mirrors
    synced: int  # how many of its ids are in the row
    step: int  # the last step that used it

    def mirrors(self, ids: list[int], store: np.ndarray) -> bool:
        # The last synced id is compared too: a cheap guard against an in-place edit of the list.
        if self.source is not ids or len(ids) < self.synced:
            return False
        return self.synced == 0 or int(store[self.row, self.synced - 1]) == ids[self.synced - 1]


def build_host_batch(
    out: SchedulerOutput, block_size: int, tables: HostBlockTables | None = None
) -> HostBatch:
    """Flatten a SchedulerOutput into arrays. One Python pass over the chunks; per-token work is numpy.

    Token t of chunk i sits at position start_i + (t - query_start[i]), and its slot is
    table[i, pos // block_size] * block_size + pos % block_size (KVLayout's slot rule, vectorized).
    `tables` (optional) caches block tables across steps; without it they are converted afresh.
    """
    if out.is_empty:
        raise ValueError("build_host_batch: the step has no chunks")
    tokens: list[int] = []
    starts: list[int] = []
    query_lens: list[int] = []
    needs: list[int] = []
    sample: list[bool] = []
    spans: list[PromptSpan] = []
    row = 0
    for chunk in out.chunks:
        req, start = chunk.request, chunk.request.num_computed_tokens
        if req.scoring_prompt and (span := span_of(chunk, row)) is not None:
            spans.append(span)
        row += chunk.num_tokens
        end = start + chunk.num_tokens
        need = -(-end // block_size)
        if len(req.block_ids) < need:
            raise ValueError(
                f"request {req.request_id!r}: {len(req.block_ids)} blocks cannot hold positions up to {end}"
            )
        tokens.extend(chunk_tokens(req, start, end))
        starts.append(start)
        query_lens.append(chunk.num_tokens)
        needs.append(need)
        sample.append(chunk.sample)
    # Blocks past the longest context are never read: the table is only that wide.
    requests = [c.request for c in out.chunks]
    if tables is not None:
        table = tables.gather(requests, max(needs))
    else:
        table = _block_table([r.block_ids[:n] for r, n in zip(requests, needs)])
    qlens = np.array(query_lens, dtype=np.int64)
    query_start = np.zeros(len(qlens) + 1, dtype=np.int64)
    np.cumsum(qlens, out=query_start[1:])
    seq_lens = np.array(starts, dtype=np.int64) + qlens
    rows = np.repeat(np.arange(len(qlens)), qlens)
    positions = np.arange(query_start[-1], dtype=np.int64) + (np.array(starts) - query_start[:-1])[rows]
    slots = table[rows, positions // block_size].astype(np.int64) * block_size + positions % block_size
    prompt_rows, targets, top_n = plan_rows(spans) if spans else (_NO_ROWS, _NO_ROWS, 0)
    return HostBatch(
        token_ids=np.array(tokens, dtype=np.int64),
        positions=positions,
        slots=slots,
        query_start=query_start.astype(np.int32),
        seq_lens=seq_lens.astype(np.int32),
        block_tables=table,
        logits_indices=query_start[1:][np.array(sample, dtype=bool)] - 1,
        query_lens=query_lens,
        seq_lens_list=seq_lens.tolist(),
        prompt_rows=prompt_rows,
        prompt_targets=targets,
        prompt_top_n=top_n,
        prompt_spans=tuple(spans),
    )


def _block_table(tables: list[list[int]]) -> np.ndarray:
    """Ragged block lists -> [B, W] int32 padded with the null block (row-major fill of a mask)."""
    lens = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    width = max(1, int(lens.max()))
    table = np.full((len(tables), width), NULL_BLOCK, dtype=np.int32)
    flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int32, count=int(lens.sum()))
    table[np.arange(width)[None, :] < lens[:, None]] = flat
    return table
