"""DecodeGraphs: the only source of truth for which decode CUDA graphs exist, and the only place that replays them.

A decode step launches hundreds of small kernels (about 15 per layer); at small batches the GPU waits on the
host's launches. A CUDA graph records one step per batch-size bucket at start-up and replays it with one launch.

Buckets: 1, 2, 4, then every multiple of 8 up to 256, then every multiple of 16, up to min(max_num_seqs, 512)
(that cap itself is always a bucket). They are captured largest first into one shared memory pool, so the
smaller graphs reuse the largest one's activation memory. A batch of n sequences replays the smallest bucket
b >= n; rows n..b-1 are padding that touches nothing:

    row      token  position  slot  seq_len  block table row
    live     t_i    p_i       s_i   p_i + 1  the sequence's blocks, then null blocks
    padding  0      0         -1    0        null blocks (0)      slot -1: the store kernel skips the row
                                                                   seq_len 0: the decode kernel writes zeros

Static device buffers (StaticDecodeInputs; their addresses are frozen into every graph, graph b reads rows [:b]):

    vectors       int64 [3, max_batch]                  row 0 token ids, row 1 positions, row 2 slots
    seq_lens      int32 [max_batch]
    block_tables  int32 [max_batch, max_blocks_per_seq]   a step copies only [:b, :W], W = its widest table;
                                                        columns past W are stale and never read (seq_len)
    query_start   int32 [max_batch + 1]                 0, 1, 2, ...: one token per sequence, constant
    hidden        dtype [max_batch, hidden_size]        the graph's output: final hidden states

Logits and sampling run outside the graph on the live rows. The captured region never syncs with the host and
never reads the metadata's host lists (the decode backend path uses device tensors and shapes only).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from model_runtime.attention.base import AttentionMetadata
from model_runtime.config import ModelConfig
from model_runtime.kv_layout import NULL_BLOCK
from model_runtime.step_ahead import TokenFeed

log = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 512
PAD_TOKEN = 0
PAD_POSITION = 0
PAD_SLOT = -1
PAD_SEQ_LEN = 0


# --- buckets and padding (pure, host side) ---------------------------------------------------------------
def graph_batch_sizes(max_num_seqs: int, limit: int = MAX_GRAPH_BATCH) -> tuple[int, ...]:
    """The captured batch sizes, ascending: 1, 2, 4, 8, 16, ..., 256 (step 8), 272, ... (step 16), up to
    min(max_num_seqs, limit), which is always included."""
    if max_num_seqs < 1 or limit < 1:
        raise ValueError(f"graph_batch_sizes: max_num_seqs ({max_num_seqs}) and limit ({limit}) must be >= 1")
    cap = min(max_num_seqs, limit)
    sizes = [1, 2, 4, *range(8, 257, 8), *range(272, cap + 1, 16)]
    return (*(s for s in sizes if s < cap), cap)


def bucket_for(num_seqs: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest size >= num_seqs, or None when the batch is larger than every bucket (it runs eagerly)."""
    if num_seqs < 1:
        raise ValueError(f"bucket_for: num_seqs must be >= 1, got {num_seqs}")
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


@dataclass(frozen=True)
class DecodeRows:
    """A decode-only step on the host: one token per sequence, row i is sequence i."""

    token_ids: np.ndarray  # [n] int64
    positions: np.ndarray  # [n] int64
    slots: np.ndarray  # [n] int64
    seq_lens: np.ndarray  # [n] int32
    block_tables: np.ndarray  # [n, W] int32, padded with the null block

    @property
    def num_seqs(self) -> int:
        return int(self.token_ids.shape[0])


