"""Time to first token of one random prompt on one GPU, against its FLOP floor (issue "GPU fast path",
benchmark 3). Llama-3-8B shape (dummy:llama-3-8b), bf16, CUDA graphs on, cache from the memory planner.

GPU, one command (a minute or two; with the gguf wheel of ../shared/gpu/make-kit.sh on PYTHONPATH, as every
command there):

    python3 bench/ttft.py                               # 2048-token prompts
    python3 bench/ttft.py --prompt-lens 512,2048,8192   # more lengths
    python3 bench/ttft.py --smoke                       # the CPU check: tiny model, seconds
    python3 bench/ttft.py --cached-prefix 2048 --prompt-lens 128,512   # a 2048-token cached system prompt + N

One rep: a fresh random prompt (prefix caching is off as well, so nothing cached can help), add_request at t0,
step the engine until it returns the request's first token (the sampler's .tolist() has synchronised), TTFT =
now - t0. --max-num-batched-tokens defaults to the longest prompt, so a prompt is one prefill step. --warmup
reps per length first (kernel compilation), then the median of --reps.
With --cached-prefix P, prefix caching is on and every prompt is the same P tokens (a system prompt, computed
once by the warm-up reps, which must be >= 1) followed by --prompt-lens fresh tokens: TTFT of a prompt whose
start the cache already holds, the floor counting only the new tokens (attending to P + their own).
Floor: the prompt's FLOPs at the matmul rate measured in the same run (8192^3 bf16): 2 x layer matmul params x
tokens + causal attention (4 x layers x heads x head_dim x L(L+1)/2) + one logits row. Reading every weight
once at the measured HBM copy rate is reported too; floor = the larger. fraction = floor / median TTFT.
With --background N, N requests keep decoding beside every timed prompt, which then runs in mixed steps as
in a colocated worker (`--background 2 --max-num-seqs 256 --max-model-len 8192 --max-num-batched-tokens 2048`
is a colocated worker of bench-colocated.yaml at 1-2 req/s, without its threads).
--variant (bench/offline_variants.VARIANTS: bf16, fp8, fp8-exact, ...) builds the engine with that variant's
weights, KV cache and FP8 accumulation; with FP8 weights the floor counts the projections' FLOPs at the FP8
matmul rate measured in the same run (8192^3 e4m3, torch._scaled_mm), attention's and lm_head's at bf16's.
`--variant fp8 --profile` names where an FP8 prefill's time goes (issue 19).
--decode-gather on,off times every length twice on the same engine: with --background's decodes attended in
the prompt's FlashAttention call over their gathered contexts (device.decode_gather_tokens, the default: on)
and in the paged decode kernel (off), the runner's setting switched between them; each mode draws its own
prompts, so the second is not served from the first's cache. With --profile, one profile per mode.
--chunk-kernel on,off times every length with a cached prefix twice more on the same engine: the chunk and
the decodes gathered beside it attended straight from the pages by the split-KV chunk kernel
(device.chunk_attention_tokens, the default: on) or gathered for one FlashAttention-2 call (off).
--graph-kv-store builds the engine with the KV store inside the piecewise prefill graphs (one eager launch
fewer per layer; device.prefill_graph_kv_store): a setting of graph capture, so it is compared across two runs.
Prints a table (stdout), progress (stderr), and rewrites bench/results/ttft_<gpu>.json after each length.
Exit status 1 when a length raised (traceback on stderr, message in the JSON's "errors").
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import floors
from bench import harness as gpu
from bench.offline_variants import VARIANTS
from bench.step_probe import StepProbe
from model_runtime.config import SchedulerConfig
from model_runtime.engine import Engine
from model_runtime.request import SamplingParams

BENCHMARK = "time to first token of one random prompt vs its FLOP floor at the measured matmul rate"


@dataclass(frozen=True)
class TTFTFloor:
    flops: float
    flop_s: float  # the prompt's FLOPs at the matmul rate
    weight_read_s: float  # every weight read once at the HBM rate
    floor_s: float  # the larger of the two


def ttft_floor(cost: floors.ModelCost, rates: gpu.DeviceRates, prompt_len: int, cached: int = 0) -> TTFTFloor:
    """The prompt's FLOPs (its uncached tokens) at the matmul rates (FP8 projections' at the FP8 rate where it
    was measured), and reading every weight once at the HBM rate."""
    flops = cost.prefill_flops(prompt_len, cached)
    flop_s = cost.compute_s(rates, flops, prompt_len - cached)
    read_s = cost.weight_bytes_read / rates.bytes_per_s
    return TTFTFloor(flops, flop_s, read_s, max(flop_s, read_s))


@dataclass(frozen=True)
class TTFTRow:
    prompt_len: int  # new tokens (after the cached prefix, if any)
    reps: int
    median_ms: float
    min_ms: float
    max_ms: float
    steps_to_first_token: int
    step_ms: float  # median time inside engine.step() calls (TTFT less add_request and the loop around steps)
    floor: TTFTFloor
    fraction_of_flop_floor: float  # flop floor / median TTFT
    fraction_of_floor: float  # max(flop, weight-read) floor / median TTFT
    achieved_tflops: float  # prompt FLOPs / median TTFT
    cached_prefix: int = 0  # tokens before prompt_len that the prefix cache held (--cached-prefix)
    decode_gather: str = "on"  # the background decodes gathered with the prompt (on) or in the decode kernel
    # a cached group read by the split-KV chunk kernel (on) or gathered for FlashAttention-2 (off)
    chunk_kernel: str = "on"


def ttft_once(
    engine: Engine, prompt: list[int], request_id: str, deadline: gpu.Deadline, cached: int = 0
) -> tuple[float, int, float]:
    """(seconds to the first token, engine steps it took, seconds inside those steps); with `cached` > 0 the
    engine must report at least that many prompt tokens (rounded down to whole blocks) as served by its cache."""
    sampling = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    probe = StepProbe(engine)
    try:
        gpu.synchronize(str(engine.device))
        t0 = time.perf_counter()
        engine.add_request(request_id, prompt, sampling)
        while not (first := [o for o in probe.step() if o.request_id == request_id and o.token_ids]):
            if not engine.has_unfinished() or deadline.must_stop():
                raise gpu.BenchError(f"{request_id}: no first token (engine idle or out of time)")
        seconds = time.perf_counter() - t0
        expected = cached - cached % engine.config.cache.block_size
        if first[0].num_cached_tokens < expected:
            raise gpu.BenchError(
                f"{request_id}: {first[0].num_cached_tokens} tokens cached, expected {expected}"
            )
    finally:
        probe.close()
        engine.abort(request_id)  # no-op once max_tokens=1 finished it; frees its blocks otherwise
    s = probe.split
    return seconds, s.prefill_steps + s.decode_steps, s.prefill_s + s.decode_s


def run_length(
    engine: Engine,
    prompt_len: int,
    args: argparse.Namespace,
    setup: Setup,
    mode: str = "on",
    chunk: str = "on",
) -> TTFTRow:
    """One length's reps. `mode`: --decode-gather's, which the caller has set on the runner; it draws its own
    prompts (a second mode's would otherwise be the first's, whole in the prefix cache)."""
    vocab = engine.model_config.vocab_size
    seed = prompt_len + (0 if mode == "on" else 1_000_003) + (0 if chunk == "on" else 2_000_029)
    prompts = gpu.random_prompts(args.warmup + args.reps, prompt_len, vocab, seed=seed)
    prefix = gpu.random_prompts(1, args.cached_prefix, vocab, seed=7)[0] if args.cached_prefix else []
    prompts = [prefix + p for p in prompts]
    gpu.log(
        f"ttft {prompt_len} (+{args.cached_prefix} cached): {args.warmup} warm-up + {args.reps} timed reps"
    )
    deadline = setup.run.deadline
    results = [
        ttft_once(engine, p, f"ttft-{prompt_len}-{mode}-{i}", deadline, args.cached_prefix if i else 0)
        for i, p in enumerate(prompts)
    ]
    timed = results[args.warmup :]
    ttfts = [t for t, _, _ in timed]
    median = statistics.median(ttfts)
    floor = ttft_floor(setup.cost, setup.rates, prompt_len + args.cached_prefix, args.cached_prefix)
    return TTFTRow(
        prompt_len=prompt_len,
        reps=len(timed),
        median_ms=1e3 * median,
        min_ms=1e3 * min(ttfts),
        max_ms=1e3 * max(ttfts),
        steps_to_first_token=max(steps for _, steps, _ in timed),
        step_ms=1e3 * statistics.median(s for _, _, s in timed),
        floor=floor,
        fraction_of_flop_floor=floor.flop_s / median,
        fraction_of_floor=floor.floor_s / median,
        achieved_tflops=floor.flops / median / 1e12,
        cached_prefix=args.cached_prefix,
        decode_gather=mode,
        chunk_kernel=chunk,
    )


def profile_prefill(engine: Engine, prompt_len: int, cached_prefix: int = 0) -> dict:
    """Where one prompt's prefill spends its GPU time (kernels grouped by name, per prompt)."""
    from bench.step_profile import print_profile, profile_step

    vocab = engine.model_config.vocab_size
    prefix = gpu.random_prompts(1, cached_prefix, vocab, seed=7)[0] if cached_prefix else []
    prompts = iter(prefix + p for p in gpu.random_prompts(16, prompt_len, vocab, seed=1))
    counter = iter(range(16))
    deadline = gpu.Deadline(120.0)

    def once() -> None:
        ttft_once(engine, next(prompts), f"profile-{next(counter)}", deadline)

    p = profile_step(once, reps=5)
    print_profile(f"prefill of {prompt_len} tokens (+{cached_prefix} cached)", p)
    return dataclasses.asdict(p)


