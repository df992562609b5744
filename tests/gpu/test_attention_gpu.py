"""Triton attention on a CUDA GPU against the torch reference: decode kernel, store, CUDA graphs, prefill path.

References run in fp32 on the same (bf16-rounded) inputs. Outputs are poisoned with NaN before each run, block
tables are random permutations, and some batches carry padding rows (seq_len 0) that must come back as zeros.
"""

from __future__ import annotations

import pytest
import torch

from model_runtime.attention.base import AttentionMetadata, store_kv
from model_runtime.attention.torch_ref import TorchAttention, paged_attention_ref
from tests.unit.paged_inputs import step_meta

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-4}
DEV = "cuda"


def _triton():
    from model_runtime.attention.triton_backend import TritonAttention

    return TritonAttention


def random_tables(
    gen: torch.Generator,
    seq_lens: list[int],
    block_size: int,
    num_blocks: int | None = None,
    width: int | None = None,
) -> tuple[torch.Tensor, int]:
    """Scattered block ids (drawn from a permutation of 1..N-1) per sequence, padded with the null block 0."""
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = num_blocks or sum(need) + 5
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1
    table = torch.zeros(len(seq_lens), width or max(1, max(need)) + 2, dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[at : at + n]
        at += n
    return table.to(DEV), num_blocks


def slots_for(
    table: torch.Tensor, seq_lens: list[int], query_lens: list[int], block_size: int
) -> torch.Tensor:
    rows = table.cpu().tolist()
    slots = []
    for blocks, s, n in zip(rows, seq_lens, query_lens):
        slots += [
            blocks[p // block_size] * block_size + p % block_size if s > 0 else -1 for p in range(s - n, s)
        ]
    return torch.tensor(slots, dtype=torch.int64, device=DEV)


def paged_inputs(seed, seq_lens, query_lens, kv_heads, group, head_dim, block_size, dtype, gather=0):
    gen = torch.Generator().manual_seed(seed)
    table, num_blocks = random_tables(gen, seq_lens, block_size)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    kc = torch.randn(shape, generator=gen).to(DEV, dtype)
    vc = torch.randn(shape, generator=gen).to(DEV, dtype)
    t = sum(query_lens)
    q = torch.randn(t, kv_heads * group, head_dim, generator=gen).to(DEV, dtype)
    k = torch.randn(t, kv_heads, head_dim, generator=gen).to(DEV, dtype)
    v = torch.randn(t, kv_heads, head_dim, generator=gen).to(DEV, dtype)
    meta = step_meta(
        seq_lens, query_lens, table, slots_for(table, seq_lens, query_lens, block_size), block_size, gather
    )
    return q, k, v, kc, vc, meta


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6))


def check_decode_rows(
    out: torch.Tensor, q, kc, vc, meta: AttentionMetadata, scale: float, tol: float
) -> None:
    live = torch.tensor([s > 0 for s in meta.seq_lens_host], device=DEV)
    safe = step_meta(
        [max(1, s) for s in meta.seq_lens_host], [1] * meta.num_seqs, meta.block_tables, meta.slot_mapping
    )
    ref = paged_attention_ref(q.float(), kc.float(), vc.float(), safe, scale)
    assert not out.isnan().any(), "NaN left in the output (a row was never written)"
    assert rel_err(out[live], ref[live]) < tol
    assert (out[~live] == 0).all(), "padding rows (seq_len 0) must be zeros"


def decode_seq_lens(batch: int, ctx: int, seed: int, pad_every: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, ctx + 1, (batch,), generator=gen).tolist()
    lens[0] = ctx
    if pad_every:
        lens = [0 if i % pad_every == pad_every - 1 else s for i, s in enumerate(lens)]
    return lens