def pad_decode_rows(rows: DecodeRows, size: int) -> DecodeRows:
    """`rows` followed by size - n padding rows (see the module docstring's table)."""
    n = rows.num_seqs
    if size < n:
        raise ValueError(f"pad_decode_rows: cannot pad {n} rows down to {size}")
    extra = size - n

    def pad(values: np.ndarray, fill: int) -> np.ndarray:
        return np.concatenate([values, np.full(extra, fill, dtype=values.dtype)])

    tables = np.full((size, rows.block_tables.shape[1]), NULL_BLOCK, dtype=np.int32)
    tables[:n] = rows.block_tables
    return DecodeRows(
        token_ids=pad(rows.token_ids, PAD_TOKEN),
        positions=pad(rows.positions, PAD_POSITION),
        slots=pad(rows.slots, PAD_SLOT),
        seq_lens=pad(rows.seq_lens, PAD_SEQ_LEN),
        block_tables=tables,
    )


def graph_memory_estimate(model: ModelConfig, max_num_seqs: int, dtype_bytes: int) -> int:
    """Bytes to set aside for the graph pool: one decode forward's activations at the largest bucket (kept
    generous, like the engine's activation estimate) plus room for the allocator's 2 MiB segments."""
    max_batch = graph_batch_sizes(max_num_seqs)[-1]
    per_token = (4 * model.hidden_size + 2 * model.q_size + 3 * model.intermediate_size) * dtype_bytes
    return 2 * max_batch * per_token + 64 * 2**20


