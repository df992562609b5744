"""bench/tp_decode.py's ranks: what each process it spawns runs (one per GPU, rank r on cuda:r).

Every rank builds its runner as the engine does and times the all-reduces alone; rank 0 then times each step as
an engine's lead, the others follow it, and rank 0 rewrites the JSON after each row (a run cut short keeps what
it measured). torch.multiprocessing.spawn starts `run_rank` by its module path, so it lives here, in a module a
fresh interpreter imports whether the driver runs as a script or as bench.tp_decode.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from bench.decode_step import BLOCK_SIZE, blocks_needed, copy_bandwidth_gbps, decode_step, weight_bytes_read
from bench.floors import ModelCost
from bench.harness import measure_matmul_tflops, median_seconds
from bench.tp_timeline import follow_timed, lead_step, write_lead_times
from model_runtime.config import CacheConfig, DeviceConfig, EngineConfig, ParallelConfig, SchedulerConfig
from model_runtime.parallel.group import TPGroup, close_tp_group, init_tp_group
from model_runtime.request import Request, SamplingParams, ScheduledChunk, SchedulerOutput
from model_runtime.runner_setup import RankRunner, build_runner
from model_runtime.startup import StartupProgress
from model_runtime.weights import load_model_config, resolve_model
from tandem_cli.bench.report import git_commit

if TYPE_CHECKING:  # the driver's settings; at run time the driver imports this module, not the reverse
    from bench.tp_decode import Settings


@dataclass(frozen=True)
class Row:
    # "decode": `batch` sequences decode one token at `context`; "prefill": one prompt of `context` tokens
    phase: str
    batch: int
    context: int
    weight_bytes: int  # per rank
    kv_bytes: int  # per rank
    floor_us: float
    bound: str  # "bytes" or "flops"
    step_us: float
    allreduce_us: float  # the path the step runs
    fraction_of_floor: float  # floor / step
    fraction_of_floor_without_allreduce: float  # floor / (step - all-reduces)
    allreduce_paths_us: dict[str, float] = dataclasses.field(default_factory=dict)  # each path, timed alone

    def line(self) -> str:
        what = (
            f"batch {self.batch} ctx {self.context}" if self.phase == "decode" else f"prefill {self.context}"
        )
        return (
            f"{what}: step {self.step_us:.0f} us, all-reduces "
            f"{self.allreduce_us:.0f} us ({100 * self.allreduce_us / self.step_us:.0f}%), floor {self.floor_us:.0f} "
            f"us ({self.bound}): {100 * self.fraction_of_floor:.0f}% of floor, "
            f"{100 * self.fraction_of_floor_without_allreduce:.0f}% without the all-reduces"
            + (
                " [" + ", ".join(f"{k} {v:.0f}" for k, v in self.allreduce_paths_us.items()) + " us]"
                if len(self.allreduce_paths_us) > 1
                else ""
            )
        )


def rank_config(settings: Settings, rank: int) -> EngineConfig:
    on_gpu = settings.device == "cuda"
    max_context = max((*settings.contexts, *settings.prefill_lens))
    return EngineConfig(
        model=settings.model,
        cache=CacheConfig(
            block_size=BLOCK_SIZE,
            # CPU: just enough blocks for the largest step; GPU: what memory allows (every rank agrees on the
            # smallest count), and steps whose KV does not fit are skipped.
            num_blocks=None
            if on_gpu
            else max(
                blocks_needed(b, c)
                for b in (*settings.batches, 1)
                for c in (*settings.contexts, *settings.prefill_lens)
            )
            + 1,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            enable_prefix_caching=False,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=max(settings.batches),
            max_num_batched_tokens=max(2048, *settings.batches, *settings.prefill_lens),
            max_model_len=max_context + 1,
        ),
        device=DeviceConfig(
            device=f"cuda:{rank}" if on_gpu else "cpu", dtype="bfloat16" if on_gpu else "float32"
        ),
        parallel=ParallelConfig(tensor_parallel_size=settings.tp, all_reduce=settings.all_reduce),
    )


@dataclass(frozen=True)
class Timer:
    """A rank's device and the medians timed on it (bench.harness.median_seconds: CUDA events on a GPU)."""

    device: str  # "cuda:<rank>" or "cpu"

    @property
    def on_gpu(self) -> bool:
        return self.device != "cpu"

    def median_us(self, fn: Callable[[], object], warmup: int, reps: int) -> float:
        return median_seconds(fn, self.device, warmup, reps) * 1e6