class BusyThreads:
    """`n` threads that each wake every 5 ms and spend about 0.2 ms in Python, as a worker's token streams and
    RPC handlers do, with the workers' GIL switch interval set: the engine thread then has to win the GIL back
    for every kernel launch of an eager step, as it does in the service."""

    def __init__(self, n: int) -> None:
        from worker_host.lifecycle import switch_interval

        sys.setswitchinterval(switch_interval())
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(n)]
        for t in self._threads:
            t.start()
        gpu.log(f"{n} busy threads, GIL switch interval {sys.getswitchinterval() * 1e3:g} ms")

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            end = time.perf_counter() + 0.0002
            while time.perf_counter() < end:
                pass

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()


BACKGROUND_PROMPT = 64


def start_background(engine: Engine, n: int, max_model_len: int) -> None:
    """`n` requests that decode until the engine stops (ignore_eos, as long as the model length allows), each
    from its own random 64-token prompt: every timed prompt then runs in a mixed step with n decodes."""
    prompts = gpu.random_prompts(n, BACKGROUND_PROMPT, engine.model_config.vocab_size, seed=11)
    sampling = SamplingParams(temperature=0, max_tokens=max_model_len - BACKGROUND_PROMPT, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"background-{i}", prompt, sampling)
    engine.step()  # their prefill, so the first timed prompt already meets them decoding
    gpu.log(f"{n} background requests decoding")


