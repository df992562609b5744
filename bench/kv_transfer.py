"""KV handoff benchmark: Llama-3-8B KV layout between two processes on two GPUs.

For each transport (nccl, cuda_ipc, and tcp up to 2k tokens) and prompt length (128 ... 32k tokens) it times the
whole handoff as the service runs it: the decode process reserves blocks, hands the KVTarget to the prefill
process (a pipe stands in for the router hop), the prefill process sends its blocks, the decode process is told
they landed. Next to it, in the same run and on the same cards, the raw baselines for one contiguous buffer of
the same size (bench/kv_raw.py): CuPy NCCL send/recv, torch.distributed NCCL send/recv, and a CUDA IPC peer copy.

Self-checking: after every rep the decode process checks its landed blocks against the prefill process's
source blocks by checksum (random bf16 data, scattered block ids on both sides), then zeroes them, so a later
rep that wrote nothing into reused blocks cannot pass; a mismatch stops the run.

The raw baselines run first, so a run cut short by a time limit still has them: the JSON is written after them
and after every transport and size, with "complete": false until the end. Each handoff row also gives the
median time of each phase on both sides (SendResult.phases, TransferResult.phases): where the time goes.
Every wait is bounded: a process that fails sends its traceback to the driver, which raises it; one that exits
or goes silent is named with its exit code; either way both processes are stopped.

Usage: python bench/kv_transfer.py [--quick] [--transports nccl,cuda_ipc,tcp] [--tokens 128,512,...]; prints
a table and writes bench/results/kv_transfer_<gpu-name>.json (medians over --reps after --warmup).
`--smoke --out FILE` runs the same driver on a CPU: tcp only, two short prompts, no raw baselines (a test runs
it; its times mean nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import pathlib
import random
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# NVLink multicast can take a shared host's GPUs out of service: keep it off in every process (inherited).
os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.child_procs import Child, Ready, ask, expect_all, recv_within, stop_all  # noqa: E402
from bench.kv_common import (  # noqa: E402
    FreeList,
    Landing,
    check_landed,
    kv_checksum,
    llama3_8b_layout,
    median_phases,
    median_rate,
    nccl_versions,
    transfer_config,
    use_device,
)
from bench.kv_raw import close_raw, raw_times  # noqa: E402
from kv_transfer import FirstToken, KVReceiver, KVSender, cuda_ipc, slicing  # noqa: E402
from kv_transfer.config import TransferConfig  # noqa: E402
from model_runtime.kv_layout import KVLayout  # noqa: E402
from tandem_api.tandem.v1 import kv_pb2  # noqa: E402

TOKENS = (128, 512, 2048, 8192, 32768)
DEFAULT_SLICE_BYTES = slicing.SLICE_BYTES
TCP_MAX_TOKENS = 2048  # tcp stages GPU blocks through host memory: a reference point, not a GPU transport
# A job (every rep of one size) may take this many wait_s: healthy ones take seconds, and a process stuck in
# one of its own waits (each bounded by wait_s) reports within one; this catches one stuck anywhere else.
JOB_WAITS = 3
METHOD = ("handoff: decode-side wall time reserve -> landed (includes the KVTarget pipe hop); send->landed: "
          "the prefill side's send call to the decode side's landing (TransferResult.landed_at, time.monotonic, one host), what a "
          "prompt whose blocks were reserved before its prefill waits; send->ack: prefill-side SendResult.seconds; raw: one contiguous buffer, send timed after the peer posted its "
          "receive (cupy, torch) or a one-sided pull (ipc); medians after warmup")  # fmt: skip


def apply_variant(label: str) -> tuple[str, str]:
    """A transport label's variant, set in this process: "cuda_ipc+engine" (copy engines instead of the block-copy
    kernel), "nccl+s128" (128 MiB nccl slices instead of slicing.SLICE_BYTES). Returns (transport, variant)."""
    base, _, variant = label.partition("+")
    cuda_ipc.COPY_ENGINE_MAX_RUNS = 10**9 if variant == "engine" else 0
    slicing.SLICE_BYTES = int(variant[1:]) * 2**20 if variant.startswith("s") else DEFAULT_SLICE_BYTES
    return base, variant


def side_config(label: str) -> TransferConfig:
    """A side's TransferConfig for a transport label: "cuda_ipc+noarm" turns doorbells off (the receiver then
    queues each copy when the frames arrive, as before them); cuda_ipc leases are armed otherwise."""
    base, variant = apply_variant(label)
    config = transfer_config(base)
    return dataclasses.replace(config, doorbell_slots=0) if variant == "noarm" else config


# --- messages between the driver and the two processes (multiprocessing pipes on one host) ----------------
# Besides bench/child_procs.py's Ready and Failed. A raw baseline's command is bench/kv_raw.py's tuple ("raw",
# kind, bytes, runs, port); its reply a list of seconds.
@dataclass(frozen=True)
class HandoffJob:
    transport: str  # a transport label, variant included: "nccl+s128"
    tokens: int
    runs: int  # warmup and timed reps


@dataclass(frozen=True)
class Handoffs:
    """One side's record of a HandoffJob, one entry per rep. The decode side's: reserve -> landed seconds
    (perf_counter), TransferResult.phases, TransferResult.landed_at; the prefill side's: send -> ack seconds
    (SendResult.seconds), SendResult.phases, when send() was called. Moments: time.monotonic (host-wide)."""

    seconds: list[float]
    phases: list[dict[str, float]]
    moments: list[float]
    armed: list[bool] = dataclasses.field(default_factory=list)  # decode side: landed through a doorbell


# --- the decode process (receiver) ----------------------------------------------------------------------
class DecodeProcess:
    """Reserves blocks, hands their KVTarget to the prefill process, checks what landed, frees the blocks."""

    name = "decode process"

    def __init__(self, peer, device_spec: str, max_tokens: int, wait_s: float) -> None:
        self.peer, self.wait_s, self.device = peer, wait_s, use_device(device_spec)
        self.layout = llama3_8b_layout(max_tokens)
        self.cache = torch.zeros(self.layout.cache_shape, dtype=torch.bfloat16, device=self.device)
        self.landing, self.alloc = Landing(), FreeList(self.layout.num_blocks)
        self.receiver: KVReceiver | None = None
        self.transport = ""
        self.raw: dict[str, Any] = {}

    def serve(self, conn, cmd: HandoffJob | tuple) -> None:
        """A job's reply to the driver: a raw baseline's seconds, or this side's Handoffs."""
        if not isinstance(cmd, HandoffJob):
            conn.send(raw_times(cmd, 1, self.peer, self.device, self.raw))
            return
        if self.receiver is None or self.transport != cmd.transport:
            if self.receiver is not None:
                self.receiver.close()
            config = side_config(cmd.transport)
            self.receiver = KVReceiver(
                self.layout, self.cache, self.alloc, config, on_result=self.landing.put
            )
            self.transport = cmd.transport
        conn.send(self.handoffs(self.receiver, cmd))

    def handoffs(self, receiver: KVReceiver, job: HandoffJob) -> Handoffs:
        """Reserve -> KVTarget to the prefill process -> landed, job.runs times; every rep's blocks checked
        against the checksum the prefill process sends first."""
        expected, sender_id = recv_within(self.peer, self.wait_s, "source checksum from the prefill process")
        out = Handoffs([], [], [])
        for rep in range(job.runs):
            self.landing.event.clear()
            start = time.perf_counter()
            # Naming the sender lets a warm cuda_ipc pair arm the lease (a decode worker learns it from the router).
            lease = receiver.reserve(f"bench-{job.tokens}", job.tokens, sender=sender_id)
            self.peer.send(receiver.target(lease).SerializeToString())
            result = self.landing.result if self.landing.event.wait(self.wait_s) else None
            if result is None or not result.ok:
                raise RuntimeError(f"handoff failed within {self.wait_s:.0f} s: {result}")
            out.seconds.append(time.perf_counter() - start)
            out.moments.append(self.landing.landed_at)
            out.phases.append(result.phases)
            out.armed.append(result.armed)
            ids = list(lease.block_ids)
            check_landed(self.cache, ids, expected, f"{job.transport} at {job.tokens} tokens, rep {rep}")
            self.alloc.free(ids)  # the blocks are ours after landing; hand them back for the next rep
        self.peer.send(b"")
        return out

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        close_raw(self.raw)