GRID = [(b, c) for b in (1, 7, 64) for c in (1, 17, 512, 4096)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(("batch", "ctx"), GRID, ids=[f"b{b}-ctx{c}" for b, c in GRID])
def test_decode_matches_reference(batch: int, ctx: int, dtype: torch.dtype) -> None:
    i = GRID.index((batch, ctx))
    block_size, group = (16, 32, 64)[i % 3], (1, 2, 4, 8)[i % 4]
    seq_lens = decode_seq_lens(batch, ctx, seed=i, pad_every=3 if batch > 1 else 0)
    q, _, _, kc, vc, meta = paged_inputs(i, seq_lens, [1] * batch, 2, group, 128, block_size, dtype)
    out = _triton()().decode(q, kc, vc, meta.block_tables, meta.seq_lens, 0.088)
    check_decode_rows(out, q, kc, vc, meta, 0.088, TOL[dtype])


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_decode_shapes_bf16(block_size: int, group: int, head_dim: int) -> None:
    seq_lens = decode_seq_lens(7, 1000, seed=block_size + group, pad_every=4)
    q, _, _, kc, vc, meta = paged_inputs(3, seq_lens, [1] * 7, 4, group, head_dim, block_size, torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    from model_runtime.attention.decode_plan import DecodeWorkspace
    from model_runtime.attention.triton_decode import decode_attention

    decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, head_dim**-0.5, out, DecodeWorkspace(), 8)
    check_decode_rows(out, q, kc, vc, meta, head_dim**-0.5, TOL[torch.bfloat16])


@pytest.mark.parametrize("segments", [1, 2, 16, 64])
def test_decode_fixed_segment_counts(segments: int) -> None:
    seq_lens = decode_seq_lens(5, 4096, seed=segments, pad_every=5)
    q, _, _, kc, vc, meta = paged_inputs(segments, seq_lens, [1] * 5, 8, 4, 128, 16, torch.bfloat16)
    out = _triton()(num_segments=segments).decode(q, kc, vc, meta.block_tables, meta.seq_lens, 0.088)
    check_decode_rows(out, q, kc, vc, meta, 0.088, TOL[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_store_matches_reference(dtype: torch.dtype) -> None:
    from model_runtime.attention.triton_store import store_kv_triton

    _, k, v, kc, vc, meta = paged_inputs(0, [40, 0, 9], [40, 1, 9], 8, 4, 128, 16, dtype)
    ref_k, ref_v = kc.clone(), vc.clone()
    store_kv(k, v, ref_k, ref_v, meta.slot_mapping)
    store_kv_triton(k, v, kc, vc, meta.slot_mapping)
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_prefill_and_mixed_batch_match_reference(dtype: torch.dtype) -> None:
    """Fresh prompts (flash path), chunks over a cached prefix, decode tokens and padding in one batch."""
    seq_lens, query_lens = [300, 700, 129, 5000, 0, 64], [300, 64, 1, 1, 0, 17]
    q, k, v, kc, vc, meta = paged_inputs(11, seq_lens, query_lens, 8, 4, 128, 16, dtype)
    ref_kc, ref_vc = kc.clone(), vc.clone()
    ref = TorchAttention().forward(
        q.float(), k.float(), v.float(), ref_kc.float(), ref_vc.float(), meta, 0.088
    )
    out = _triton()().forward(q, k, v, kc, vc, meta, 0.088)
    store_kv(k, v, ref_kc, ref_vc, meta.slot_mapping)  # the reference's cache writes, in the cache dtype
    assert torch.equal(kc, ref_kc) and torch.equal(vc, ref_vc)
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize(
    ("seq_lens", "query_lens"),
    [([2048, 17, 513], [2048, 17, 513]), ([4096, 300, 1030], [512, 300, 6]), ([2048, 1536], [2048, 1536])],
    ids=["fresh-prompts", "chunks-over-prefixes", "long-fresh-prompts-cudnn"],
)
def test_packed_prefill_bf16_matches_reference(seq_lens: list[int], query_lens: list[int]) -> None:
    """Prefill-only steps take the packed varlen path whole: fresh prompts (the chunk's own K/V), and chunks
    over cached prefixes (context gathered by slot, causal from the bottom right)."""
    q, k, v, kc, vc, meta = paged_inputs(12, seq_lens, query_lens, 8, 4, 128, 16, torch.bfloat16)
    ref_kc, ref_vc = kc.clone(), vc.clone()
    ref = TorchAttention().forward(
        q.float(), k.float(), v.float(), ref_kc.float(), ref_vc.float(), meta, 0.088
    )
    backend = _triton()()
    out = backend.forward(q, k, v, kc, vc, meta, 0.088)
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL[torch.bfloat16]
    assert backend.prefill.cudnn_usable, "the cuDNN backend refused a long fresh prompt (see the log)"


def test_a_step_with_every_group_of_chunks_matches_reference() -> None:
    """Decode tokens (rows not contiguous), a chunk over a cached prefix, two long fresh prompts (cuDNN one by
    one at bucketed lengths: the first reads on into the next chunk's rows, the last is copied and padded) and
    a short fresh prompt between them (varlen over its own rows), as a prefill worker's step mixes them: each
    group against the float32 reference, after the plans were built as start-up builds them."""
    seq_lens, query_lens = [129, 700, 2000, 300, 5000, 1500], [1, 64, 2000, 300, 1, 1500]
    q, k, v, kc, vc, meta = paged_inputs(13, seq_lens, query_lens, 8, 4, 128, 16, torch.bfloat16)
    plan = meta.mixed
    assert plan is not None and plan.long_fresh is not None and plan.long_fresh.query_lens == [2000, 1500]
    assert plan.fresh is not None and plan.cached is not None and plan.decode_rows is not None
    assert plan.decode_rows.index is not None, "the two decode rows are apart: an indexed write"
    ref_kc, ref_vc = kc.clone(), vc.clone()
    ref = TorchAttention().forward(
        q.float(), k.float(), v.float(), ref_kc.float(), ref_vc.float(), meta, 0.088
    )
    backend = _triton()()
    assert backend.prefill.warm_up(q, k, v, 2048) == 5, "lengths 1024, 1280, ..., 2048"
    out = backend.forward(q, k, v, kc, vc, meta, 0.088)
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL[torch.bfloat16]
    assert backend.prefill.cudnn_usable, "the cuDNN backend refused a long fresh prompt (see the log)"


def test_decode_rows_gathered_with_the_chunks_match_the_decode_kernel() -> None:
    """A mixed step as a colocated worker runs it at low load: two decodes beside a chunk over a cached prefix
    and a fresh prompt, the decodes attended in the cached group's FlashAttention call over their gathered
    contexts (device.decode_gather_tokens). Against the float32 reference and against the same step with the
    decodes in the paged decode kernel."""
    seq_lens, query_lens = [2300, 129, 2048 + 128, 300, 0], [1, 1, 128, 300, 1]
    q, k, v, kc, vc, meta = paged_inputs(15, seq_lens, query_lens, 8, 4, 128, 16, torch.bfloat16, 8192)
    plan = meta.mixed
    assert plan is not None and plan.decode_rows is None and plan.cached is not None
    assert plan.cached.query_lens == [1, 1, 128] and plan.fresh is not None
    kernel = step_meta(seq_lens, query_lens, meta.block_tables, meta.slot_mapping)
    assert kernel.mixed is not None and kernel.mixed.decode_rows is not None
    ref_kc, ref_vc = kc.clone(), vc.clone()
    ref = TorchAttention().forward(
        q.float(), k.float(), v.float(), ref_kc.float(), ref_vc.float(), meta, 0.088
    )
    backend = _triton()()
    by_kernel = backend.forward(q, k, v, kc.clone(), vc.clone(), kernel, 0.088)
    out = backend.forward(q, k, v, kc, vc, meta, 0.088)
    assert not out.isnan().any()
    assert (out[-1] == 0).all(), "the padding row stays zero"
    assert rel_err(out, ref) < TOL[torch.bfloat16]
    assert rel_err(out, by_kernel) < TOL[torch.bfloat16]


@pytest.mark.parametrize(
    ("seq_lens", "query_lens", "group", "dtype"),
    [
        (
            [2048 + 128, 2300, 129],
            [128, 1, 1],
            4,
            torch.bfloat16,
        ),  # a chat turn, two decodes gathered with it
        ([2048 + 320, 700], [320, 1], 4, torch.bfloat16),
        ([4096 + 64, 4000], [64, 1], 8, torch.bfloat16),  # 70B's GQA: 8 query heads a KV head
        ([1000 + 200, 5000 + 300, 40], [200, 300, 40], 4, torch.bfloat16),  # 500 rows, a fresh prompt beside
        ([2048 + 128, 2300, 129], [128, 1, 1], 4, torch.float32),
    ],
    ids=["128-over-2k", "320-over-2k", "gqa8", "500-rows", "float32"],
)
def test_chunk_kernel_matches_reference_and_the_gathered_call(
    seq_lens: list[int], query_lens: list[int], group: int, dtype: torch.dtype
) -> None:
    """A step's cached group read from the pages by the split-KV chunk kernel (device.chunk_attention_tokens,
    default): against the float32 reference and against the same step gathered for FlashAttention-2."""
    q, k, v, kc, vc, meta = paged_inputs(21, seq_lens, query_lens, 8, group, 128, 16, dtype, 8192)
    gathered_meta = step_meta(seq_lens, query_lens, meta.block_tables, meta.slot_mapping, 16, 8192)
    assert meta.mixed is not None and meta.mixed.cached is not None and meta.mixed.decode_rows is None
    ref = TorchAttention().forward(q.float(), k.float(), v.float(), kc.float(), vc.float(), meta, 0.088)
    gathered = _triton()(chunk_attention_tokens=0).forward(
        q, k, v, kc.clone(), vc.clone(), gathered_meta, 0.088
    )
    out = _triton()().forward(q, k, v, kc, vc, meta, 0.088)
    assert meta.mixed.cached.chunk_work is not None, "the chunk kernel did not run"
    assert gathered_meta.mixed is not None and gathered_meta.mixed.cached is not None
    assert gathered_meta.mixed.cached.chunk_work is None
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL[dtype]
    assert rel_err(out, gathered) < TOL[dtype]


def test_cuda_graph_replay_equals_eager() -> None:
    """Capture forward (store + decode) on a padded bucket of 8, replay on new data, compare to eager."""
    block, kv_heads, group, dim, width = 16, 8, 4, 128, 260
    gen = torch.Generator().manual_seed(5)
    num_blocks = 8 * width + 1
    kc = torch.randn(num_blocks, block, kv_heads, dim, generator=gen).to(DEV, torch.bfloat16)
    vc = torch.randn(num_blocks, block, kv_heads, dim, generator=gen).to(DEV, torch.bfloat16)

    def step_inputs(seq_lens: list[int]):
        table, _ = random_tables(gen, seq_lens, block, num_blocks, width)
        qkv = torch.randn(8, (group + 2) * kv_heads, dim, generator=gen).to(DEV, torch.bfloat16)
        q, k, v = qkv.split([group * kv_heads, kv_heads, kv_heads], dim=1)  # strided views, as in a model
        return q, k, v, step_meta(seq_lens, [1] * 8, table, slots_for(table, seq_lens, [1] * 8, block))

    backend = _triton()()
    backend.reserve(8, group * kv_heads, kv_heads, dim, DEV)
    q, k, v, meta = step_inputs([100, 17, 4096, 1, 600, 0, 0, 0])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # JIT-compile and warm up outside the capture
            backend.forward(q, k, v, kc, vc, meta, 0.088)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = backend.forward(q, k, v, kc, vc, meta, 0.088)

    q2, k2, v2, meta2 = step_inputs([2000, 0, 33, 4000, 9, 1, 0, 250])  # same bucket, new rows
    for dst, src in (
        (q, q2),
        (k, k2),
        (v, v2),
        (meta.seq_lens, meta2.seq_lens),
        (meta.slot_mapping, meta2.slot_mapping),
        (meta.block_tables, meta2.block_tables),
    ):
        dst.copy_(src)
    eager_kc, eager_vc = kc.clone(), vc.clone()
    static_out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    eager = _triton()().forward(q2, k2, v2, eager_kc, eager_vc, meta2, 0.088)
    assert torch.equal(static_out, eager), "graph replay differs from the eager run on the same inputs"
    assert torch.equal(kc, eager_kc) and torch.equal(vc, eager_vc)
    check_decode_rows(static_out, q2, kc, vc, meta2, 0.088, TOL[torch.bfloat16])