# --- static buffers (any device) -------------------------------------------------------------------------
class StaticDecodeInputs:
    """The fixed-address buffers every decode graph reads and writes, and the staging that fills them.

    Device-agnostic (on CPU the staging is plain memory and the copies are synchronous), so the padded
    static-buffer path can be checked against the eager one without a GPU.
    """

    def __init__(
        self,
        max_batch: int,
        max_blocks_per_seq: int,
        block_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.max_batch = max_batch
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size = block_size
        b, dev = max_batch, device
        self.vectors = torch.zeros(3, b, dtype=torch.int64, device=dev)  # ids, positions, slots
        self.seq_lens = torch.zeros(b, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(b, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.query_start = torch.arange(b + 1, dtype=torch.int32, device=dev)
        self.hidden = torch.zeros(b, hidden_size, dtype=dtype, device=dev)
        # Staging reused every step (pinned on CUDA, so the copies are asynchronous); `_staged` marks when
        # the last step's copies have read it.
        pin = dev.type == "cuda"
        self._host_vectors = torch.zeros(3, b, dtype=torch.int64, pin_memory=pin)
        self._host_seq_lens = torch.zeros(b, dtype=torch.int32, pin_memory=pin)
        self._host_tables = torch.zeros(b * max_blocks_per_seq, dtype=torch.int32, pin_memory=pin)
        self._staged = torch.cuda.Event() if pin else None
        self.reset()

    def reset(self) -> None:
        """Every row padding: a forward over these buffers writes no KV and reads none."""
        self.vectors.zero_()
        self.vectors[2].fill_(PAD_SLOT)
        self.seq_lens.fill_(PAD_SEQ_LEN)
        self.block_tables.fill_(NULL_BLOCK)

    def input_ids(self, size: int) -> torch.Tensor:
        return self.vectors[0, :size]

    def positions(self, size: int) -> torch.Tensor:
        return self.vectors[1, :size]

    def meta(self, size: int) -> AttentionMetadata:
        # The host lists only give the shape (num_seqs == size, max_query_len == 1 selects the decode path);
        # their values are never read on that path.
        return AttentionMetadata(
            slot_mapping=self.vectors[2, :size],
            query_start_loc=self.query_start[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            query_lens_host=[1] * size,
            seq_lens_host=[PAD_SEQ_LEN] * size,
            max_query_len=1,
            max_seq_len=self.max_blocks_per_seq * self.block_size,
        )

    def stage(self, padded: DecodeRows) -> None:
        """Host rows -> staging -> the static buffers: three non-blocking copies on the current stream."""
        size, width = padded.block_tables.shape
        if size > self.max_batch or width > self.max_blocks_per_seq:
            raise ValueError(
                f"StaticDecodeInputs.stage: {size} rows x {width} blocks exceed the buffers' "
                f"{self.max_batch} x {self.max_blocks_per_seq}"
            )
        if self._staged is not None:
            self._staged.synchronize()
        vectors = self._host_vectors.numpy()
        vectors[0, :size] = padded.token_ids
        vectors[1, :size] = padded.positions
        vectors[2, :size] = padded.slots
        self._host_seq_lens.numpy()[:size] = padded.seq_lens
        host_tables = self._host_tables[: size * width].view(size, width)
        host_tables.numpy()[:] = padded.block_tables
        # Whole vectors (a few KiB): entries past `size` are stale, and graph `size` never reads them.
        self.vectors.copy_(self._host_vectors, non_blocking=True)
        self.seq_lens.copy_(self._host_seq_lens, non_blocking=True)
        self.block_tables[:size, :width].copy_(host_tables, non_blocking=True)
        if self._staged is not None:
            self._staged.record()


# --- capture and replay (CUDA) ---------------------------------------------------------------------------
class DecodeGraphs:
    """Decode CUDA graphs of `model` over `kv_cache`, one per bucket; call `capture()` once, then `run()`.

    The attention backend's scratch must already be reserved for max_num_seqs (TritonAttention.reserve):
    a later growth would free memory the graphs still point at.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: torch.Tensor,
        *,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        hidden_size: int,
        limit: int = MAX_GRAPH_BATCH,
    ) -> None:
        if kv_cache.device.type != "cuda":
            raise ValueError(f"DecodeGraphs: CUDA graphs need a CUDA kv_cache, got {kv_cache.device}")
        self.model = model
        self.kv_cache = kv_cache
        self.sizes = graph_batch_sizes(max_num_seqs, limit)
        self.max_batch = self.sizes[-1]
        self.device = kv_cache.device
        block_size = kv_cache.shape[3]  # [L, 2, N, B, H, D]
        hidden_dtype = next(model.parameters()).dtype  # the model's, which the cache's may not be
        self.static = StaticDecodeInputs(
            self.max_batch, max_blocks_per_seq, block_size, hidden_size, hidden_dtype, self.device
        )
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool_bytes = 0  # what capture added to the allocator's reserved memory
        self.num_replays = 0

    def can_run(self, num_seqs: int) -> bool:
        return bool(self._graphs) and 1 <= num_seqs <= self.max_batch

    @torch.inference_mode()
    def capture(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Capture every bucket, largest first, into one pool; a warm-up run before each capture does the
        Triton JIT and cuBLAS set-up outside the captured region. `progress(captured, total)` after each."""
        self.static.reset()
        pool = torch.cuda.graph_pool_handle()
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_reserved(self.device)
        for size in reversed(self.sizes):
            self._forward(size)  # warm-up; all rows are padding, so the cache is not touched
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(size)
            self._graphs[size] = graph
            if progress is not None:
                progress(len(self._graphs), len(self.sizes))
        torch.cuda.synchronize(self.device)
        self.pool_bytes = torch.cuda.memory_reserved(self.device) - before
        log.info(
            "captured %d decode CUDA graphs (batch %d..%d), pool %.1f MiB",
            len(self.sizes),
            self.sizes[0],
            self.max_batch,
            self.pool_bytes / 2**20,
        )

    def _forward(self, size: int) -> None:
        st = self.static
        st.hidden[:size] = self.model(st.input_ids(size), st.positions(size), self.kv_cache, st.meta(size))

    def run(self, rows: DecodeRows, feed: TokenFeed | None = None) -> torch.Tensor:
        """Replay the bucket for `rows`; returns the live rows' final hidden states [n, hidden_size].

        The result is a view of the static output buffer: the next run overwrites it, so use it (logits)
        before running again.
        """
        n = rows.num_seqs
        size = bucket_for(n, self.sizes)
        if size is None or size not in self._graphs:
            raise ValueError(f"DecodeGraphs.run: no graph for {n} sequences (captured: {self.sizes})")
        self.static.stage(pad_decode_rows(rows, size))
        if feed is not None:  # ids still on the device (step-ahead), over the staged placeholders
            feed.apply(self.static.input_ids(size))
        self._graphs[size].replay()
        self.num_replays += 1
        return self.static.hidden[:n]
