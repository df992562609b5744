"""KV handoff benchmark: Llama-3-8B KV layout between two processes on two GPUs.

For each transport (nccl, cuda_ipc, and tcp up to 2k tokens) and prompt length (128 ... 32k tokens) it times the
whole handoff as the service runs it: the decode process reserves blocks, hands the KVTarget to the prefill
process (a pipe stands in for the router hop), the prefill process sends its blocks, the decode process is told
they landed. Next to it, in the same run and on the same cards, the raw baselines for one contiguous buffer of
the same size (bench/kv_raw.py): CuPy NCCL send/recv, torch.distributed NCCL send/recv, and a CUDA IPC peer copy.

Self-checking: after each size the decode side's landed blocks and the prefill side's source blocks are compared
by checksum (random bf16 data, scattered block ids on both sides); a mismatch aborts the run.

The raw baselines run first, so a run cut short by a time limit still has them. Each handoff row also gives
the median time of each phase on both sides (SendResult.phases, TransferResult.phases): where the time goes.

Usage: python bench/kv_transfer.py [--quick] [--transports nccl,cuda_ipc,tcp] [--tokens 128,512,...]; prints
a table and writes bench/results/kv_transfer_<gpu-name>.json (medians over --reps after --warmup).
`--smoke --out FILE` runs the same driver on a CPU: tcp only, two short prompts, no raw baselines (a test runs
it; its times mean nothing).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import pathlib
import random
import re
import statistics
import sys
import threading
import time
from typing import Any

# NVLink multicast can take a shared host's GPUs out of service: keep it off in every process (inherited).
os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.kv_raw import raw_times  # noqa: E402
from kv_transfer import FirstToken, KVReceiver, KVSender, TransferConfig, TransferResult, cuda_ipc, slicing  # noqa: E402
from model_runtime.kv_layout import KVLayout  # noqa: E402
from tandem_api.tandem.v1 import kv_pb2  # noqa: E402

TOKENS = (128, 512, 2048, 8192, 32768)
DEFAULT_SLICE_BYTES = slicing.SLICE_BYTES
TCP_MAX_TOKENS = 2048  # tcp stages GPU blocks through host memory: a reference point, not a GPU transport
SPARE_BLOCKS = 64
METHOD = ("handoff: decode-side wall time reserve -> landed (includes the KVTarget pipe hop); send->landed: "
          "the prefill side's send call to the decode side's landing callback (time.monotonic, one host), what a "
          "prompt whose blocks were reserved before its prefill waits; send->ack: prefill-side SendResult.seconds; raw: one contiguous buffer, send timed after the peer posted its "
          "receive (cupy, torch) or a one-sided pull (ipc); medians after warmup")  # fmt: skip


def llama3_8b_layout(max_tokens: int) -> KVLayout:
    """32 layers, 8 KV heads, head dim 128, bf16, block size 16: 128 KiB of KV per token."""
    blocks = -(-max_tokens // 16) + SPARE_BLOCKS
    return KVLayout(
        num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, num_blocks=blocks, dtype="bfloat16"
    )


def transfer_config(kind: str) -> TransferConfig:
    return TransferConfig(
        kind=kind,
        poll_interval_s=0.005,
        transfer_timeout_s=300.0,
        lease_ttl_s=300.0,
        connect_timeout_s=30.0,
        pair_setup_timeout_s=120.0,
    )


def kv_checksum(cache: torch.Tensor, ids: list[int]) -> str:
    """Position-weighted sums of each (layer, K|V, block) of cache[:, :, ids], in ids order, on the GPU."""
    index = torch.tensor(ids, device=cache.device)
    weights = torch.arange(cache[0, 0, 0].numel(), device=cache.device) % 251 + 1
    sums = []
    for layer in range(cache.shape[0]):
        blocks = cache[layer].index_select(1, index).reshape(2, len(ids), -1)
        sums.append((blocks.view(torch.int16).to(torch.int64) * weights).sum(-1))
    return hashlib.sha256(torch.stack(sums).cpu().numpy().tobytes()).hexdigest()


class FreeList:
    """The decode side's block pool: scattered ids, thread-safe."""

    def __init__(self, num_blocks: int) -> None:
        self.ids = list(range(1, num_blocks))
        random.Random(0).shuffle(self.ids)
        self.lock = threading.Lock()

    def allocate(self, n: int) -> list[int] | None:
        with self.lock:
            out, self.ids = self.ids[:n], self.ids[n:]
            return out if len(out) == n else None

    def free(self, ids) -> None:
        with self.lock:
            self.ids.extend(ids)


