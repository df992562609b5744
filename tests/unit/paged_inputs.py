"""Paged attention inputs on the CPU for the Triton interpreter's cases (test_triton_interpret.py): random caches
holding every context token, scattered block tables, the step's metadata as the model runner builds it (its
prefill/decode split included), FP8 versions of the pages, and the comparisons the cases make. Imports nothing
of Triton: the interpreter's child process imports it only after TRITON_INTERPRET is set."""

from __future__ import annotations

import numpy as np
import torch

TOL = 1e-4  # fp32 interpreter: numpy matmuls, so only summation-order differences remain


def step_meta(
    seq_lens: list[int],
    query_lens: list[int],
    block_tables: torch.Tensor,
    slots: list[int] | torch.Tensor,
    block_size: int = 16,
    decode_gather_tokens: int = 0,
):
    """Metadata as the model runner builds it, the prefill/decode split (MixedPlan) included, on the block
    tables' device (the CPU cases here, CUDA in tests/gpu); decode rows join the cached group up to
    `decode_gather_tokens` context tokens (0: the decode kernel takes them)."""
    from model_runtime.attention.base import AttentionMetadata
    from model_runtime.host_batch import mixed_plan

    device = block_tables.device
    plan = None
    if max(query_lens) > 1:
        tables = block_tables.cpu().numpy()
        plan = mixed_plan(query_lens, np.array(seq_lens), tables, block_size, decode_gather_tokens).to_device(
            device
        )

    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.as_tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables,
        query_lens_host=list(query_lens),
        seq_lens_host=list(seq_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        mixed=plan,
    )


def random_tables(gen: torch.Generator, seq_lens: list[int], block_size: int) -> tuple[torch.Tensor, int]:
    """Scattered block ids (a random permutation of 1..N-1), rows padded with the null block 0."""
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(need) + 3
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(seq_lens), max(1, max(need)) + 1, dtype=torch.int32)
    for i, n in enumerate(need):
        table[i, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    return table, num_blocks


def paged_case(
    seed: int,
    seq_lens: list[int],
    query_lens: list[int],
    kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    decode_gather_tokens: int = 0,
):
    """Random caches already holding every context token; q/k/v for the new tokens; metadata."""
    gen = torch.Generator().manual_seed(seed)
    table, num_blocks = random_tables(gen, seq_lens, block_size)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    slots: list[int] = []
    for i, (s, n) in enumerate(zip(seq_lens, query_lens)):
        blocks = table[i].tolist()
        slots += [
            blocks[p // block_size] * block_size + p % block_size if s > 0 else -1 for p in range(s - n, s)
        ]
    t = sum(query_lens)
    q = torch.randn(t, kv_heads * group, head_dim, generator=gen)
    k, v = (
        torch.randn(t, kv_heads, head_dim, generator=gen),
        torch.randn(t, kv_heads, head_dim, generator=gen),
    )
    return (
        q,
        k,
        v,
        k_cache,
        v_cache,
        step_meta(seq_lens, query_lens, table, slots, block_size, decode_gather_tokens),
    )


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-6))


def compare(out: torch.Tensor, ref: torch.Tensor, live: list[bool], tol: float = TOL) -> tuple[bool, str]:
    """Live rows match the reference; padded rows (seq_len 0) are exactly zero."""
    keep = torch.tensor(live)
    err = rel_err(out[keep], ref[keep])
    pad_ok = bool((out[~keep] == 0).all()) if (~keep).any() else True
    nan_free = not bool(out.isnan().any())
    return err < tol and pad_ok and nan_free, f"rel_err={err:.2e} pad_zero={pad_ok} nan_free={nan_free}"


def fp8_caches(k_cache: torch.Tensor, v_cache: torch.Tensor):
    """Float pages as an FP8 cache: (K codes, V codes, scale pages [2, N, B, H]) over one storage."""
    from model_runtime.kv_quant import fp8_pages

    return fp8_pages(k_cache, v_cache)


def on_grid(x: torch.Tensor) -> torch.Tensor:
    """Rows [..., H, D] moved onto values an FP8 cache stores exactly: each row's codes times its scale, one code
    at +-448, so storing it again gives the same scale and rounds nothing."""
    from model_runtime.kv_quant import dequantize_kv, quantize_kv

    return dequantize_kv(*quantize_kv(x), x.dtype)
