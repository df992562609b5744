"""PrefillGraphs: CUDA graphs for steps with prompt chunks, everything but attention (piecewise graphs).

Why: an eager step queues about 14 kernels per layer from Python (about 450 for Llama-3-8B, over 700 in a step
that mixes a prompt with decodes), at 20-50 us of host time each. On an H200 a 320-token prompt behind a cached
2k-token prefix had 12 ms of kernels but took 22 ms alone and 43 ms beside one decoding request (bench/ttft.py
--background 1): the GPU waited for Python. Attention is the part a graph cannot hold: its varlen kernel takes
its grid from host values (the longest chunk) and a cached prefix is gathered by slot. So each layer's attention
runs eagerly, and everything between two attentions is one graph:

    piece 0      embed -> layer 0: input norm, qkv, rotary                          -> QKV, RESIDUAL
    attention 0  store K/V, attend (eager, live rows only)                          -> ATTN
    piece i      layer i-1: o_proj, add+norm, MLP; layer i: add+norm, qkv, rotary    -> QKV, RESIDUAL
    ...          (attention i, piece i+1, ...)
    piece L      layer L-1: o_proj, add+norm, MLP; the final add+norm                -> HIDDEN

With the KV store in the pieces (device.prefill_graph_kv_store), piece i also stores layer i's new K/V rows (after
rotary) at SLOTS, inside its graph, and attention i only attends: one eager launch fewer per layer, 37-55 us of
host time each on an H200 (bench/diag/mixed_host_cost.py). SLOTS holds the step's slot mapping in rows [:n] and
-1 (skip) in the padding rows, so a padding row never writes the cache.

One graph per piece and token-count bucket (prefill_graph_sizes), captured at start-up largest bucket first
into one pool. A step of n tokens replays bucket b >= n; rows n..b-1 are padding. Every captured op is
row-wise (projections, norms, rotary, SiLU, FP8 activation scales per token), so a padding row never changes a
live one, and the attention, the only op that mixes rows and the only one that writes the KV cache, sees the
live rows only (or, with the store in the pieces, the store skips them by their slot, -1). Padding rows hold
whatever earlier steps left (finite values: token ids and positions of earlier steps, zeros at first).

Static buffers (StaticPrefillBuffers; their addresses are frozen into every graph, bucket b uses rows [:b]):

    ids, positions  int64 [max_tokens]
    slots           int64 [max_tokens]             the step's cache slots, -1 past its rows (KV store in pieces)
    qkv             dtype [max_tokens, q + 2 kv]   queries and keys after rotary, values
    attn            dtype [max_tokens, q]          the attention's output, written by the eager part
    residual        dtype [max_tokens, hidden]     the residual stream between pieces
    hidden          dtype [max_tokens, hidden]     final hidden states (the step's output)

A tensor-parallel rank's model is cut the same way: its attention and MLP blocks end in all-reduces
(parallel.layers.AllReduceOutput), and its embedding in one, so piece i all-reduces layer i-1's o_proj output
(the attention block's reduction, moved after the eager attention) and calls the MLP and the embedding as they
are. Every rank replays the same bucket of the same step (the lead's batch), so the collectives pair up; NCCL
collectives are captured in the graphs as in the decode graphs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from model_runtime.attention.base import AttentionMetadata
from model_runtime.config import ModelConfig
from model_runtime.cuda_graphs import bucket_for
from model_runtime.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM, norm_rows
from model_runtime.parallel.group import TPGroup
from model_runtime.parallel.layers import AllReduceOutput, VocabParallelEmbedding

log = logging.getLogger(__name__)

_SIZES = (16, 32, 64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048)


def prefill_graph_sizes(max_tokens: int) -> tuple[int, ...]:
    """The captured token counts, ascending, up to max_tokens (always the last one)."""
    if max_tokens < 1:
        raise ValueError(f"prefill_graph_sizes: max_tokens must be >= 1, got {max_tokens}")
    return (*(s for s in _SIZES if s < max_tokens), max_tokens)


def prefill_graph_memory_estimate(model: ModelConfig, max_tokens: int, dtype_bytes: int) -> int:
    """Bytes the static buffers and the graphs' private pool take: the buffers plus one piece's activations at
    the largest bucket (an MLP's gate/up product dominates), kept generous, plus the allocator's segments."""
    static = max_tokens * (2 * model.hidden_size + 2 * model.q_size + 2 * model.kv_size) * dtype_bytes
    per_token = 2 * model.hidden_size + model.q_size + 2 * model.kv_size + 3 * model.intermediate_size
    return static + 2 * max_tokens * per_token * dtype_bytes + 16 * max_tokens + 64 * 2**20


class StaticPrefillBuffers:
    """The fixed-address tensors every piece reads and writes (see the module docstring)."""

    def __init__(self, model: ModelConfig, max_tokens: int, dtype: torch.dtype, device: torch.device) -> None:
        t = max_tokens
        self.ids = torch.zeros(t, dtype=torch.int64, device=device)
        self.positions = torch.zeros(t, dtype=torch.int64, device=device)
        self.slots = torch.full((t,), -1, dtype=torch.int64, device=device)
        self.qkv = torch.zeros(t, model.q_size + 2 * model.kv_size, dtype=dtype, device=device)
        self.attn = torch.zeros(t, model.q_size, dtype=dtype, device=device)
        self.residual = torch.zeros(t, model.hidden_size, dtype=dtype, device=device)
        self.hidden = torch.zeros(t, model.hidden_size, dtype=dtype, device=device)


def _unwrap(block: nn.Module, kind: type[nn.Module]) -> nn.Module | None:
    """`block` itself, or what its tensor-parallel all-reduce wraps, when that is a `kind`; None otherwise."""
    inner = block.inner if isinstance(block, AllReduceOutput) else block
    return inner if type(inner) is kind else None


def _keep(static: torch.Tensor, value: torch.Tensor) -> None:
    """Make `static` hold `value`: a no-op when the op already wrote in place (the Triton kernels do)."""
    if value.data_ptr() != static.data_ptr():
        static.copy_(value)


class PiecewiseForward:
    """The model's forward cut at its attentions, over static buffers. Device-agnostic: `piece(i, size)` runs
    eagerly anywhere (the CPU tests check the cut and the padding against the model's own forward), and
    PrefillGraphs captures the same calls on a GPU."""

    def __init__(
        self, model: LlamaForCausalLM, max_tokens: int, kv_pages: torch.Tensor | None = None
    ) -> None:
        """`kv_pages` (the runner's [L, 2, N, B, Hkv, D] cache): store each layer's K/V in its piece (see the
        module docstring); None: the eager attention stores them."""
        reason = self.unsupported(model)
        if reason is not None:
            raise ValueError(f"PiecewiseForward: {reason}")
        self.model = model
        self.kv_pages = kv_pages
        weight = model.embed_tokens.weight
        self.static = StaticPrefillBuffers(model.config, max_tokens, weight.dtype, weight.device)
        self.layers = [cast(DecoderLayer, layer) for layer in model.layers]
        self.attns = [cast(Attention, _unwrap(layer.attn, Attention)) for layer in self.layers]
        # The group that sums each attention block's partial o_proj output (tensor parallelism), or None.
        self.groups: list[TPGroup | None] = [
            layer.attn.group if isinstance(layer.attn, AllReduceOutput) else None for layer in self.layers
        ]
        self.num_pieces = len(self.layers) + 1
        first = self.attns[0]
        self._q, self._kv = first.q_size, first.kv_size
        self._heads, self._kv_heads, self._head_dim = first.num_heads, first.num_kv_heads, first.head_dim

    @staticmethod
    def unsupported(model: nn.Module) -> str | None:
        """Why `model` cannot be cut here (None: it can)."""
        if not isinstance(model, LlamaForCausalLM) or len(model.layers) == 0:
            return "needs a LlamaForCausalLM with at least one layer"
        if type(model.embed_tokens) not in (nn.Embedding, VocabParallelEmbedding):
            return f"an embedding of type {type(model.embed_tokens).__name__} is not one it knows"
        for layer in cast(list[DecoderLayer], list(model.layers)):
            if _unwrap(layer.attn, Attention) is None or _unwrap(layer.mlp, MLP) is None:
                return "a layer's attention or MLP is neither the model's own nor its all-reduced form"
        return None

    def _views(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.static.qkv[:size].split([self._q, self._kv, self._kv], dim=-1)
        return (
            q.view(size, self._heads, self._head_dim),
            k.view(size, self._kv_heads, self._head_dim),
            v.view(size, self._kv_heads, self._head_dim),
        )

    def piece(self, i: int, size: int) -> None:
        """Piece i over rows [:size] of the static buffers (see the module docstring's picture)."""
        m, st, layers = self.model, self.static, self.layers
        ops, residual = m.ops, st.residual[:size]
        if i == 0:
            hidden = m.embed_tokens(st.ids[:size])
            normed, _ = norm_rows(ops, layers[0].input_norm, hidden, None)
            residual.copy_(hidden)
        else:
            prev = layers[i - 1]
            hidden = self.attns[i - 1].o_proj(st.attn[:size])
            group = self.groups[i - 1]
            if group is not None:
                hidden = group.all_reduce(hidden)
            normed, stream = norm_rows(ops, prev.post_attn_norm, hidden, residual)
            hidden = prev.mlp(normed)
            if i == len(layers):
                final, _ = ops.add_rms_norm(hidden, stream, m.norm.weight, m.norm.eps)
                st.hidden[:size].copy_(final)
                return
            normed, stream = norm_rows(ops, layers[i].input_norm, hidden, stream)
            _keep(residual, stream)
        st.qkv[:size].copy_(self.attns[i].qkv(normed))
        q, k, v = self._views(size)
        rq, rk = m.rope(ops, st.positions[:size], q, k)
        _keep(q, rq)
        _keep(k, rk)
        if self.kv_pages is not None:
            attn = self.attns[i]
            pages = self.kv_pages[i]
            attn.backend.store(k, v, pages[0], pages[1], st.slots[:size], attn.kv_scale)

    def attention(self, i: int, n: int, kv_pages: torch.Tensor, meta: AttentionMetadata) -> None:
        """Layer i's attention over the live rows [:n], eagerly: stores their K/V (unless piece i did) and
        writes ATTN[:n]."""
        attn = self.attns[i]
        q, k, v = self._views(n)
        stored = self.kv_pages is not None  # piece i stored them
        out = attn.backend.forward(
            q, k, v, kv_pages[i, 0], kv_pages[i, 1], meta, attn.scale, attn.kv_scale, stored=stored
        )
        self.static.attn[:n].copy_(out.reshape(n, self._q))

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_pages: torch.Tensor,
        meta: AttentionMetadata,
        size: int,
        replay: Callable[[int], None],
    ) -> torch.Tensor:
        """The step's final hidden states [n, hidden] (a view of HIDDEN: use it before the next run).
        `replay(i)` runs piece i at bucket `size` (a graph, or the piece itself)."""
        n, st = input_ids.shape[0], self.static
        st.ids[:n].copy_(input_ids)
        st.positions[:n].copy_(positions)
        if self.kv_pages is not None:
            if kv_pages.data_ptr() != self.kv_pages.data_ptr():
                raise ValueError(
                    "PiecewiseForward.run: the pieces store into another KV cache than this step's"
                )
            st.slots[:n].copy_(meta.slot_mapping)
            st.slots[n:size].fill_(-1)
        hook = self.model.layer_hook
        replay(0)
        for i in range(len(self.layers)):
            self.attention(i, n, kv_pages, meta)
            replay(i + 1)  # ends layer i: its MLP
            if hook is not None:
                hook(i + 1)
        return st.hidden[:n]


class PrefillGraphs:
    """The only source of truth for which piecewise prefill graphs exist, and the only place that replays them.
    `capture()` once (CUDA), then `run()` for any step of at most `max_tokens` tokens. With `use_graphs=False`
    (any device) `run()` calls the pieces directly: the same buffers and padding, no graphs."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        max_tokens: int,
        *,
        use_graphs: bool = True,
        kv_pages: torch.Tensor | None = None,
    ) -> None:
        """`kv_pages`: the cache the pieces store each layer's K/V into (device.prefill_graph_kv_store); None:
        the eager attentions store them."""
        self.forward = PiecewiseForward(model, max_tokens, kv_pages)
        self.sizes = prefill_graph_sizes(max_tokens)
        self.max_tokens = max_tokens
        self.use_graphs = use_graphs
        self._graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.pool_bytes = 0
        self.num_runs = 0

    @property
    def num_graphs(self) -> int:
        return len(self.sizes) * self.forward.num_pieces

    def can_run(self, num_tokens: int) -> bool:
        return 1 <= num_tokens <= self.max_tokens and (bool(self._graphs) or not self.use_graphs)

    @torch.inference_mode()
    def capture(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Every piece of every bucket, largest bucket first, into one pool; each piece runs once before its
        capture (Triton JIT and autotuning, cuBLAS set-up). `progress(captured, total)` after each bucket."""
        device = self.forward.static.ids.device
        pool = torch.cuda.graph_pool_handle()
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_reserved(device)
        done = 0
        for size in reversed(self.sizes):
            graphs = []
            for i in range(self.forward.num_pieces):
                self.forward.piece(i, size)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.forward.piece(i, size)
                graphs.append(graph)
            self._graphs[size] = graphs
            done += len(graphs)
            if progress is not None:
                progress(done, self.num_graphs)
        torch.cuda.synchronize(device)
        self.pool_bytes = torch.cuda.memory_reserved(device) - before
        log.info(
            "captured %d piecewise prefill CUDA graphs (%d pieces x %d token counts, %d..%d), pool %.1f MiB",
            self.num_graphs,
            self.forward.num_pieces,
            len(self.sizes),
            self.sizes[0],
            self.max_tokens,
            self.pool_bytes / 2**20,
        )

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_pages: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Final hidden states [n, hidden] of a step of n = len(input_ids) tokens (a view of the static
        output: use it before the next run)."""
        n = int(input_ids.shape[0])
        if not self.can_run(n):
            raise ValueError(f"PrefillGraphs.run: no graphs for {n} tokens (captured: {self.sizes})")
        size = bucket_for(n, self.sizes)
        assert size is not None  # can_run: n <= max_tokens, the last size
        if self.use_graphs:
            graphs = self._graphs[size]

            def replay(piece: int) -> None:
                graphs[piece].replay()

        else:

            def replay(piece: int) -> None:
                self.forward.piece(piece, size)

        self.num_runs += 1
        return self.forward.run(input_ids, positions, kv_pages, meta, size, replay)
