"""ModelRunner: owns the device-side state of one engine (weights, the KV cache tensor, CUDA graphs) and turns a
SchedulerOutput into logits for the positions that sample.

It is the only place that builds device inputs. The KV cache is one tensor shaped by KVLayout.cache_shape.

A step, every step:

    SchedulerOutput --build_host_batch--> HostBatch (numpy)                          host, no device work
        decode-only and batch <= largest graph:  DecodeGraphs.run (pad to the bucket, replay)
        anything else (prefill, mixed, CPU):      two packed non-blocking copies, eager forward
    -> hidden states of the sampling rows -> logits (float32), outside any graph
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import numpy as np
import torch

from model_runtime.attention.base import AttentionBackend, AttentionMetadata
from model_runtime.config import CacheConfig, ModelConfig, SchedulerConfig
from model_runtime.cuda_graphs import DecodeGraphs, DecodeRows
from model_runtime.kv_layout import NULL_BLOCK, KVLayout
from model_runtime.models.llama import LlamaForCausalLM
from model_runtime.request import Request, SchedulerOutput

log = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Packed segments start on 16-byte boundaries: Triton specializes kernels on pointer alignment, and an
# unaligned view would compile (and later hit) a second variant of every kernel.
_ALIGN_BYTES = 16


class OutOfMemoryPlan(RuntimeError):
    """The model and a minimal KV cache do not fit; the message says what to change."""


def plan_num_blocks(
    model_config: ModelConfig,
    cache: CacheConfig,
    block_size_bytes: int,
    device: str,
    activation_bytes: int = 0,
) -> int:
    """How many KV blocks fit: an explicit cache.num_blocks wins; on CPU `cpu_cache_bytes`; on GPU what is left
    of `gpu_memory_utilization` x total memory after weights (already allocated) and the activation peak.

    `activation_bytes` covers everything allocated after the cache: the eager step's activations and, with
    CUDA graphs, their private pool (cuda_graphs.graph_memory_estimate), which the eager steps cannot reuse.
    """
    if cache.num_blocks is not None:
        return cache.num_blocks
    if device == "cpu":
        return max(2, cache.cpu_cache_bytes // block_size_bytes)
    free, total = torch.cuda.mem_get_info(torch.device(device))
    used_by_others = total - free - torch.cuda.memory_reserved(torch.device(device))
    budget = int(total * cache.gpu_memory_utilization) - used_by_others
    budget -= torch.cuda.memory_allocated(torch.device(device)) + activation_bytes
    num_blocks = budget // block_size_bytes
    if num_blocks < 2:
        raise OutOfMemoryPlan(
            f"no room for the KV cache on {device}: {total / 2**30:.1f} GiB total, weights and activations use "
            f"{(total - budget) / 2**30:.1f} GiB at gpu_memory_utilization={cache.gpu_memory_utilization}. "
            "Raise cache.gpu_memory_utilization, lower scheduler.max_num_batched_tokens, or use a smaller model."
        )
    return int(num_blocks)


# --- host side: one step's inputs as numpy arrays ----------------------------------------------------------
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

    def decode_rows(self) -> DecodeRows:
        if not self.decode_only:
            raise ValueError("HostBatch.decode_rows: the step has a chunk of more than one token")
        return DecodeRows(self.token_ids, self.positions, self.slots, self.seq_lens, self.block_tables)


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
    for chunk in out.chunks:
        req, start = chunk.request, chunk.request.num_computed_tokens
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
    )


def _block_table(tables: list[list[int]]) -> np.ndarray:
    """Ragged block lists -> [B, W] int32 padded with the null block (row-major fill of a mask)."""
    lens = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    width = max(1, int(lens.max()))
    table = np.full((len(tables), width), NULL_BLOCK, dtype=np.int32)
    flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int32, count=int(lens.sum()))
    table[np.arange(width)[None, :] < lens[:, None]] = flat
    return table


def _pack(parts: list[np.ndarray], dtype: type) -> tuple[np.ndarray, list[int]]:
    """Concatenate 1-D arrays into one buffer (one host-to-device copy); returns it and each part's offset."""
    align = _ALIGN_BYTES // np.dtype(dtype).itemsize
    offsets, total = [], 0
    for part in parts:
        offsets.append(total)
        total += -(-part.size // align) * align
    packed: np.ndarray = np.zeros(total, dtype=dtype)
    for part, at in zip(parts, offsets):
        packed[at : at + part.size] = part.ravel()
    return packed, offsets


# --- device side -------------------------------------------------------------------------------------------
@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the step's hidden states that sample


class ModelRunner:
    """Weights, the KV cache and the decode CUDA graphs of one engine.

    `max_num_seqs` is the scheduler's limit: graphs and attention scratch are sized for it, and a step with
    more sequences is refused while graphs exist (an eager step past it would regrow scratch the graphs
    point at). `enforce_eager` turns CUDA graphs off; they are also off on CPU and for backends other than
    Triton (the torch reference gathers whole block tables, which a graph would pin at max_model_len).
    """

    def __init__(
        self,
        model_config: ModelConfig,
        weights: dict[str, torch.Tensor],
        layout: KVLayout,
        device: str,
        backend: AttentionBackend,
        max_model_len: int,
        *,
        max_num_seqs: int = SchedulerConfig.max_num_seqs,
        enforce_eager: bool = False,
    ) -> None:
        self.config = model_config
        self.layout = layout
        self.device = torch.device(device)
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = layout.blocks_for_tokens(max_model_len)
        with torch.device("meta"):
            model = LlamaForCausalLM(model_config, backend, rope_device=self.device)
        model.load_weights(weights)
        self.model = model.eval()
        self.kv_cache = torch.zeros(layout.cache_shape, dtype=TORCH_DTYPES[layout.dtype], device=self.device)
        self._on_cuda = self.device.type == "cuda"
        self.block_tables = HostBlockTables(self.max_blocks_per_seq, rows=2 * max_num_seqs)
        self.graphs = self._make_graphs(backend) if self._on_cuda and not enforce_eager else None

    def _make_graphs(self, backend: AttentionBackend) -> DecodeGraphs | None:
        if backend.name != "triton":
            log.info("CUDA graphs off: attention backend %r is not graph-safe", backend.name)
            return None
        from model_runtime.attention.triton_backend import TritonAttention

        if not isinstance(backend, TritonAttention):
            return None
        mc = self.config
        backend.reserve(self.max_num_seqs, mc.num_heads, mc.num_kv_heads, mc.head_dim, self.device)
        graphs = DecodeGraphs(
            self.model,
            self.kv_cache,
            max_num_seqs=self.max_num_seqs,
            max_blocks_per_seq=self.max_blocks_per_seq,
            hidden_size=mc.hidden_size,
        )
        graphs.capture()
        return graphs

    # --- inputs ----------------------------------------------------------------------------------------
    def prepare(self, out: SchedulerOutput) -> StepInputs:
        """Device inputs of an eager step."""
        return self._upload(build_host_batch(out, self.layout.block_size, self.block_tables))

    def _upload(self, batch: HostBatch) -> StepInputs:
        """Two copies: one int64 buffer (ids, positions, slots, logits rows), one int32 (query starts,
        seq lens, block tables); the tensors the model sees are views into them."""
        t, b = batch.num_tokens, batch.num_seqs
        i64, o64 = _pack([batch.token_ids, batch.positions, batch.slots, batch.logits_indices], np.int64)
        i32, o32 = _pack([batch.query_start, batch.seq_lens, batch.block_tables], np.int32)
        d64, d32 = self._to_device(i64), self._to_device(i32)
        meta = AttentionMetadata(
            slot_mapping=d64[o64[2] : o64[2] + t],
            query_start_loc=d32[: b + 1],
            seq_lens=d32[o32[1] : o32[1] + b],
            block_tables=d32[o32[2] : o32[2] + batch.block_tables.size].view(batch.block_tables.shape),
            query_lens_host=batch.query_lens,
            seq_lens_host=batch.seq_lens_list,
            max_query_len=max(batch.query_lens),
            max_seq_len=max(batch.seq_lens_list),
        )
        s = int(batch.logits_indices.shape[0])
        return StepInputs(d64[:t], d64[o64[1] : o64[1] + t], meta, d64[o64[3] : o64[3] + s])

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        host = torch.from_numpy(array)
        if not self._on_cuda:
            return host
        # Pinned (from torch's caching host allocator, which keeps the block until the copy is done) so
        # the copy is asynchronous.
        return host.pin_memory().to(self.device, non_blocking=True)

    # --- execution -------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, use_graphs: bool = True) -> torch.Tensor:
        """Run one step; returns float32 logits [num sampling chunks, vocab] in chunk order.

        `use_graphs=False` forces the eager path (tests and benchmarks compare the two)."""
        batch = build_host_batch(out, self.layout.block_size, self.block_tables)
        if self.graphs is not None and batch.num_seqs > self.max_num_seqs:
            raise ValueError(
                f"ModelRunner: a step of {batch.num_seqs} sequences exceeds max_num_seqs={self.max_num_seqs}, "
                "which sized the CUDA graphs and attention scratch; pass scheduler.max_num_seqs to the runner"
            )
        if (
            use_graphs
            and self.graphs is not None
            and batch.decode_only
            and self.graphs.can_run(batch.num_seqs)
        ):
            hidden = self.graphs.run(batch.decode_rows())
            if not batch.samples_every_row:
                hidden = hidden[self._to_device(batch.logits_indices)]
            return self.model.compute_logits(hidden)
        inputs = self._upload(batch)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta)
        if not batch.samples_every_row:
            hidden = hidden[inputs.logits_indices]
        return self.model.compute_logits(hidden)
