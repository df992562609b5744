"""What the fast-path GPU benchmarks share (bench/offline_throughput.py, bench/ttft.py): device rates measured
in the same run (HBM bandwidth as read + write bytes of a large device-to-device copy, as bench/decode_step.py
measures it, and an n^3 matmul in the model dtype), engine construction and step timing, the tiny smoke model,
the run's budget, progress lines and its JSON document. The arithmetic floors the results are compared against
are bench/floors.py's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model_runtime.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from model_runtime.engine import Engine
from model_runtime.weights import load_model_config, resolve_model
from tandem_cli.bench.report import git_commit

BLOCK_SIZE = 16
RESULTS_DIR = Path(__file__).resolve().parent / "results"
T = TypeVar("T")


class BenchError(RuntimeError):
    """A result that cannot be trusted (wrong token count, nothing fit); the message says why."""


def log(message: str) -> None:
    """Progress line on stderr (stdout holds the result table)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def device_name(device: str) -> str:
    return torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"


class Deadline:
    """Wall-clock budget counted from construction (the script's start): no new job starts once it is spent,
    and a running job stops itself `grace_s` later (its row is then marked incomplete)."""

    def __init__(self, budget_s: float, grace_s: float = 20.0) -> None:
        if budget_s <= 0:
            raise ValueError(f"--budget-s: must be > 0, got {budget_s}")
        self.start, self.budget_s, self.grace_s = time.monotonic(), budget_s, grace_s

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def spent(self) -> bool:
        return self.elapsed() >= self.budget_s

    def must_stop(self) -> bool:
        return self.elapsed() >= self.budget_s + self.grace_s


def write_json_atomic(path: Path, doc: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(doc, indent=2) + "\n")
    os.replace(tmp, path)