@dataclass(frozen=True)
class Setup:
    rates: gpu.DeviceRates
    cost: floors.ModelCost
    run: gpu.BenchRun


def print_table(doc: dict) -> None:
    rates = doc.get("rates", {})
    print(
        f"\nTTFT on {doc['gpu']} ({doc['settings']['dtype']}, variant {doc.get('variant', 'bf16')}), "
        f"matmul {rates.get('matmul_tflops', 0):.4g} TFLOP/s"
    )
    print(
        f"{'prompt':>7} {'cached':>6} {'gather':>6} {'chunk':>5} {'ttft ms':>8} {'step ms':>8} {'flop floor':>10} {'% flop':>6} "
        f"{'read floor':>10} {'TFLOP/s':>8} steps"
    )
    for r in doc["rows"]:
        f = r["floor"]
        print(
            f"{r['prompt_len']:>7} {r['cached_prefix']:>6} {r['decode_gather']:>6} {r.get('chunk_kernel', 'on'):>5} "
            f"{r['median_ms']:>8.2f} "
            f"{r['step_ms']:>8.2f} {1e3 * f['flop_s']:>10.2f} {r['fraction_of_flop_floor']:>6.0%} "
            f"{1e3 * f['weight_read_s']:>10.2f} {r['achieved_tflops']:>8.1f} {r['steps_to_first_token']}"
        )
    for key in ("skipped", "errors"):
        if doc[key]:
            print(f"{key}: {doc[key]}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="default dummy:llama-3-8b (smoke: a tiny HF model)")
    p.add_argument("--prompt-lens", help="comma-separated prompt lengths (default 2048; smoke 16,32)")
    p.add_argument("--reps", type=int, help="timed reps per length (default 10; smoke 3)")
    p.add_argument("--warmup", type=int, default=2, help="untimed reps per length first")
    p.add_argument(
        "--max-num-batched-tokens", type=int, help="prefill chunk budget (default: longest prompt)"
    )
    p.add_argument(
        "--cached-prefix", type=int, default=0, help="a shared prefix of this many tokens, cached (default 0)"
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.90)
    # The service's limits (deploy/configs/bench-*.yaml: 256, 8192), to tell their cost from the service's own.
    p.add_argument("--max-num-seqs", type=int, default=4, help="scheduler limit (default 4: one at a time)")
    p.add_argument("--max-model-len", type=int, help="scheduler limit (default: the longest prompt + 16)")
    p.add_argument(
        "--busy-threads",
        type=int,
        default=0,
        help="Python threads that wake every 5 ms for ~0.2 ms of work, as a worker's gRPC streams do "
        "(default 0), under the workers' GIL switch interval: how much other threads slow the engine thread",
    )
    p.add_argument(
        "--background",
        type=int,
        default=0,
        help="requests that keep decoding while each timed prompt runs (default 0), so that its prefill "
        "shares mixed steps with decodes as in a colocated worker",
    )
    p.add_argument(
        "--budget-s", type=float, default=540.0, help="start no new length after this many seconds"
    )
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, short prompts, float32, no graphs")
    p.add_argument("--profile", action="store_true", help="kernel breakdown of the longest prompt (GPU)")
    p.add_argument(
        "--variant",
        default="bf16",
        choices=sorted(VARIANTS),
        help="weights, KV cache and FP8 accumulation as bench/offline_variants.py names them (default bf16)",
    )
    p.add_argument(
        "--decode-gather",
        default="on",
        help="comma-separated modes timed per length on one engine: on (--background's decodes attended with "
        "the prompt over gathered contexts, device.decode_gather_tokens, the default), off (the decode kernel)",
    )
    p.add_argument(
        "--chunk-kernel",
        default="on",
        help="comma-separated modes timed per length on one engine: on (a chunk over a cached prefix, and the "
        "decodes beside it, read from the pages by the split-KV chunk kernel, device.chunk_attention_tokens, the "
        "default), off (gathered for one FlashAttention-2 call)",
    )
    p.add_argument(
        "--chunk-attention-tokens",
        type=int,
        help="the chunk kernel's limit in --chunk-kernel's on mode (device.chunk_attention_tokens; default the "
        "engine's): a cached group of more query rows is gathered for FlashAttention-2",
    )
    p.add_argument(
        "--graph-kv-store",
        action="store_true",
        help="the piecewise prefill graphs store each layer's K/V (device.prefill_graph_kv_store; default: the "
        "eager attention stores them); run once with and once without to compare",
    )
    p.add_argument("--out", help="JSON path (default bench/results/ttft_<gpu>.json)")
    args = p.parse_args(argv)
    args.prompt_lens = args.prompt_lens or ("16,32" if args.smoke else "2048")
    args.reps = args.reps or (3 if args.smoke else 10)
    lens = [int(n) for n in args.prompt_lens.split(",") if n.strip()]
    if not lens or min(lens) < 1 or args.reps < 1 or args.warmup < 0:
        raise SystemExit("--prompt-lens, --reps: need positive integers (and --warmup >= 0)")
    if args.background < 0:
        raise SystemExit("--background: needs >= 0 requests")
    if args.cached_prefix < 0 or (args.cached_prefix and args.warmup < 1):
        raise SystemExit("--cached-prefix: needs >= 0 tokens, and --warmup >= 1 to cache them first")
    args.lens = lens
    args.gather_modes = on_off_modes("--decode-gather", args.decode_gather)
    args.chunk_modes = on_off_modes("--chunk-kernel", args.chunk_kernel)
    return args


def on_off_modes(flag: str, text: str) -> list[str]:
    """A comma-separated list of on and/or off, each at most once."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes or set(modes) - {"on", "off"} or len(set(modes)) < len(modes):
        raise SystemExit(f"{flag}: on and/or off, each once, got {text!r}")
    return modes


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    opened = gpu.open_run("ttft", BENCHMARK, args)
    run, where, model, mc = opened.run, opened.where, opened.model, opened.config
    v = VARIANTS[args.variant]
    cost = v.cost(mc, where.dtype_bytes)  # the weight read floor in the variant's bytes
    run.doc.update(model=model, model_cost=dataclasses.asdict(cost), rows=[])
    setup = Setup(run.measure_rates(where), cost, run)
    longest = max(args.lens)
    # A few sequences only: TTFT runs one request at a time (and fewer decode graphs to capture).
    total = longest + args.cached_prefix
    limits = SchedulerConfig(
        args.max_num_seqs,
        args.max_num_batched_tokens or total,
        max_model_len=args.max_model_len or total + 16,
    )
    if args.background and (limits.max_model_len or 0) <= BACKGROUND_PROMPT + 1:
        raise SystemExit(
            f"--background: the model length {limits.max_model_len} leaves the background requests no room to "
            f"decode past their {BACKGROUND_PROMPT}-token prompts: pass a larger --max-model-len"
        )
    run.doc.update(variant=v.name, prefill_graph_kv_store=args.graph_kv_store)
    build = partial(
        gpu.build_engine, model, where, limits, args.gpu_memory_utilization, args.cached_prefix > 0,
        quantization=v.quantization, cache_dtype=v.cache_dtype, fp8_fast_accum=v.fast_accum,
        prefill_graph_kv_store=args.graph_kv_store,
    )  # fmt: skip
    engine = run.job("engine", build)
    if engine is not None and args.graph_kv_store and engine.runner.prefill_graphs is None:
        gpu.log(
            "--graph-kv-store: this engine has no piecewise prefill graphs (CPU or eager): it changes nothing"
        )
    noise = BusyThreads(args.busy_threads) if args.busy_threads else None
    if engine is not None and args.background:
        start_background(engine, args.background, limits.max_model_len or total + 16)
    gather = engine.runner.decode_gather_tokens if engine is not None else 0
    run.doc["decode_gather_tokens"] = gather

    backend = engine.runner.backend if engine is not None else None
    chunk_tokens = backend.chunk_attention_tokens if backend is not None else 0
    if args.chunk_attention_tokens is not None and backend is not None and chunk_tokens:
        chunk_tokens = backend.chunk_attention_tokens = args.chunk_attention_tokens
    run.doc["chunk_attention_tokens"] = chunk_tokens

    def set_mode(mode: str, chunk: str = "on") -> None:
        assert engine is not None
        engine.runner.decode_gather_tokens = gather if mode == "on" else 0
        if backend is not None and chunk_tokens:
            backend.chunk_attention_tokens = chunk_tokens if chunk == "on" else 0

    for prompt_len in args.lens:
        if engine is None:  # the engine job failed or was skipped (recorded)
            break
        for mode, chunk in itertools.product(args.gather_modes, args.chunk_modes):
            set_mode(mode, chunk)
            name = f"ttft {prompt_len}" + (f" gather {mode}" if len(args.gather_modes) > 1 else "")
            name += f" chunk kernel {chunk}" if len(args.chunk_modes) > 1 else ""
            row = run.job(name, partial(run_length, engine, prompt_len, args, setup, mode, chunk))
            if row is not None:
                run.doc["rows"].append(dataclasses.asdict(row))
                run.save()
                gpu.log(f"{name}: {row.median_ms:.2f} ms, {row.fraction_of_flop_floor:.0%} of FLOP floor")
    if noise is not None:
        noise.stop()
    if args.profile and engine is not None and not args.smoke:
        profiles = {}
        for mode, chunk in itertools.product(args.gather_modes, args.chunk_modes):  # one profile per mode
            set_mode(mode, chunk)
            key = mode if len(args.chunk_modes) == 1 else f"gather {mode} chunk {chunk}"
            profiles[key] = run.job(
                f"profile gather {mode} chunk kernel {chunk}",
                partial(profile_prefill, engine, longest, args.cached_prefix),
            )
        run.doc["profile"] = profiles if len(profiles) > 1 else next(iter(profiles.values()))
        run.save()
    if engine is not None:
        set_mode("on")
    print_table(run.doc)
    run.finish()
    return run.path


if __name__ == "__main__":
    main()