def allreduce_us(
    group: TPGroup, batch: int, hidden: int, layers: int, timer: Timer, settings: Settings
) -> dict[str, float]:
    """One step's all-reduces alone: 2 x layers of a [batch, hidden] tensor, in a CUDA graph on a GPU, by each
    path: "step" (what the step runs: TPGroup.all_reduce), "nccl", and where the ranks set up the symmetric-memory
    path, "one_shot" and "two_shot" forced at every size."""
    if group.size == 1:
        return {"step": 0.0}  # one GPU: no collectives in its step
    dtype = torch.bfloat16 if timer.on_gpu else torch.float32
    x = torch.zeros(batch, hidden, dtype=dtype, device=timer.device)
    paths: dict[str, Callable[[torch.Tensor], object]] = {
        "step": group.all_reduce,
        "nccl": lambda t: torch.distributed.all_reduce(t, group=group.device_group),
    }
    if group.fast is not None:
        paths["one_shot"] = dataclasses.replace(group.fast, one_shot_max=1 << 62)
        paths["two_shot"] = dataclasses.replace(group.fast, one_shot_max=0)
    times = {}
    for name, reduce in paths.items():

        def eager(reduce: Callable[[torch.Tensor], object] = reduce) -> None:
            for _ in range(2 * layers):
                reduce(x)

        if not timer.on_gpu:
            times[name] = timer.median_us(eager, settings.warmup, settings.reps)
            continue
        eager()  # the communicator (or the symmetric buffer) is ready before a capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            eager()
        times[name] = timer.median_us(graph.replay, settings.warmup, settings.reps)
    return times


def run_rank(rank: int, settings: Settings, port: int, out_path: str) -> None:
    """Rank 0 times the steps; the others follow them as an engine's followers do (StepReceiver)."""
    on_gpu = settings.device == "cuda"
    if not on_gpu:
        torch.set_num_threads(1)
    group = init_tp_group(
        rank,
        settings.tp,
        f"tcp://127.0.0.1:{port}",
        f"cuda:{rank}" if on_gpu else "cpu",
        timeout_s=600,
        fast_all_reduce=settings.all_reduce == "auto",
    )
    try:
        _rank_work(rank, settings, group, out_path)
    except BaseException:
        close_tp_group()
        raise
    if on_gpu:
        # Every result is written. Tearing NCCL down (destroy_process_group) hung at exit in 5 of 7 GPU runs of
        # this script (2x and 4x H200), so a rank that finished leaves without it; spawn sees exit code 0.
        sys.stdout.flush()
        os._exit(0)
    close_tp_group()