class BenchRun:
    """One run's JSON document, rewritten after every job so a timeout keeps what finished. A job is skipped
    once the budget is spent; a job that raises is printed and recorded, and the next job still runs."""

    def __init__(self, stem: str, benchmark: str, args: Any, where: RunDevice, deadline: Deadline) -> None:
        """`args`: the script's parsed flags (recorded; --out and --smoke pick the path)."""
        self.path, self.deadline = result_path(args.out, stem, where.device, args.smoke), deadline
        self.skipped: list[str] = []
        self.errors: list[dict[str, str]] = []
        self.doc: dict[str, Any] = {
            "benchmark": benchmark,
            "gpu": device_name(where.device),
            "smoke": args.smoke,
            "torch": torch.__version__,
            "commit": git_commit(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "settings": {"dtype": where.dtype, "graphs": not where.eager, **vars(args)},
            "skipped": self.skipped,
            "errors": self.errors,
        }

    def measure_rates(self, where: RunDevice) -> DeviceRates:
        """GPU: a 2 GiB copy and an 8192^3 matmul (and in FP8 on sm_90+); CPU (smoke): sizes it does in
        milliseconds."""
        copy_bytes, n = (16 * 2**20, 256) if where.device == "cpu" else (2 * 2**30, 8192)
        log(f"measuring a {copy_bytes / 2**20:.0f} MiB copy and the {n}^3 {where.dtype} matmul rate")
        copy_gbps = measure_copy_gbps(where.device, copy_bytes)
        rates = DeviceRates(
            copy_gbps,
            measure_matmul_tflops(where.device, where.torch_dtype, n),
            measure_fp8_matmul_tflops(where.device, n),
        )
        if where.device.startswith("cuda"):
            torch.cuda.empty_cache()
        fp8 = f", FP8 matmul {rates.fp8_matmul_tflops:.4g} TFLOP/s" if rates.fp8_matmul_tflops else ""
        log(f"copy {rates.hbm_gbps:.4g} GB/s, matmul {rates.matmul_tflops:.4g} TFLOP/s{fp8}")
        self.doc["rates"] = {**dataclasses.asdict(rates), "matmul_n": n}
        self.save()
        return rates

    def save(self) -> None:
        self.doc["elapsed_s"] = round(self.deadline.elapsed(), 1)
        write_json_atomic(self.path, self.doc)

    def job(self, name: str, fn: Callable[[], T]) -> T | None:
        if self.deadline.spent():
            log(f"{name}: skipped, the budget of {self.deadline.budget_s:.0f} s is spent")
            self.skipped.append(name)
            self.save()
            return None
        try:
            return fn()
        except Exception as exc:  # loud (traceback, JSON, exit status), but the remaining jobs still run
            traceback.print_exc()
            self.errors.append({"job": name, "error": f"{type(exc).__name__}: {exc}"})
            self.save()
            return None

    def finish(self) -> None:
        """Final save; exits with status 1 when any job raised."""
        self.doc["complete"] = not self.errors and not self.skipped
        self.save()
        print(f"wrote {self.path}")
        if self.errors:
            raise SystemExit(f"{len(self.errors)} job(s) failed: {[e['job'] for e in self.errors]}")


def result_path(out: str | None, stem: str, device: str, smoke: bool) -> Path:
    """--out when given (a folder that exists gets the default file name inside it: a run must not measure for
    minutes and then fail to write); smoke runs default to a temp dir so they never touch bench/results."""
    if smoke:
        name = f"{stem}_smoke.json"
    else:
        # The card's name as the other benches write it.
        slug = re.sub(r"[^a-z0-9]+", "-", device_name(device).lower()).strip("-")
        name = f"{stem}_{slug}.json"
    if out:
        return Path(out) / name if Path(out).is_dir() else Path(out)
    return (Path(tempfile.gettempdir()) if smoke else RESULTS_DIR) / name


# --- measured device rates -------------------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceRates:
    hbm_gbps: float  # read + write bytes per second of a large copy, in GB/s
    matmul_tflops: float  # dense n x n x n matmul in the model dtype
    # The same with e4m3 operands and bfloat16 out (torch._scaled_mm, row-wise scales, fast accumulation, as the
    # FP8 projections run); 0 where not measured (no FP8 tensor cores, the CPU): FP8 FLOPs then count at
    # matmul_tflops.
    fp8_matmul_tflops: float = 0.0

    @property
    def bytes_per_s(self) -> float:
        return self.hbm_gbps * 1e9

    @property
    def flops_per_s(self) -> float:
        return self.matmul_tflops * 1e12

    def compute_s(self, flops: float, fp8_flops: float = 0.0) -> float:
        """`flops` at the model dtype's matmul rate plus `fp8_flops` at the FP8 rate."""
        fp8_rate = self.fp8_matmul_tflops * 1e12 or self.flops_per_s
        return flops / self.flops_per_s + fp8_flops / fp8_rate

    def step_floor_s(self, flops: float, nbytes: float, fp8_flops: float = 0.0) -> float:
        """A step is no faster than its FLOPs at the matmul rates, nor than its bytes at the HBM rate."""
        return max(self.compute_s(flops, fp8_flops), nbytes / self.bytes_per_s)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], device: str, warmup: int, reps: int) -> float:
    """Median wall time of fn: CUDA events on a GPU, perf_counter around a synchronised call elsewhere."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(reps):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_copy_gbps(device: str, nbytes: int, reps: int = 20) -> float:
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), device, warmup=3, reps=reps)
    return 2 * nbytes / seconds / 1e9


def measure_fp8_matmul_tflops(device: str, n: int, reps: int = 10) -> float:
    """n x n x n with e4m3 operands and bfloat16 out, as an FP8 projection runs (row-wise scales, fast
    accumulation); 0.0 where torch._scaled_mm has no FP8 path (before sm_90, the CPU)."""
    if not device.startswith("cuda") or torch.cuda.get_device_capability(device) < (9, 0):
        return 0.0
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants it
    scale_a, scale_b = torch.ones(n, 1, device=device), torch.ones(1, n, device=device)

    def mm() -> torch.Tensor:
        return torch._scaled_mm(
            a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16, use_fast_accum=True
        )

    seconds = median_seconds(mm, device, warmup=3, reps=reps)
    return 2 * n**3 / seconds / 1e12


def measure_matmul_tflops(device: str, dtype: torch.dtype, n: int, reps: int = 10) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    seconds = median_seconds(lambda: torch.matmul(a, b, out=out), device, warmup=3, reps=reps)
    return 2 * n**3 / seconds / 1e12


@dataclass(frozen=True)
class RunDevice:
    """Where a benchmark runs: the GPU in bf16 with CUDA graphs, or (--smoke) the CPU in float32, eager."""

    device: str
    dtype: str
    eager: bool

    @classmethod
    def for_mode(cls, smoke: bool) -> RunDevice:
        if smoke:
            return cls("cpu", "float32", eager=True)
        if not torch.cuda.is_available():
            raise SystemExit("this benchmark needs a CUDA GPU (or --smoke for the CPU check)")
        return cls("cuda", "bfloat16", eager=False)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def dtype_bytes(self) -> int:
        return self.torch_dtype.itemsize


def build_engine(
    model: str,
    where: RunDevice,
    scheduler: SchedulerConfig,
    memory_fraction: float,
    prefix_caching: bool = False,
    quantization: str = "none",
    cache_dtype: str | None = None,
    num_blocks: int | None = None,
    prefill_graph_tokens: int | None = None,
    fp8_fast_accum: bool = True,
    prefill_graph_kv_store: bool = False,
) -> Engine:
    """Prefix caching off unless asked for (random prompts never share blocks; the hashing would only add host
    work); the cache size comes from the engine's memory planner unless `num_blocks` sets it. Token ids out, no
    text (emit_text=False), as the prefill and decode workers run the engine: the router owns detokenization. `quantization` and `cache_dtype`
    are device.quantization and cache.dtype (None: the model dtype),
    `prefill_graph_tokens` device.prefill_graph_tokens (None: its default), `fp8_fast_accum` device.fp8_fast_accum,
    `prefill_graph_kv_store` device.prefill_graph_kv_store."""
    graphs, kv = "off" if where.eager else "on", cache_dtype or where.dtype
    log(
        f"building engine: {model}, {where.device} {where.dtype}, weights {quantization}, KV {kv}, graphs {graphs}"
    )
    t0 = time.perf_counter()
    cache = CacheConfig(
        BLOCK_SIZE,
        dtype=cache_dtype,
        enable_prefix_caching=prefix_caching,
        gpu_memory_utilization=memory_fraction,
        num_blocks=num_blocks,
    )
    device = DeviceConfig(device=where.device, dtype=where.dtype, enforce_eager=where.eager,
                          quantization=quantization, fp8_fast_accum=fp8_fast_accum,
                          prefill_graph_kv_store=prefill_graph_kv_store)  # fmt: skip
    if prefill_graph_tokens is not None:
        device = dataclasses.replace(device, prefill_graph_tokens=prefill_graph_tokens)
    config = EngineConfig(model=model, cache=cache, scheduler=scheduler, device=device)
    engine = Engine(config, emit_text=False)
    if (engine.runner.graphs is None) != where.eager:
        raise BenchError(f"CUDA graphs should be {'off' if where.eager else 'on'} but the runner disagrees")
    synchronize(where.device)
    blocks, gib = engine.layout.num_blocks, engine.layout.total_bytes / 2**30
    log(f"engine ready in {time.perf_counter() - t0:.1f} s: {blocks} KV blocks ({gib:.1f} GiB)")
    return engine


@dataclass(frozen=True)
class OpenedRun:
    run: BenchRun
    where: RunDevice
    model: str  # what --model named, or the default for the mode
    config: ModelConfig


def open_run(stem: str, benchmark: str, args: Any) -> OpenedRun:
    """The start the single-GPU engine benchmarks share: the budget (args.budget_s), the device (the GPU, or the
    CPU with --smoke), the model (args.model; by default dummy:llama-3-8b, or with --smoke a tiny Hugging Face
    model written for the run) and its config, and the run's JSON document."""
    deadline = Deadline(args.budget_s)
    where = RunDevice.for_mode(args.smoke)
    model = args.model or (smoke_model_dir() if args.smoke else "dummy:llama-3-8b")
    config = load_model_config(resolve_model(model))
    return OpenedRun(BenchRun(stem, benchmark, args, where, deadline), where, model, config)


def smoke_model_dir() -> str:
    """A tiny random Hugging Face model written to a temp dir (the tests' writer; no hub access)."""
    from tests.model.tiny_models import write_tiny_hf

    return str(write_tiny_hf(Path(tempfile.mkdtemp(prefix="tandem-bench-smoke-"))))


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Random token ids, avoiding the first few ids (special tokens in most vocabularies)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count, length), generator=gen).tolist()
