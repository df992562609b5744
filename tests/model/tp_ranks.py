"""Run a function on N tensor-parallel ranks: N processes started here, one group over 127.0.0.1 (gloo on CPU;
NCCL with device="cuda", rank r on cuda:r).

    results = run_ranks(greedy_tokens, 2, model_path, prompts)    # [rank 0's result, rank 1's, ...]

Each rank runs `target(group, *args)` and sends back its result (plain lists / numpy arrays) or its traceback;
a rank that fails fails the call with that traceback, and a run past `timeout_s` is killed and fails it. The
rank functions below are module level so the spawned processes can import them.
"""

from __future__ import annotations

import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as mp

from model_runtime.config import CacheConfig, DeviceConfig, EngineConfig, ParallelConfig, SchedulerConfig
from model_runtime.engine import Engine
from model_runtime.host_batch import HostBatch
from model_runtime.parallel.follower import run_follower
from model_runtime.parallel.group import TPGroup, close_tp_group, init_tp_group
from model_runtime.prefill_graphs import PrefillGraphs
from model_runtime.request import SamplingParams
from model_runtime.runner_setup import build_runner
from model_runtime.startup import StartupProgress
from model_runtime.weights import load_model_config, resolve_model

BLOCK_SIZE = 4
PIECE_TOKENS = 48  # "steps-pieces": the largest piecewise step, so that the prompt step is padded to a bucket
GPU_BLOCK_SIZE = 16


def run_ranks(
    target: Callable[..., Any], size: int, *args: Any, timeout_s: float = 240.0, device: str = "cpu"
) -> list[Any]:
    # A fork server imports this module (torch, the engine) once; each rank is then a fork of it, which has
    # never run a torch op (no thread pools to inherit), instead of a fresh interpreter importing torch again.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(target, rank, size, port, queue, args, device), daemon=True)
        for rank in range(size)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    f"tensor-parallel ranks did not finish in {timeout_s:.0f} s: {sorted(results)}"
                )
            try:
                rank, ok, value = queue.get(timeout=min(left, 1.0))
            except Exception:  # queue.Empty: check whether a rank died without reporting
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise AssertionError(f"a tensor-parallel rank died (exit codes {dead})") from None
                continue
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [results[rank] for rank in range(size)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(
    target: Callable[..., Any], rank: int, size: int, port: int, queue: Any, args: tuple, device: str
) -> None:
    torch.set_num_threads(1)  # N ranks share the test machine's few cores
    try:
        group = init_tp_group(rank, size, f"tcp://127.0.0.1:{port}", rank_device(rank, device), timeout_s=120)
        queue.put((rank, True, target(group, *args)))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        close_tp_group()


def rank_device(rank: int, device: str) -> str:
    """Rank `rank`'s device: "cpu", or cuda:<rank> (TP=1's reference is rank 0, on cuda:0)."""
    return "cpu" if device == "cpu" else f"cuda:{rank}"


def rank_config(
    model: str,
    group: TPGroup | None,
    quantization: str = "none",
    device: str = "cpu",
    eager: bool = False,
) -> EngineConfig:
    """A small token budget and cache, so the lead's schedule has chunked prefills, mixed prefill + decode
    steps and preemptions (by recompute) for the other ranks to follow. float32 everywhere; on a GPU the
    blocks are 16 tokens (what the Triton kernels are tuned for) and fewer, so that preemptions still happen,
    and decode runs in CUDA graphs unless `eager`."""
    block_size, num_blocks = (BLOCK_SIZE, 24) if device == "cpu" else (GPU_BLOCK_SIZE, 6)
    return EngineConfig(
        model=model,
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=12),
        device=DeviceConfig(
            device=rank_device(0 if group is None else group.rank, device),
            dtype="float32",
            quantization=quantization,
            enforce_eager=eager,
        ),
        parallel=ParallelConfig(tensor_parallel_size=1 if group is None else group.size),
    )


# --- rank functions ----------------------------------------------------------------------------------------
def run_checks(group: TPGroup | None, checks: list[tuple[str, str, Any]], device: str = "cpu") -> list[Any]:
    """Several checks in one set of rank processes (starting N processes costs more than the checks):
    ("greedy", model, (prompts, max_new)), ("greedy-eager", ...) (CUDA graphs off) or ("steps", model,
    batches), in order, on every rank."""
    results = []
    for kind, model, arg in checks:
        if kind in ("greedy", "greedy-eager"):
            results.append(greedy_tokens(group, model, *arg, device=device, eager=kind == "greedy-eager"))
        elif kind in ("steps", "steps-pieces"):
            results.append(step_outputs(group, model, arg, device=device, pieces=kind == "steps-pieces"))
        else:
            raise ValueError(f"unknown check {kind!r}")
    return results


def greedy_tokens(
    group: TPGroup | None,
    model: str,
    prompts: list[list[int]],
    max_new: int,
    device: str = "cpu",
    eager: bool = False,
) -> Any:
    """The lead: (greedy continuations of `prompts` through the engine, how many steps had a prompt chunk,
    preemptions, whether decode ran in CUDA graphs); the other ranks: how many steps they followed."""
    config = rank_config(model, group, device=device, eager=eager)
    if group is not None and not group.is_lead:
        return run_follower(config, group)
    engine = Engine(config, emit_text=False, tp_group=group)
    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(
                f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
            )
        tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        prefill_steps = preempted = 0
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id].extend(out.token_ids)
            if engine.last_step is not None:
                prefill_steps += engine.last_step.num_prefill > 0
                preempted += engine.last_step.num_preempted
        graphs = engine.runner.graphs is not None
        return [tokens[f"r{i}"] for i in range(len(prompts))], prefill_steps, preempted, graphs
    finally:
        engine.close()


