"""One decode step of a tensor-parallel engine against its per-GPU floor, with the all-reduce time apart.

    python bench/tp_decode.py --model dummy:llama-3-70b --tp 4 [--batches 32,64,128] [--contexts 512,2048]
    python bench/tp_decode.py --model dummy:llama-3-8b --tp 2
    python bench/tp_decode.py --model dummy:llama-3-8b --tp 1   (the same step on one GPU: the same-run baseline)
    python bench/tp_decode.py ... --profile 32,512        (also: rank 0's kernels over a few steps of that point)
    python bench/tp_decode.py --smoke                       (CPU, gloo, a tiny model: checks the script runs)

One process per GPU (rank r on cuda:r, NCCL over 127.0.0.1), each building its rank's runner as the engine does
(runner_setup.build_runner: its slice of the weights, a cache of its KV heads, the decode CUDA graphs with the
all-reduces inside). Rank 0 builds each step and runs it as an engine's lead does, publishing its host inputs;
the other ranks follow through StepReceiver as an engine's followers do. Rank 0's CUDA-event times are reported
(the collectives keep the ranks within one step of each other). A step: `batch` sequences with `context` cached
tokens each, on random blocks of a randomly filled cache, decoding one token; logits gathered on every rank,
greedy ids copied to the host, as the engine does.

Floor of a step on one GPU = the larger of (that rank's weight bytes + its KV bytes read) / HBM copy rate and its
FLOPs / bf16 matmul rate, both measured on the GPU in the same run (bench/decode_step.py's rules). The step's
all-reduces are timed alone, in the same run: 2 x num_layers all-reduces of a [batch, hidden] bf16 tensor (after
attention and after the MLP), captured in one CUDA graph and replayed, so the figure is the collectives' own
time without their launch cost. Rows report the step, its floor, the share of the floor reached, and the same
share for the step less its all-reduces (how much of the gap to the floor is NCCL's).

Prefill rows (--prefill-lens): one prompt computed whole in one step, eager, against the same kind of floor
(its FLOPs, or its weights + the KV it writes), its all-reduces timed alone as for decode ([length, hidden]):
what splitting a prompt over N GPUs does to its time to first token.

`--profile B,C` runs torch.profiler on rank 0 over a few steps of batch B at context C after the rows (CUDA
graphs, then eager), and prints and saves (beside the JSON, .profile.txt) its table of device time by kernel and
host time by call: where a step's time goes beyond the floor.

Every rank also records each step's host timeline (bench/tp_timeline.py): the medians are printed last and kept in
the JSON as host_timeline_us.

Writes bench/results/tp_decode_<model>_tp<N>_<gpu>.json (--out to change).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.dvc_deployments import free_port
from bench.tp_decode_ranks import run_rank  # each spawned rank's work; rank 0 writes the JSON
from bench.tp_timeline import report_timeline


@dataclass(frozen=True)
class Settings:
    model: str
    tp: int
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    prefill_lens: tuple[int, ...]
    warmup: int
    reps: int
    device: str  # "cuda" or "cpu" (--smoke)
    gpu_memory_utilization: float
    profile: tuple[int, int] | None = None  # (batch, context) to profile on rank 0 after the rows
    # parallel.all_reduce: "auto" (symmetric memory for small sums where usable) or "nccl"
    all_reduce: str = "auto"
    step_channel: str = (
        "shm"  # how the lead's steps reach the other ranks: "shm" (the engine's way) or "gloo"
    )


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-")


def default_out(settings: Settings) -> str:
    gpu = torch.cuda.get_device_name() if settings.device == "cuda" else "cpu"
    name = f"tp_decode_{_slug(settings.model)}_tp{settings.tp}_{_slug(gpu)}.json"
    return str(Path(__file__).parent / "results" / name)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="dummy:llama-3-70b")
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--batches", default="32,64,128")
    parser.add_argument("--contexts", default="512,2048")
    parser.add_argument(
        "--prefill-lens", default="2048,4096", help="prompt lengths for the prefill rows ('' for none)"
    )
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument(
        "--profile", default=None, help="B,C: profile batch B at context C on rank 0 after the rows"
    )
    parser.add_argument(
        "--all-reduce",
        choices=("auto", "nccl"),
        default="auto",
        help="parallel.all_reduce: auto = small sums over CUDA symmetric memory where every rank can",
    )
    parser.add_argument(
        "--step-channel",
        choices=("shm", "gloo"),
        default="shm",
        help="the steps' way to the other ranks: the shared-memory ring (the engine's) or gloo broadcasts",
    )
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo, dummy:tiny-llama, TP=2, a few steps")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    profile_at = None
    if args.profile:
        try:
            b, c = (int(v) for v in args.profile.split(","))
        except ValueError:
            parser.error(f"--profile: expected BATCH,CONTEXT such as 32,512, got {args.profile!r}")
        profile_at = (b, c)
    if args.smoke:
        settings = Settings(
            "dummy:tiny-llama",
            2,
            (2, 4),
            (32,),
            (48,),
            1,
            3,
            "cpu",
            0.9,
            profile_at,
            args.all_reduce,
            args.step_channel,
        )
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench/tp_decode.py needs CUDA GPUs (or --smoke on CPU)")
        if torch.cuda.device_count() < args.tp:
            raise SystemExit(
                f"--tp {args.tp} needs {args.tp} GPUs, this machine has {torch.cuda.device_count()}"
            )
        settings = Settings(
            args.model,
            args.tp,
            tuple(int(b) for b in args.batches.split(",")),
            tuple(int(c) for c in args.contexts.split(",")),
            tuple(int(n) for n in args.prefill_lens.split(",") if n),
            args.warmup,
            args.reps,
            "cuda",
            args.gpu_memory_utilization,
            profile_at,
            args.all_reduce,
            args.step_channel,
        )
    out = args.out or default_out(settings)
    # NVLink multicast stays off unless the caller set it (../shared/gpu/README.md: it can take a shared host's
    # GPUs out of service); the ranks inherit this environment.
    for name, value in (
        ("NCCL_NVLS_ENABLE", "0"),
        ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
        ("NVSHMEM_DISABLE_NVLS", "1"),
    ):
        os.environ.setdefault(name, value)
    # spawn: a rank that raises ends the others and raises here with its traceback.
    torch.multiprocessing.spawn(run_rank, args=(settings, free_port(), out), nprocs=settings.tp, join=True)
    report_timeline(out, settings.tp)


if __name__ == "__main__":
    main()