# --- the prefill process (sender) ------------------------------------------------------------------------
class PrefillProcess:
    """Sends its blocks of random bf16 data (never all-zero) to each KVTarget the decode process hands it."""

    name = "prefill process"

    def __init__(self, peer, device_spec: str, max_tokens: int, wait_s: float, fault: bool) -> None:
        self.peer, self.wait_s, self.fault, self.device = peer, wait_s, fault, use_device(device_spec)
        self.layout = llama3_8b_layout(max_tokens)
        shape, gen = self.layout.cache_shape, torch.Generator(device=self.device).manual_seed(1)
        self.cache = torch.randn(shape, generator=gen, device=self.device).to(torch.bfloat16)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # sends pass no `ready` event: the KV writes must be complete
        self.sender: KVSender | None = None
        self.transport = ""
        self.raw: dict[str, Any] = {}

    def serve(self, conn, cmd: HandoffJob | tuple) -> None:
        """A job's reply to the driver: a raw baseline's seconds, or this side's Handoffs."""
        if not isinstance(cmd, HandoffJob):
            conn.send(raw_times(cmd, 0, self.peer, self.device, self.raw))
            return
        if self.sender is None or self.transport != cmd.transport:
            if self.sender is not None:
                self.sender.close()
            self.sender = KVSender(self.layout, self.cache, side_config(cmd.transport))
            self.transport = cmd.transport
        conn.send(self.handoffs(self.sender, cmd.tokens))

    def handoffs(self, sender: KVSender, tokens: int) -> Handoffs:
        """The source blocks' checksum to the decode process, then serve its KVTargets until it says stop."""
        n = self.layout.blocks_for_tokens(tokens)
        ids = random.Random(tokens).sample(range(1, self.layout.num_blocks), n)
        self.peer.send((kv_checksum(self.cache, ids), sender.instance_id))
        out = Handoffs([], [], [])
        while target := recv_within(self.peer, self.wait_s, "KVTarget from the decode process"):
            if self.fault:
                raise RuntimeError("injected fault (--inject-prefill-fault) at the first handoff")
            lease = kv_pb2.KVTarget.FromString(target)
            out.moments.append(time.monotonic())
            result = sender.send(lease, ids, tokens, FirstToken(1, -0.1)).result(self.wait_s)
            if not result.ok:
                raise RuntimeError(f"send failed: {result.failure} {result.message}")
            out.seconds.append(result.seconds)
            out.phases.append(result.phases)
        return out

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        close_raw(self.raw)