def assert_matches_one_device(
    tp: int, kind: str, reference: Any, ranks: list[Any], num_prompts: int, atol: float
) -> None:
    """A run_checks result of `tp` ranks against TP=1's (`reference`): greedy checks give the same tokens, after a
    schedule with chunked prompts and preemptions that the followers followed step for step; step checks give
    every rank's hidden states and gathered logits within `atol`, from a cache of its own KV heads."""
    if kind.startswith("greedy"):
        tokens, prefill_steps, preempted, _ = ranks[0]
        assert tokens == reference[0], f"TP={tp} {kind} tokens differ from TP=1"
        assert prefill_steps > num_prompts and preempted > 0, (prefill_steps, preempted)
        assert len(set(ranks[1:])) == 1 and ranks[1] > prefill_steps, f"followers' step counts: {ranks[1:]}"
        return
    ref_steps, ref_print, ref_shape = reference
    prints = [fingerprint for _, fingerprint, _ in ranks]
    assert len(set(prints)) == tp and ref_print not in prints, "each rank's KV layout must fingerprint apart"
    for rank, (steps, _, shape) in enumerate(ranks):
        assert shape[:4] == ref_shape[:4] and shape[4] == max(1, ref_shape[4] // tp), (
            f"rank {rank} cache {shape}"
        )
        for step, ((hidden, logits), (ref_hidden, ref_logits)) in enumerate(zip(steps, ref_steps)):
            label = f"TP={tp} rank {rank} step {step}"
            np.testing.assert_allclose(hidden, ref_hidden, atol=atol, rtol=atol, err_msg=f"{label} hidden")
            np.testing.assert_allclose(logits, ref_logits, atol=atol, rtol=atol, err_msg=f"{label} logits")


def step_outputs(
    group: TPGroup | None,
    model: str,
    batches: list[HostBatch],
    quantization: str = "none",
    device: str = "cpu",
    pieces: bool = False,
) -> Any:
    """Every rank runs `batches` through its own runner (no scheduler): [(hidden states, logits)] per batch,
    plus its KV layout's fingerprint and cache shape. Eager on a GPU too (greedy_tokens covers the graphs).
    With `pieces`, steps with prompt chunks run the piecewise prefill forward (prefill_graphs, its pieces called
    eagerly, padded to a bucket, all-reduces between them) instead of the model's forward.
    The batches' block tables must fit the config's blocks (prefill_then_decode with the same device)."""
    config = rank_config(model, group, quantization, device)
    source = resolve_model(model)
    rank = build_runner(config, source, load_model_config(source), StartupProgress(None), group)
    runner = rank.runner
    if pieces:
        runner.prefill_graphs = PrefillGraphs(runner.model, PIECE_TOKENS, use_graphs=False)
    hidden: list[torch.Tensor] = []
    runner.model.register_forward_hook(lambda _m, _args, out: hidden.append(out.detach().clone()))
    outputs = []
    for batch in batches:
        runs = runner.prefill_graphs.num_runs if runner.prefill_graphs is not None else 0
        logits = runner.execute_batch(batch, use_graphs=pieces)  # a graph replay would skip the hook
        if runner.prefill_graphs is not None and runner.prefill_graphs.num_runs > runs:
            hidden.append(runner.prefill_graphs.forward.static.hidden[: batch.num_tokens].clone())
        outputs.append((hidden[-1].cpu().numpy(), logits.cpu().numpy()))
    return outputs, rank.layout.fingerprint(), tuple(rank.runner.kv_cache.shape)


def prefill_then_decode(prompts: list[list[int]], device: str = "cpu") -> list[HostBatch]:
    """Two host batches by hand: every prompt's prefill (each sequence on its own blocks, every row sampled),
    then one decode token per sequence; blocks of rank_config's size for `device`."""
    bs = BLOCK_SIZE if device == "cpu" else GPU_BLOCK_SIZE
    first_block, tables = 1, []
    for prompt in prompts:
        blocks = -(-(len(prompt) + 1) // bs)
        tables.append(list(range(first_block, first_block + blocks)))
        first_block += blocks
    width = max(map(len, tables))
    table = np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int32)
    prefill = _batch([p for p in prompts], [0] * len(prompts), table, bs)
    decode = _batch([[p[-1]] for p in prompts], [len(p) for p in prompts], table, bs)
    return [prefill, decode]


def _batch(chunks: list[list[int]], starts: list[int], table: np.ndarray, block_size: int) -> HostBatch:
    lens = [len(c) for c in chunks]
    query_start = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lens)]).astype(np.int64)
    rows = np.repeat(np.arange(len(chunks)), lens)
    slots = table[rows, positions // block_size].astype(np.int64) * block_size + positions % block_size
    seq_lens = np.array(starts, dtype=np.int32) + np.array(lens, dtype=np.int32)
    return HostBatch(
        token_ids=np.array([t for c in chunks for t in c], dtype=np.int64),
        positions=positions,
        slots=slots,
        query_start=query_start,
        seq_lens=seq_lens,
        block_tables=table,
        logits_indices=np.arange(int(query_start[-1]), dtype=np.int64),
        query_lens=lens,
        seq_lens_list=seq_lens.tolist(),
    )