def apply_variant(label: str) -> tuple[str, str]:
    """A transport label's variant, set in this process: "cuda_ipc+engine" (copy engines instead of the block-copy
    kernel), "nccl+s128" (128 MiB nccl slices instead of slicing.SLICE_BYTES). Returns (transport, variant)."""
    base, _, variant = label.partition("+")
    cuda_ipc.COPY_ENGINE_MAX_RUNS = 10**9 if variant == "engine" else 0
    slicing.SLICE_BYTES = int(variant[1:]) * 2**20 if variant.startswith("s") else DEFAULT_SLICE_BYTES
    return base, variant


# --- the decode process (receiver) ----------------------------------------------------------------------
class Landing:
    """on_result target: the receiver's thread reports, the benchmark loop waits."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.result: TransferResult | None = None
        self.landed_at = 0.0

    def put(self, result: TransferResult) -> None:
        self.landed_at = time.monotonic()  # one clock for both processes (CLOCK_MONOTONIC is host-wide)
        self.result = result
        self.event.set()


def decode_handoffs(
    receiver: KVReceiver, landing: Landing, alloc: FreeList, cache: torch.Tensor, peer, tokens: int, runs: int
) -> tuple[list[float], str, list[dict], list[float]]:
    """Reserve -> KVTarget to the prefill process -> landed, `runs` times; the landed blocks' checksum, each
    run's phases and the moment (time.monotonic) it landed."""
    times, ids, phases, landed = [], [], [], []
    for _ in range(runs):
        landing.event.clear()
        start = time.perf_counter()
        lease = receiver.reserve(f"bench-{tokens}", tokens)
        peer.send(receiver.target(lease).SerializeToString())
        if not landing.event.wait(300) or landing.result is None or not landing.result.ok:
            raise RuntimeError(f"handoff failed: {landing.result}")
        times.append(time.perf_counter() - start)
        landed.append(landing.landed_at)
        phases.append(landing.result.phases)
        ids = list(lease.block_ids)
        alloc.free(ids)  # the blocks are ours after landing; hand them back for the next rep
    peer.send(b"")
    return times, kv_checksum(cache, ids), phases, landed


def use_device(spec: str) -> torch.device:
    """This process's device ("cpu" for --smoke, else "cuda:N"), made current."""
    device = torch.device(spec)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def decode_main(ctl, peer, device_spec: str, max_tokens: int) -> None:
    device = use_device(device_spec)
    layout = llama3_8b_layout(max_tokens)
    cache = torch.zeros(layout.cache_shape, dtype=torch.bfloat16, device=device)
    landing, alloc = Landing(), FreeList(layout.num_blocks)
    receiver, current = None, ""
    state: dict[str, Any] = {}
    while (cmd := ctl.recv()) is not None:
        if cmd[0] == "handoff":
            _, kind, tokens, runs = cmd
            if receiver is None or current != kind:
                if receiver is not None:
                    receiver.close()
                base, _ = apply_variant(kind)
                config = transfer_config(base)
                receiver, current = KVReceiver(layout, cache, alloc, config, on_result=landing.put), kind
            ctl.send(decode_handoffs(receiver, landing, alloc, cache, peer, tokens, runs))
        else:
            ctl.send(raw_times(cmd, 1, peer, device, state))