def _rank_work(rank: int, settings: Settings, group: TPGroup, out_path: str) -> None:
    on_gpu = settings.device == "cuda"
    rates = None
    if on_gpu:
        rates = (copy_bandwidth_gbps(), measure_matmul_tflops(f"cuda:{rank}", torch.bfloat16, 8192))
    source = resolve_model(settings.model)
    model = load_model_config(source)
    t0 = time.perf_counter()
    progress = StartupProgress(
        (lambda message: print(f"[start-up] {message}", flush=True)) if rank == 0 else None
    )
    built = build_runner(rank_config(settings, rank), source, model, progress, group)
    runner = built.runner
    if on_gpu and runner.graphs is None:
        raise SystemExit("the decode CUDA graphs were not captured")
    runner.kv_cache.normal_(generator=torch.Generator(device=runner.kv_cache.device).manual_seed(rank))
    timer = Timer(f"cuda:{rank}" if on_gpu else "cpu")
    # The all-reduces alone first, every rank together; then the steps, which the followers only follow.
    collectives = {
        tokens: allreduce_us(group, tokens, model.hidden_size, model.num_layers, timer, settings)
        for tokens in (*settings.batches, *settings.prefill_lens)
    }
    if not group.is_lead:
        follow_timed(built, group, out_path, shared_memory=settings.step_channel == "shm")
        return
    if rates is not None:
        print(f"rank 0 GPU: HBM copy {rates[0]:.0f} GB/s, bf16 matmul {rates[1]:.0f} TFLOP/s", flush=True)
    print(
        f"ranks built in {time.perf_counter() - t0:.0f} s; cache {built.layout.num_blocks} blocks; "
        f"small all-reduces: {'symmetric memory' if group.fast is not None else 'NCCL' if on_gpu else 'gloo'}",
        flush=True,
    )
    try:
        lead_steps(
            built,
            settings,
            timer,
            rates,
            collectives,
            lambda rows, skipped: write_json(out_path, settings, rows, skipped, rates, built),
        )
        tp = built.tensor_parallel
        if tp is not None and tp.publisher is not None:
            print(
                f"steps went over {'shared memory' if tp.publisher.on_shared_memory else 'gloo'}", flush=True
            )
    finally:
        if built.tensor_parallel is not None:  # None at --tp 1
            built.tensor_parallel.stop_followers()
        write_lead_times(out_path)


def lead_steps(
    built: RankRunner,
    settings: Settings,
    timer: Timer,
    rates: tuple[float, float] | None,
    collectives: dict[int, dict[str, float]],
    save: Callable[[list[Row], list[dict[str, int]]], None],
) -> None:
    """Time every decode (batch, context) step, then every prefill length, on the lead; `save` gets the rows
    so far after each, so a run cut short keeps what it measured."""
    runner = built.runner
    cost = ModelCost.from_config(runner.config, 2 if timer.on_gpu else 4)
    weights = weight_bytes_read(runner)
    gen = torch.Generator().manual_seed(0)
    rows: list[Row] = []
    skipped: list[dict[str, int]] = []

    def row(phase: str, batch: int, context: int, step_us: float, kv: int, flops: float, tokens: int) -> None:
        byte_floor = flop_floor = 0.0  # CPU smoke: no measured rates, no floor
        if rates is not None:
            byte_floor = (weights + kv) / (rates[0] * 1e3)
            flop_floor = flops / (rates[1] * 1e6)
        floor, paths = max(byte_floor, flop_floor), collectives[tokens]
        ar_us = paths["step"]
        rows.append(
            Row(
                phase=phase,
                batch=batch,
                context=context,
                weight_bytes=weights,
                kv_bytes=kv,
                floor_us=floor,
                bound="flops" if flop_floor > byte_floor else "bytes",
                step_us=step_us,
                allreduce_us=ar_us,
                fraction_of_floor=floor / step_us,
                fraction_of_floor_without_allreduce=floor / max(step_us - ar_us, 1e-9),
                allreduce_paths_us=paths,
            )
        )
        print(rows[-1].line(), flush=True)
        save(rows, skipped)

    def timed(out: SchedulerOutput, label: str) -> float:  # build the host batch, publish, run, ids to host
        return timer.median_us(lambda: lead_step(runner, out, label), settings.warmup, settings.reps)

    for context in settings.contexts:
        for batch in settings.batches:
            if blocks_needed(batch, context) > built.layout.usable_blocks:
                skipped.append({"batch": batch, "context": context})
                print(f"batch {batch} ctx {context}: skipped, its KV does not fit", flush=True)
                continue
            out = decode_step(batch, context, built.layout.num_blocks, runner.config.vocab_size, gen)
            replays = runner.graphs.num_replays if runner.graphs is not None else 0
            step_us = timed(out, f"decode batch {batch} ctx {context}")
            if runner.graphs is not None and runner.graphs.num_replays == replays:
                raise SystemExit(f"batch {batch}: the step did not replay a CUDA graph")
            kv = batch * (context + 1) * built.layout.bytes_per_token
            row("decode", batch, context, step_us, kv, cost.decode_step_flops(batch, context + 1), batch)
    if settings.profile is not None:
        profile_step(built, settings, timer, gen)
    for length in settings.prefill_lens:
        if -(-length // BLOCK_SIZE) > built.layout.usable_blocks:
            skipped.append({"prefill": length})
            print(f"prefill {length}: skipped, its KV does not fit", flush=True)
            continue
        out = prefill_step(length, built.layout.num_blocks, runner.config.vocab_size, gen)
        kv = length * built.layout.bytes_per_token  # written once
        row("prefill", 1, length, timed(out, f"prefill {length}"), kv, cost.prefill_flops(length), length)
    save(rows, skipped)


def profile_step(built: RankRunner, settings: Settings, timer: Timer, gen: torch.Generator) -> None:
    """torch.profiler over a few steps of settings.profile on this (lead) rank, graphs then eager; the table is
    printed and written beside the JSON."""
    from torch.profiler import ProfilerActivity, profile

    assert settings.profile is not None
    batch, context = settings.profile
    runner = built.runner
    if blocks_needed(batch, context) > built.layout.usable_blocks:
        print(f"profile batch {batch} ctx {context}: skipped, its KV does not fit", flush=True)
        return
    out = decode_step(batch, context, built.layout.num_blocks, runner.config.vocab_size, gen)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if timer.on_gpu else [])
    text = []
    for use_graphs in (True, False):
        for _ in range(3):  # warm
            lead_step(runner, out, "profile", use_graphs)
        with profile(activities=activities) as prof:
            for _ in range(5):
                lead_step(runner, out, "profile", use_graphs)
        sort = "cuda_time_total" if timer.on_gpu else "cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=30, max_name_column_width=70)
        title = (
            f"== profile: batch {batch} ctx {context}, {'CUDA graphs' if use_graphs else 'eager'}, 5 steps"
        )
        text += [title, table]
        print(title + "\n" + table, flush=True)
    _PROFILE_TEXT.extend(text)


