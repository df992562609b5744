"""ModelRunner: owns the device-side state of one engine (weights, the KV cache tensor, CUDA graphs) and turns a
SchedulerOutput into logits for the positions that sample.

It is the only place that builds device inputs. The KV cache is one tensor shaped by KVLayout.cache_shape.

A step, every step:

    SchedulerOutput --host_batch.build_host_batch--> HostBatch (numpy)               host, no device work
        decode-only and batch <= largest graph:  DecodeGraphs.run (pad to the bucket, replay)
        anything else:                            two packed non-blocking copies, then
            tokens <= prefill_graph_tokens (GPU):   PrefillGraphs.run (pieces replayed, attention eager)
            more tokens, or on CPU:                 eager forward
    -> hidden states of the sampling rows -> logits (float32), outside any graph
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from model_runtime.attention.base import (
    PER_PROMPT_MIN_TOKENS,
    AttentionBackend,
    AttentionMetadata,
    per_prompt_length,
)
from model_runtime.config import CacheConfig, ModelConfig, SchedulerConfig
from model_runtime.cuda_graphs import DecodeGraphs, graph_memory_estimate
from model_runtime.fused.base import FusedOps
from model_runtime.host_batch import HostBatch, HostBlockTables, build_host_batch
from model_runtime.kv_layout import FP8_KV_DTYPE, KVLayout
from model_runtime.kv_quant import split_fp8_cache
from model_runtime.models.llama import DecoderLayer, LlamaForCausalLM
from model_runtime.parallel.context import TensorParallel
from model_runtime.prefill_graphs import PiecewiseForward, PrefillGraphs
from model_runtime.prompt_scores import PromptScores, score_rows
from model_runtime.quantization.apply import quantize_model
from model_runtime.request import SchedulerOutput
from model_runtime.step_ahead import TokenFeed

log = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CACHE_TORCH_DTYPES = {**TORCH_DTYPES, FP8_KV_DTYPE: torch.float8_e4m3fn}  # by KVLayout.dtype
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


class _GraphProgress:
    """One progress count over both kinds of graphs: the decode graphs', then the prefill pieces'."""

    def __init__(self, report: Callable[[int, int], None] | None) -> None:
        self.report = report
        self.decode_total = 0
        self.prefill_total = 0

    def decode(self, done: int, total: int) -> None:
        self.decode_total = total
        if self.report is not None:
            self.report(done, total + self.prefill_total)

    def prefill(self, done: int, total: int) -> None:
        if self.report is not None:
            self.report(self.decode_total + done, self.decode_total + total)


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
        on_graph_progress: Callable[[int, int], None] | None = None,
        ops: FusedOps | None = None,
        tensor_parallel: TensorParallel | None = None,
        quantization: str = "none",
        fp8_fast_accum: bool = False,
        prefill_graph_tokens: int = 0,
        prefill_graph_kv_store: bool = False,
        max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens,
        on_phase: Callable[[str], None] | None = None,
    ) -> None:
        """`ops`: the fused elementwise kernels (model_runtime.fused); None is the torch reference.
        `tensor_parallel`: this runner is one rank of several (model_config and weights are the rank's
        share); None for one device. `quantization`: how `weights` were quantized
        (quantization.apply.quantize_weights), so the model holds them in that form; `fp8_fast_accum`: its FP8
        matmuls' accumulation (device.fp8_fast_accum). `prefill_graph_tokens`:
        the largest step with prompt chunks that replays piecewise graphs (with the decode graphs; 0: none);
        `prefill_graph_kv_store`: those graphs store the layers' K/V too (device.prefill_graph_kv_store).
        `max_num_batched_tokens`: the scheduler's step budget, the longest prompt chunk a step can hold (the
        per-prompt prefill attention's plans are built up to it, or up to max_model_len if that is shorter, at
        start-up). `on_phase`: told when that
        start-up work begins (the engine's start-up progress).

        `kv_cache` is the cache's storage, shaped as KVLayout.cache_shape (what transports move); `kv_pages` is
        the model's view of it, [L, 2, N, B, Hkv, D]: the same tensor, or an FP8 cache's codes, whose scales
        `kv_scales` [L, 2, N, B, Hkv] (None for other caches) view the same blocks (kv_quant)."""
        self.config = model_config
        self.layout = layout
        self.device = torch.device(device)
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = layout.blocks_for_tokens(max_model_len)
        with torch.device("meta"):
            model = LlamaForCausalLM(model_config, backend, rope_device=self.device, ops=ops)
        quantize_model(model, quantization, self.device, weights["embed_tokens.weight"].dtype, fp8_fast_accum)
        model.load_weights(weights)
        if tensor_parallel is not None:
            tensor_parallel.shard_model(model)
        self.tensor_parallel = tensor_parallel
        self.prompt_scores: PromptScores | None = None  # the last step's (take_prompt_scores)
        self.model = model.eval()
        self.kv_cache = torch.zeros(
            layout.cache_shape, dtype=CACHE_TORCH_DTYPES[layout.dtype], device=self.device
        )
        self.kv_pages, self.kv_scales = self.kv_cache, None
        if layout.quantized:
            self.kv_pages, self.kv_scales = split_fp8_cache(
                self.kv_cache, layout.block_size, layout.num_kv_heads, layout.head_dim
            )
            model.use_kv_scales(self.kv_scales)
        self._on_cuda = self.device.type == "cuda"
        self.backend = backend  # every layer's attention (bench/ttft.py switches its settings between modes)
        # A mixed step's decode rows that join its cached group (config.DECODE_GATHER_MAX_TOKENS).
        self.decode_gather_tokens = backend.decode_gather_tokens
        self.block_tables = HostBlockTables(self.max_blocks_per_seq, rows=2 * max_num_seqs)
        use_graphs = self._on_cuda and not enforce_eager
        pieces = prefill_graph_tokens if use_graphs else 0
        progress = _GraphProgress(on_graph_progress)
        self.prefill_graphs = self._make_prefill_graphs(pieces, progress, prefill_graph_kv_store)
        self.graphs = self._make_graphs(backend, progress) if use_graphs else None
        if self.prefill_graphs is not None:
            self.prefill_graphs.capture(progress.prefill)
        # No chunk is longer than the step budget, nor than a sequence may be.
        self._warm_prompt_attention(backend, min(max_num_batched_tokens, max_model_len), on_phase)
        self._warm_fp8_gather(backend)
        self._warm_chunk_attention(backend)

    def _warm_prompt_attention(
        self, backend: AttentionBackend, max_tokens: int, on_phase: Callable[[str], None] | None
    ) -> None:
        """Builds the per-prompt prefill attention's cuDNN plans for every length a step can call it at, on
        rows laid out as the model's (attention.packed_prefill): a plan built mid-run would hold up the step."""
        if not self._on_cuda or max_tokens < PER_PROMPT_MIN_TOKENS:
            return  # (a CPU engine does not import the Triton backend, nor what it imports: torch._dynamo)
        from model_runtime.attention.triton_backend import TritonAttention

        if not isinstance(backend, TritonAttention):
            return
        if on_phase is not None:
            on_phase("building the prefill attention's cuDNN plans")
        t0 = time.perf_counter()
        built = backend.prefill.warm_up(*self._attention_rows(per_prompt_length(max_tokens)), max_tokens)
        if built:
            log.info("prefill attention: %d cuDNN plans in %.1f s", built, time.perf_counter() - t0)

    def _warm_fp8_gather(self, backend: AttentionBackend) -> None:
        """Builds the Triton gather that a chunk over a cached prefix reads an FP8 cache with
        (attention.triton_gather): no start-up step runs such a chunk, and built mid-run it would hold up the
        first one. One variant serves every layer and step: its integer arguments are the cache's strides."""
        if not self._on_cuda or self.kv_scales is None:
            return
        from model_runtime.attention.triton_backend import TritonAttention
        from model_runtime.attention.triton_gather import gather_fp8_kv

        if not isinstance(backend, TritonAttention):
            return
        slots = torch.zeros(1, dtype=torch.int64, device=self.device)
        dtype = self.model.embed_tokens.weight.dtype
        gather_fp8_kv(self.kv_pages[0, 0], self.kv_pages[0, 1], self.kv_scales[0], slots, dtype)

    def _warm_chunk_attention(self, backend: AttentionBackend) -> None:
        """Builds the split-KV chunk kernels (attention.triton_chunk) that a chunk over a cached prefix runs, on q
        laid out as the model's rows and this cache's pages (an FP8 cache's scales too): no start-up step runs
        such a chunk."""
        if not self._on_cuda:
            return
        from model_runtime.attention import triton_chunk
        from model_runtime.attention.triton_backend import TritonAttention

        if not isinstance(backend, TritonAttention) or backend.chunk_attention_tokens <= 0:
            return
        scales = None if self.kv_scales is None else self.kv_scales[0]
        triton_chunk.warm_up(self._attention_rows(1)[0], self.kv_pages[0, 0], self.kv_pages[0, 1], scales)

    def _attention_rows(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of `rows` zero rows, laid out (strided) as the model's qkv projection lays them out: the
        kernels' start-up builds key on these shapes and strides."""
        layer = self.model.layers[0]
        assert isinstance(layer, DecoderLayer)
        attention = layer.attn
        dtype = self.model.embed_tokens.weight.dtype
        qkv = torch.zeros(rows, attention.q_size + 2 * attention.kv_size, dtype=dtype, device=self.device)
        return attention.heads(qkv)

    def _make_prefill_graphs(
        self, max_tokens: int, progress: _GraphProgress, kv_store: bool
    ) -> PrefillGraphs | None:
        """Built (not yet captured) before the decode graphs, so that the progress counts both; `kv_store`: the
        pieces store the layers' K/V (into this runner's cache)."""
        if max_tokens <= 0:
            return None
        reason = PiecewiseForward.unsupported(self.model)
        if reason is not None:
            log.info("piecewise prefill graphs off: %s", reason)
            return None
        graphs = PrefillGraphs(self.model, max_tokens, kv_pages=self.kv_pages if kv_store else None)
        progress.prefill_total = graphs.num_graphs
        return graphs

    def _make_graphs(self, backend: AttentionBackend, progress: _GraphProgress) -> DecodeGraphs | None:
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
            self.kv_pages,
            max_num_seqs=self.max_num_seqs,
            max_blocks_per_seq=self.max_blocks_per_seq,
            hidden_size=mc.hidden_size,
        )
        graphs.capture(progress.decode)
        # Activations are in the model dtype, whatever the cache's.
        activation_bytes = self.model.embed_tokens.weight.element_size()
        planned = graph_memory_estimate(mc, self.max_num_seqs, activation_bytes)
        if graphs.pool_bytes > planned:
            log.warning(
                "CUDA graph pool: %.0f MiB, more than the %.0f MiB memory planning set aside",
                graphs.pool_bytes / 2**20,
                planned / 2**20,
            )
        return graphs

    # --- inputs ----------------------------------------------------------------------------------------
    def prepare(self, out: SchedulerOutput) -> StepInputs:
        """Device inputs of an eager step."""
        return self._upload(build_host_batch(out, self.layout.block_size, self.block_tables))

    def _upload(self, batch: HostBatch) -> StepInputs:
        """Two copies: one int64 buffer (ids, positions, slots, logits rows, the mixed plan's indices), one
        int32 (query starts, seq lens, block tables, the plan's cumulative lengths); the tensors the model
        sees are views into them."""
        plan = batch.mixed_plan(self.layout.block_size, self.decode_gather_tokens)
        i64_parts = [batch.token_ids, batch.positions, batch.slots, batch.logits_indices]
        i32_parts = [batch.query_start, batch.seq_lens, batch.block_tables]
        own64, own32 = len(i64_parts), len(i32_parts)
        if plan is not None:
            i64_parts += plan.int64_arrays()
            i32_parts += plan.int32_arrays()
        i64, o64 = _pack(i64_parts, np.int64)
        i32, o32 = _pack(i32_parts, np.int32)
        d64, d32 = self._to_device(i64), self._to_device(i32)

        def view64(i: int) -> torch.Tensor:
            return d64[o64[i] : o64[i] + i64_parts[i].size]

        def view32(i: int) -> torch.Tensor:
            return d32[o32[i] : o32[i] + i32_parts[i].size]

        mixed = None
        if plan is not None:
            mixed = plan.bind(
                [view64(i) for i in range(own64, len(i64_parts))],
                [view32(i) for i in range(own32, len(i32_parts))],
            )
        meta = AttentionMetadata(
            slot_mapping=view64(2),
            query_start_loc=view32(0),
            seq_lens=view32(1),
            block_tables=view32(2).view(batch.block_tables.shape),
            query_lens_host=batch.query_lens,
            seq_lens_host=batch.seq_lens_list,
            max_query_len=max(batch.query_lens),
            max_seq_len=max(batch.seq_lens_list),
            mixed=mixed,
        )
        return StepInputs(view64(0), view64(1), meta, view64(3))

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        host = torch.from_numpy(array)
        if not self._on_cuda:
            return host
        # Pinned (from torch's caching host allocator, which keeps the block until the copy is done) so
        # the copy is asynchronous.
        return host.pin_memory().to(self.device, non_blocking=True)

    # --- execution -------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(
        self,
        out: SchedulerOutput,
        use_graphs: bool = True,
        layer_hook: Callable[[int], None] | None = None,
        feed: TokenFeed | None = None,
    ) -> torch.Tensor:
        """Run one step; returns float32 logits [num sampling chunks, vocab] in chunk order.

        `use_graphs=False` forces the eager path (tests and benchmarks compare the two). `layer_hook(n)` runs
        after the n-th layer's kernels were queued (a step with prompt chunks is eager, so it always runs).
        `feed`: input ids that are still on the device (step-ahead; model_runtime.step_ahead)."""
        batch = build_host_batch(out, self.layout.block_size, self.block_tables)
        if self.tensor_parallel is not None:  # the other ranks run this same batch, in lockstep
            if feed is not None:
                raise ValueError("ModelRunner.execute: step-ahead input ids cannot reach the other ranks")
            self.tensor_parallel.publish(batch)
        self.model.layer_hook = layer_hook
        try:
            return self.execute_batch(batch, use_graphs, feed)
        finally:
            self.model.layer_hook = None

    @torch.inference_mode()
    def execute_batch(
        self, batch: HostBatch, use_graphs: bool = True, feed: TokenFeed | None = None
    ) -> torch.Tensor:
        """Run a step already built on the host (`execute`'s, or the lead's on another tensor-parallel rank)."""
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
            hidden = self.graphs.run(batch.decode_rows(), feed)
            self._score_prompt(hidden, batch)
            if not batch.samples_every_row:
                hidden = hidden[self._to_device(batch.logits_indices)]
            return self._logits(hidden)
        inputs = self._upload(batch)
        if feed is not None:
            feed.apply(inputs.input_ids)
        pieces = self.prefill_graphs
        if use_graphs and pieces is not None and pieces.can_run(batch.num_tokens):
            hidden = pieces.run(inputs.input_ids, inputs.positions, self.kv_pages, inputs.meta)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_pages, inputs.meta)
        self._score_prompt(hidden, batch)
        if not batch.samples_every_row:
            hidden = hidden[inputs.logits_indices]
        return self._logits(hidden)

    def _score_prompt(self, hidden: torch.Tensor, batch: HostBatch) -> None:
        """The step's prompt scores (model_runtime.prompt_scores), kept for take_prompt_scores; every
        tensor-parallel rank computes them (their logits are gathered), only the lead keeps them."""
        if not batch.prompt_rows.size:
            return
        rows = self._to_device(batch.prompt_rows)
        targets = self._to_device(batch.prompt_targets)
        top_n = min(batch.prompt_top_n, self.config.vocab_size)
        scores = score_rows(hidden, rows, targets, top_n, self._logits)
        self.prompt_scores = PromptScores(batch.prompt_spans, scores)

    def take_prompt_scores(self) -> PromptScores | None:
        """The last step's prompt scores (device tensors), once; None when it scored nothing."""
        scores, self.prompt_scores = self.prompt_scores, None
        return scores

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.model.compute_logits(hidden)
        if self.tensor_parallel is None:
            return logits
        return self.tensor_parallel.gather_logits(logits)