# --- the prefill process (sender) ------------------------------------------------------------------------
def prefill_handoffs(
    sender: KVSender, cache: torch.Tensor, peer, tokens: int
) -> tuple[list[float], str, list[dict], list[float]]:
    """Serve KVTargets from the decode process until it says stop; the source blocks' checksum, each send's
    phases and the moment (time.monotonic) it was called."""
    n = -(-tokens // 16)
    ids = random.Random(tokens).sample(range(1, cache.shape[2]), n)
    times, phases, starts = [], [], []
    while target := peer.recv():
        lease = kv_pb2.KVTarget.FromString(target)
        starts.append(time.monotonic())
        result = sender.send(lease, ids, tokens, FirstToken(1, -0.1)).result(300)
        if not result.ok:
            raise RuntimeError(f"send failed: {result.failure} {result.message}")
        times.append(result.seconds)
        phases.append(result.phases)
    return times, kv_checksum(cache, ids), phases, starts


def prefill_main(ctl, peer, device_spec: str, max_tokens: int) -> None:
    device = use_device(device_spec)
    layout = llama3_8b_layout(max_tokens)
    gen = torch.Generator(device=device).manual_seed(1)
    cache = torch.randn(layout.cache_shape, generator=gen, device=device).to(torch.bfloat16)  # never all-zero
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # sends pass no `ready` event: the KV writes must be complete
    sender, current = None, ""
    state: dict[str, Any] = {}
    while (cmd := ctl.recv()) is not None:
        if cmd[0] == "handoff":
            _, kind, tokens, _ = cmd
            if sender is None or current != kind:
                if sender is not None:
                    sender.close()
                sender, current = KVSender(layout, cache, transfer_config(apply_variant(kind)[0])), kind
            ctl.send(prefill_handoffs(sender, cache, peer, tokens))
        else:
            ctl.send(raw_times(cmd, 0, peer, device, state))


# --- orchestration ---------------------------------------------------------------------------------------
def median_rate(times: list[float], warmup: int, nbytes: int) -> tuple[float, float]:
    med = statistics.median(times[warmup:])
    return med, nbytes / med / 1e9


def run(args) -> dict:
    ctx = mp.get_context("spawn")
    (ctl_d, ctl_d_child), (ctl_p, ctl_p_child) = ctx.Pipe(), ctx.Pipe()
    peer_d, peer_p = ctx.Pipe()
    gpus, top = (0 if args.smoke else torch.cuda.device_count()), max(args.tokens)
    decode_device = "cpu" if args.smoke else f"cuda:{1 if gpus > 1 else 0}"
    procs = [ctx.Process(target=decode_main, args=(ctl_d_child, peer_d, decode_device, top)),
             ctx.Process(target=prefill_main, args=(ctl_p_child, peer_p, "cpu" if args.smoke else "cuda:0", top))]  # fmt: skip
    for proc in procs:
        proc.start()
    layout = llama3_8b_layout(top)
    try:
        # first: a run cut short still has its baselines (none on a CPU)
        raw = [] if args.smoke else run_raw(args, layout, ctl_d, ctl_p, gpus)
        print_raw(raw)
        rows = [
            row for kind in args.transports for row in run_handoffs(args, kind, layout, ctl_d, ctl_p, gpus)
        ]
    finally:
        for ctl in (ctl_d, ctl_p):
            ctl.send(None)
        for proc in procs:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
    return dict(rows=rows, raw=raw)


def run_handoffs(args, kind: str, layout: KVLayout, ctl_d, ctl_p, gpus: int) -> list[dict]:
    if kind.startswith("nccl") and gpus < 2:
        print("skipping nccl: needs two GPUs")
        return []
    rows = []
    for tokens in [t for t in args.tokens if kind != "tcp" or t <= TCP_MAX_TOKENS]:
        runs = args.warmup + (args.reps if kind != "tcp" else max(3, args.reps // 4))
        for ctl in (ctl_d, ctl_p):
            ctl.send(("handoff", kind, tokens, runs))
        (d_times, d_sum, d_phases, landed), (p_times, p_sum, p_phases, starts) = ctl_d.recv(), ctl_p.recv()
        if d_sum != p_sum:
            raise SystemExit(f"CHECKSUM MISMATCH: {kind} at {tokens} tokens")
        nbytes = layout.bytes_per_block * -(-tokens // 16)
        handoff, handoff_gbps = median_rate(d_times, args.warmup, nbytes)
        send, send_gbps = median_rate(p_times, args.warmup, nbytes)
        landed_s, landed_gbps = median_rate([b - a for a, b in zip(starts, landed)], args.warmup, nbytes)
        phases = dict(
            sender=median_phases(p_phases[args.warmup :]), receiver=median_phases(d_phases[args.warmup :])
        )
        rows.append(dict(transport=kind, tokens=tokens, bytes=nbytes, handoff_s=handoff, handoff_gbps=handoff_gbps,
                         send_to_ack_s=send, send_to_ack_gbps=send_gbps, send_to_landed_s=landed_s,
                         send_to_landed_gbps=landed_gbps, checksum_ok=True, phases_s=phases,
                         cold_handoff_s=d_times[0]))  # fmt: skip
        spent = " ".join(f"{k} {v * 1e3:.2f}" for k, v in phases["sender"].items())
        print(
            f"{kind:8s} {tokens:6d} tokens: handoff {handoff * 1e3:8.2f} ms {handoff_gbps:7.1f} GB/s, send->landed "
            f"{landed_s * 1e3:.2f} ms {landed_gbps:.1f} GB/s (first {d_times[0] * 1e3:.1f} ms); sender ms: {spent}",
            flush=True,
        )
    return rows


def median_phases(samples: list[dict[str, float]]) -> dict[str, float]:
    names = {name for sample in samples for name in sample}
    return {name: statistics.median(s.get(name, 0.0) for s in samples) for name in sorted(names)}


def print_raw(raw: list[dict]) -> None:
    for row in raw:
        rates = " ".join(
            f"{k} {row[f'{k}_gbps']:.1f}" for k in ("cupy", "torch", "ipc") if f"{k}_gbps" in row
        )
        print(f"raw {row['tokens']:6d} tokens ({row['bytes'] / 2**20:.0f} MiB): GB/s {rates}", flush=True)


def run_raw(args, layout: KVLayout, ctl_d, ctl_p, gpus: int) -> list[dict]:
    kinds = ["ipc"] + (["cupy", "torch"] if gpus > 1 else [])
    port = random.Random().randint(20000, 40000)
    out = []
    for tokens in args.tokens:
        nbytes = layout.bytes_per_block * -(-tokens // 16)
        row = dict(tokens=tokens, bytes=nbytes)
        for kind in kinds:
            cmd = ("raw", kind, nbytes, args.warmup + args.reps, port)
            ctl_d.send(cmd)
            ctl_p.send(cmd)
            d_times, p_times = ctl_d.recv(), ctl_p.recv()
            row[f"{kind}_s"], row[f"{kind}_gbps"] = median_rate(d_times or p_times, args.warmup, nbytes)
        out.append(row)
    return out


def print_table(result: dict) -> None:
    raw = {r["tokens"]: r for r in result["raw"]}
    print(
        f"\n{'transport':9s} {'tokens':>6s} {'MiB':>7s} | {'handoff ms':>10s} {'GB/s':>6s} | {'send->landed':>12s} "
        f"{'GB/s':>6s} | {'send->ack ms':>12s} {'GB/s':>6s} | raw GB/s: {'cupy':>6s} {'torch':>6s} {'ipc':>6s}"
    )
    for r in result["rows"]:
        b = raw.get(r["tokens"], {})
        rates = " ".join(f"{b.get(f'{k}_gbps', float('nan')):6.1f}" for k in ("cupy", "torch", "ipc"))
        print(
            f"{r['transport']:9s} {r['tokens']:6d} {r['bytes'] / 2**20:7.1f} | {r['handoff_s'] * 1e3:10.2f} "
            f"{r['handoff_gbps']:6.1f} | {r['send_to_landed_s'] * 1e3:12.2f} {r['send_to_landed_gbps']:6.1f} | "
            f"{r['send_to_ack_s'] * 1e3:12.2f} {r['send_to_ack_gbps']:6.1f} |           "
            f"{rates}"
        )


def nccl_versions() -> dict[str, object]:
    from cupy.cuda import nccl

    return dict(cupy_nccl=nccl.get_version(), torch_nccl=".".join(map(str, torch.cuda.nccl.version())))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--transports",
        default="nccl,cuda_ipc,tcp",
        help="cuda_ipc+engine: cuda_ipc with copy-engine 2-D copies instead of the block-copy kernel; "
        "nccl+s128: nccl with 128 MiB slices",
    )
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="128 and 2048 tokens, 5 reps: a short GPU run")
    parser.add_argument("--smoke", action="store_true", help="CPU, tcp, 16 and 64 tokens: checks the driver")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    if args.smoke and not args.out:
        parser.error("--smoke: give --out FILE (smoke numbers never go to bench/results)")
    args.transports = ["tcp"] if args.smoke else args.transports.split(",")
    args.tokens = [128, 2048] if args.quick else [int(t) for t in args.tokens.split(",")]
    args.tokens = [16, 64] if args.smoke else args.tokens
    args.reps = 5 if args.quick else 4 if args.smoke else args.reps
    args.warmup = 1 if args.smoke else args.warmup
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("needs CUDA GPUs (--smoke runs on a CPU)")
    gpu = "cpu" if args.smoke else torch.cuda.get_device_name(0)
    started = time.time()
    result = run(args)
    print_table(result)
    versions = {} if args.smoke else nccl_versions()
    meta = dict(gpu=gpu, gpus=0 if args.smoke else torch.cuda.device_count(), torch=torch.__version__, **versions,
                warmup=args.warmup, reps=args.reps,
                layout="llama-3-8b: 32 layers, 8 kv heads, head dim 128, bf16, block 16",
                seconds=round(time.time() - started, 1), method=METHOD)  # fmt: skip
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    out = pathlib.Path(args.out or ROOT / "bench" / "results" / f"kv_transfer_{slug}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(meta=meta, **result), indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