# --- the driver ------------------------------------------------------------------------------------------
def run(args, doc: dict, write: Callable[[], None]) -> None:
    """Both processes up, the raw baselines, then every transport and size: each into `doc`, then write()."""
    gpus, top = (0 if args.smoke else torch.cuda.device_count()), max(args.tokens)
    decode_device = "cpu" if args.smoke else f"cuda:{1 if gpus > 1 else 0}"
    prefill_device = "cpu" if args.smoke else "cuda:0"
    layout, (peer_d, peer_p) = llama3_8b_layout(top), mp.Pipe()
    sides: list[Child] = []
    grace = 2.0  # after a failure: a process waiting on the one that failed will not come back by itself
    try:
        sides.append(Child(DecodeProcess.name, DecodeProcess, peer_d, decode_device, top, args.wait_s))
        fault = args.inject_prefill_fault
        sides.append(
            Child(PrefillProcess.name, PrefillProcess, peer_p, prefill_device, top, args.wait_s, fault)
        )
        peer_d.close()  # the processes hold the only ends: one's exit shows the other EOF
        peer_p.close()
        expect_all(sides, Ready, args.wait_s)
        if not args.smoke:  # first: a run cut short still has its baselines (none on a CPU)
            run_raw(args, layout, sides, gpus, doc, write)
        for kind in args.transports:
            run_handoffs(args, kind, layout, sides, gpus, doc, write)
        grace = 60.0
    finally:
        stop_all(sides, grace)