_PROFILE_TEXT: list[str] = []


def prefill_step(length: int, num_blocks: int, vocab: int, gen: torch.Generator) -> SchedulerOutput:
    """One prompt of `length` tokens, computed whole in one step (eager: prompts do not run in graphs)."""
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    prompt = torch.randint(0, vocab, (length,), generator=gen).tolist()
    blocks = perm[: -(-length // BLOCK_SIZE)]
    request = Request("prompt", prompt, SamplingParams(temperature=0), block_ids=blocks)
    return SchedulerOutput((ScheduledChunk(request, length, sample=True),))


def write_json(
    path: str,
    settings: Settings,
    rows: list[Row],
    skipped: list,
    rates: tuple[float, float] | None,
    built: RankRunner,
) -> None:
    doc = {
        "benchmark": "tensor-parallel decode step (runner + logits gather + greedy ids) vs the per-GPU floor",
        "gpu": torch.cuda.get_device_name() if settings.device == "cuda" else "cpu",
        "gpus": settings.tp,
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "nccl": _nccl_version() if settings.device == "cuda" else None,
        "hbm_copy_gbps": rates[0] if rates else None,
        "matmul_tflops": rates[1] if rates else None,
        "settings": {
            **dataclasses.asdict(settings),
            "block_size": BLOCK_SIZE,
            "num_blocks": built.layout.num_blocks,
            "timing": "median of CUDA-event-timed steps on rank 0; all-reduces: one CUDA graph of 2 x layers",
        },
        "rows": [dataclasses.asdict(r) for r in rows],
        "skipped": skipped,
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")
    if _PROFILE_TEXT:
        Path(path).with_suffix(".profile.txt").write_text("\n".join(_PROFILE_TEXT) + "\n")


def _nccl_version() -> str:
    version = torch.cuda.nccl.version()  # a tuple in recent torch, an int (2.18.3 -> 21803) in older ones
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