def run_handoffs(args, kind: str, layout: KVLayout, sides: list[Child], gpus: int, doc: dict, write) -> None:
    """Every size through one transport, a row into doc["rows"] as each finishes (every rep's blocks passed
    the decode process's checksum: it stops the run otherwise)."""
    if kind.startswith("nccl") and gpus < 2:
        print("skipping nccl: needs two GPUs")
        return
    for tokens in [t for t in args.tokens if kind != "tcp" or t <= TCP_MAX_TOKENS]:
        runs = args.warmup + (args.reps if kind != "tcp" else max(3, args.reps // 4))
        decode, prefill = ask(sides, HandoffJob(kind, tokens, runs), Handoffs, args.wait_s * JOB_WAITS)
        nbytes = layout.bytes_per_block * layout.blocks_for_tokens(tokens)
        handoff, handoff_gbps = median_rate(decode.seconds, args.warmup, nbytes)
        send, send_gbps = median_rate(prefill.seconds, args.warmup, nbytes)
        landed = [b - a for a, b in zip(prefill.moments, decode.moments)]
        landed_s, landed_gbps = median_rate(landed, args.warmup, nbytes)
        phases = dict(
            sender=median_phases(prefill.phases[args.warmup :]),
            receiver=median_phases(decode.phases[args.warmup :]),
        )
        doc["rows"].append(dict(transport=kind, tokens=tokens, bytes=nbytes, handoff_s=handoff,
                                handoff_gbps=handoff_gbps, send_to_ack_s=send, send_to_ack_gbps=send_gbps,
                                send_to_landed_s=landed_s, send_to_landed_gbps=landed_gbps, checksum_ok=True,
                                phases_s=phases, cold_handoff_s=decode.seconds[0],
                                armed=sum(decode.armed[args.warmup :])))  # fmt: skip
        write()
        spent = " ".join(f"{k} {v * 1e3:.2f}" for k, v in phases["sender"].items())
        print(
            f"{kind:8s} {tokens:6d} tokens: handoff {handoff * 1e3:8.2f} ms {handoff_gbps:7.1f} GB/s, send->landed "
            f"{landed_s * 1e3:.2f} ms {landed_gbps:.1f} GB/s (first {decode.seconds[0] * 1e3:.1f} ms; armed "
            f"{sum(decode.armed[args.warmup :])} of {len(decode.armed) - args.warmup}); "
            f"sender ms: {spent}",
            flush=True,
        )


def run_raw(args, layout: KVLayout, sides: list[Child], gpus: int, doc: dict, write) -> None:
    """One contiguous buffer of each size between the two processes; a row into doc["raw"] as each ends."""
    kinds = ["ipc"] + (["cupy", "torch"] if gpus > 1 else [])
    port = random.Random().randint(20000, 40000)
    for tokens in args.tokens:
        nbytes = layout.bytes_per_block * layout.blocks_for_tokens(tokens)
        row = dict(tokens=tokens, bytes=nbytes)
        for kind in kinds:
            cmd = ("raw", kind, nbytes, args.warmup + args.reps, port)
            d_times, p_times = ask(sides, cmd, list, args.wait_s * JOB_WAITS)
            row[f"{kind}_s"], row[f"{kind}_gbps"] = median_rate(d_times or p_times, args.warmup, nbytes)
        doc["raw"].append(row)
        write()
        rates = " ".join(f"{k} {row[f'{k}_gbps']:.1f}" for k in ("cupy", "torch", "ipc") if k in kinds)
        print(f"raw {tokens:6d} tokens ({nbytes / 2**20:.0f} MiB): GB/s {rates}", flush=True)


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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
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
    parser.add_argument("--inject-prefill-fault", action="store_true", help="test hook: the prefill "
                        "process raises at its first handoff (the run must stop with its error)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.smoke and not args.out:
        parser.error("--smoke: give --out FILE (smoke numbers never go to bench/results)")
    args.transports = ["tcp"] if args.smoke else args.transports.split(",")
    args.tokens = [128, 2048] if args.quick else [int(t) for t in args.tokens.split(",")]
    args.tokens = [16, 64] if args.smoke else args.tokens
    args.reps = 5 if args.quick else 4 if args.smoke else args.reps
    args.warmup = 1 if args.smoke else args.warmup
    args.wait_s = 30.0 if args.smoke else 300.0  # the longest one step may take: a landing, a send, a message
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("needs CUDA GPUs (--smoke runs on a CPU)")
    gpu = "cpu" if args.smoke else torch.cuda.get_device_name(0)
    started = time.time()
    versions = {} if args.smoke else nccl_versions()
    meta = dict(gpu=gpu, gpus=0 if args.smoke else torch.cuda.device_count(), torch=torch.__version__, **versions,
                warmup=args.warmup, reps=args.reps,
                layout="llama-3-8b: 32 layers, 8 kv heads, head dim 128, bf16, block 16",
                seconds=0.0, method=METHOD)  # fmt: skip
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    out = pathlib.Path(args.out or ROOT / "bench" / "results" / f"kv_transfer_{slug}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    doc: dict = dict(meta=meta, rows=[], raw=[], complete=False)

    def write() -> None:
        meta["seconds"] = round(time.time() - started, 1)
        out.write_text(json.dumps(doc, indent=1))

    try:
        run(args, doc, write)
        doc["complete"] = True
    finally:  # what finished, also when a job failed
        write()
    print_table(doc)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
