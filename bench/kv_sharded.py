"""KV handoff between tensor-parallel workers of different sizes (issue 18): prefill TP=a -> decode TP=b.

    python3 bench/kv_sharded.py --layouts 1x1,2x1,1x2,2x2 --tokens 512,2048,8192

One process per rank on its own GPU (prefill ranks on GPUs 0..a-1, decode ranks on a..a+b-1), the Llama-3-8B KV
layout split by heads as the workers split it. Per rep, as the service runs it: decode rank 0 reserves, the other
decode ranks lease the same block ids under handles of their own, the driver (the router hop, over pipes) puts
their targets into rank 0's KVTarget and hands it to every prefill rank, which sends the pieces that
kv_transfer.sharded plans for it. Timed: from the driver's go to the prefill ranks (sent once each holds the
target) to the last decode rank's TransferResult.landed_at (time.monotonic is host-wide).

Baselines first, so a run cut short keeps them: raw NCCL send/recv of one contiguous buffer of the same bytes
GPU0 -> GPU1 (bench/kv_raw.py), then the equal layout 1x1, always the first layout. Each row's bandwidth is also
given as a percentage of 1x1 at the same size (goal: >= 80% at >= 2k tokens) and of the faster raw NCCL (one
pair of GPUs: a layout of several pairs, e.g. 2x2, moves over several links at once and can pass it).
Self-checking: every rank builds the whole model's cache from one seed and keeps its heads; after each rep each
decode rank checks its landed blocks against its heads of the source blocks, and a mismatch stops the run.
JSON: bench/results/kv_sharded_<gpu-name>.json, written after every layout. `--smoke --out FILE`: CPU, tcp, a
tiny layout, layouts 1x1,2x1,1x2 (a test runs it; its times mean nothing).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pathlib
import random
import re
import secrets
import sys
import time
from dataclasses import dataclass, replace

# NVLink multicast can take a shared host's GPUs out of service: keep it off in every process (inherited).
os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench import kv_common  # noqa: E402
from bench.child_procs import Child, Ready, ask, expect_all, recv_within, stop_all  # noqa: E402
from bench.kv_raw import raw_times  # noqa: E402
from kv_transfer import FirstToken, KVReceiver, KVSender  # noqa: E402
from kv_transfer.shard_plan import handoff_plan  # noqa: E402
from kv_transfer.sharded import pieces  # noqa: E402
from model_runtime.config import ConfigError  # noqa: E402
from model_runtime.kv_layout import KVLayout, KVShard  # noqa: E402
from model_runtime.parallel.shard import kv_head_range  # noqa: E402
from tandem_api.tandem.v1 import kv_pb2  # noqa: E402

TOKENS = (512, 2048, 8192)
SEED = 1
FIRST = FirstToken(1, -0.1)
RAW_KINDS = ("cupy", "torch")
METHOD = ("handoff: the driver's go to the prefill ranks (each holding the KVTarget) -> the last decode rank's "
          "TransferResult.landed_at (time.monotonic, one host); GB/s: the whole model's KV of the prompt over "
          "that; raw: one contiguous buffer of the same bytes GPU0 -> GPU1 (one link), the send timed after the "
          "peer posted its receive; medians after warmup")  # fmt: skip


# --- messages between the driver and the rank processes (multiprocessing pipes on one host) --------------
# Besides bench/child_procs.py's Ready (a rank built its cache and its sender or receiver; and a prefill rank
# holds its pieces of a Ship) and Failed.
@dataclass(frozen=True)
class RankSpec:
    whole: KVLayout  # the whole model's cache
    size: int  # ranks of this worker
    rank: int
    device: str
    transport: str
    wait_s: float  # the longest any one step may take


@dataclass(frozen=True)
class Reserve:
    request_id: str
    tokens: int
    block_ids: tuple[int, ...] = ()  # a follower decode rank leases rank 0's ids; () on rank 0: allocate


@dataclass(frozen=True)
class Reserved:
    target: bytes  # this decode rank's KVTarget, serialized
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class Landed:
    at: float  # TransferResult.landed_at
    num_bytes: int
    phases: dict[str, float]


@dataclass(frozen=True)
class Ship:
    target: bytes  # the decode worker's KVTarget (rank 0's, rank_targets filled), serialized
    tokens: int


@dataclass(frozen=True)
class Go:
    """The driver releases the prefill ranks: the timed window starts."""


@dataclass(frozen=True)
class Shipped:
    phases: tuple[dict[str, float], ...]  # SendResult.phases, one per piece


# --- layouts and data, the same on every rank ------------------------------------------------------------
def rank_layout(whole: KVLayout, size: int, rank: int) -> KVLayout:
    heads = kv_head_range(whole.num_kv_heads, size, rank)
    shard = KVShard(size, rank, heads.start, whole.num_kv_heads) if size > 1 else None
    return replace(whole, num_kv_heads=len(heads), shard=shard)


def rank_data(whole: KVLayout, layout: KVLayout, device: torch.device) -> torch.Tensor:
    """This rank's heads of the whole model's cache: random bf16 from SEED (never all-zero), each element of
    the model the same whichever rank builds it. cache[L, 2, N, B, H, D]: the heads are dim 4."""
    gen = torch.Generator(device=device).manual_seed(SEED)
    data = torch.randn(whole.cache_shape, generator=gen, device=device).to(torch.bfloat16)
    start = layout.shard.head_start if layout.shard is not None else 0
    return data.narrow(4, start, layout.num_kv_heads).contiguous()


def source_ids(layout: KVLayout, tokens: int) -> list[int]:
    """The prompt's scattered blocks in every prefill rank's cache."""
    return random.Random(tokens).sample(range(1, layout.num_blocks), layout.blocks_for_tokens(tokens))


# --- the rank processes ----------------------------------------------------------------------------------
class Borrowed(kv_common.FreeList):
    """A follower decode rank's pool: no blocks of its own; its leases name rank 0's, which rank 0 frees."""

    def free(self, ids) -> None:
        pass


class DecodeRank:
    def __init__(self, spec: RankSpec) -> None:
        device = kv_common.use_device(spec.device)
        self.spec, self.layout = spec, rank_layout(spec.whole, spec.size, spec.rank)
        self.cache = torch.zeros(self.layout.cache_shape, dtype=torch.bfloat16, device=device)
        self.expected = rank_data(spec.whole, self.layout, device)  # what the prefill ranks hold of our heads
        self.pool = kv_common.FreeList(self.layout.num_blocks) if spec.rank == 0 else Borrowed(1)
        self.landing, self.sums = kv_common.Landing(), dict[int, str]()
        config = kv_common.transfer_config(spec.transport)
        self.receiver = KVReceiver(self.layout, self.cache, self.pool, config, on_result=self.landing.put)

    def serve(self, conn, cmd: Reserve) -> None:
        self.landing.event.clear()
        # rank 0 allocates; a follower leases rank 0's blocks under a handle of its own
        allocate = (lambda n: list(cmd.block_ids)) if cmd.block_ids else None
        handle = secrets.token_bytes(16) if cmd.block_ids else None
        lease = self.receiver.reserve(cmd.request_id, cmd.tokens, allocate=allocate, handle=handle)
        conn.send(Reserved(self.receiver.target(lease).SerializeToString(), lease.block_ids))
        result = self.landing.result if self.landing.event.wait(self.spec.wait_s) else None
        if result is None or not result.ok:
            raise RuntimeError(f"the lease did not land: {result}")
        self.check(list(lease.block_ids), cmd.tokens)
        conn.send(Landed(result.landed_at, result.num_bytes, result.phases))
        self.pool.free(lease.block_ids)  # landed, so ours: rank 0 hands them back for the next rep

    def check(self, ids: list[int], tokens: int) -> None:
        """Our landed blocks against our heads of the prompt's source blocks, then zeroed (and the device
        synchronized: the receiver writes the next rep on streams of its own) by kv_common.check_landed."""
        if tokens not in self.sums:
            self.sums[tokens] = kv_common.kv_checksum(self.expected, source_ids(self.layout, tokens))
        kv_common.check_landed(
            self.cache, ids, self.sums[tokens], f"decode rank {self.spec.rank} at {tokens} tokens"
        )

    def close(self) -> None:
        self.receiver.close()


class PrefillRank:
    def __init__(self, spec: RankSpec) -> None:
        device = kv_common.use_device(spec.device)
        self.spec, self.layout = spec, rank_layout(spec.whole, spec.size, spec.rank)
        self.cache = rank_data(spec.whole, self.layout, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # sends pass no `ready` event: the KV writes must be complete
        self.sender = KVSender(self.layout, self.cache, kv_common.transfer_config(spec.transport))

    def serve(self, conn, cmd: Ship) -> None:
        plan = pieces(kv_pb2.KVTarget.FromString(cmd.target), self.layout)
        ids = source_ids(self.layout, cmd.tokens)
        conn.send(Ready())
        if not isinstance(go := recv_within(conn, self.spec.wait_s, "go from the driver"), Go):
            raise RuntimeError(f"expected the driver's go, got {type(go).__name__}")
        handles = [self.sender.send(t, ids, cmd.tokens, FIRST, heads=w) for t, w in plan]
        results = [h.result(self.spec.wait_s) for h in handles]
        if failed := [f"{r.failure}: {r.message}" for r in results if not r.ok]:
            raise RuntimeError(f"sends failed: {failed}")
        conn.send(Shipped(tuple(r.phases for r in results)))

    def close(self) -> None:
        self.sender.close()


class RawRank:
    """One end of bench/kv_raw.py's baselines (rank 0 sends, rank 1 receives), with a pipe to the other."""

    def __init__(self, spec: RankSpec, peer) -> None:
        self.spec, self.peer, self.device = spec, peer, kv_common.use_device(spec.device)
        self.state: dict = {}

    def serve(self, conn, cmd: tuple) -> None:
        conn.send(raw_times(cmd, self.spec.rank, self.peer, self.device, self.state))

    def close(self) -> None:
        if torch.distributed.is_initialized():  # the torch baseline's group; CuPy's ends with the process
            torch.distributed.destroy_process_group()


# --- the driver ------------------------------------------------------------------------------------------
def rank_child(role: type[DecodeRank | PrefillRank | RawRank], spec: RankSpec, *extra) -> Child:
    """A rank's process, named after its role and rank ("DecodeRank 1") in every error about it."""
    return Child(f"{role.__name__} {spec.rank}", role, spec, *extra)


def run_raw(args, whole: KVLayout) -> list[dict]:
    peers, spec = mp.Pipe(), RankSpec(whole, 2, 0, "", "nccl", args.wait_s)
    port, out, ranks = random.Random().randint(20000, 40000), [], list[Child]()
    try:
        for r in (0, 1):
            ranks.append(rank_child(RawRank, replace(spec, rank=r, device=f"cuda:{r}"), peers[r]))
        for peer in peers:
            peer.close()  # the ranks hold the only ends: one's exit shows the other EOF
        expect_all(ranks, Ready, args.wait_s)
        for tokens in args.tokens:
            row = dict(tokens=tokens, bytes=whole.bytes_per_block * whole.blocks_for_tokens(tokens))
            for kind in RAW_KINDS:
                cmd = ("raw", kind, row["bytes"], args.warmup + args.reps, port)
                sent, _ = ask(ranks, cmd, list, args.wait_s)  # rank 0 times the sends
                row[f"{kind}_s"], row[f"{kind}_gbps"] = kv_common.median_rate(sent, args.warmup, row["bytes"])
            print(
                f"raw  {tokens:6d} tokens: GB/s " + " ".join(f"{k} {row[f'{k}_gbps']:.1f}" for k in RAW_KINDS)
            )
            out.append(row)
    finally:
        stop_all(ranks, 30)
    return out


def handoff(prefill: list[Child], decode: list[Child], tokens: int, rep: int, wait_s: float):
    """One request through both workers: (seconds from go to the last landing, [Landed], [Shipped])."""
    request_id = f"bench-{tokens}-{rep}"
    lead, *followers = decode
    lead.send(Reserve(request_id, tokens))
    first = lead.expect(Reserved, wait_s)
    target = kv_pb2.KVTarget.FromString(first.target)
    for reserved in ask(followers, Reserve(request_id, tokens, first.block_ids), Reserved, wait_s):
        rank = kv_pb2.KVTarget.FromString(reserved.target)
        target.rank_targets.add(port=rank.port, handle=rank.handle, receiver_id=rank.receiver_id,
                                layout_fingerprint=rank.layout_fingerprint, format=rank.format)  # fmt: skip
    ask(prefill, Ship(target.SerializeToString(), tokens), Ready, wait_s)
    go = time.monotonic()
    shipped = ask(prefill, Go(), Shipped, wait_s)
    landed = expect_all(decode, Landed, wait_s)
    return max(lane.at for lane in landed) - go, landed, shipped


def run_layout(args, whole: KVLayout, a: int, b: int, doc: dict) -> None:
    """Every token count through prefill TP=a -> decode TP=b; a row into doc["rows"] as each finishes."""
    children, grace = list[Child](), 2.0
    try:
        for role, size, first_gpu in ((PrefillRank, a, 0), (DecodeRank, b, a)):
            for r in range(size):
                device = "cpu" if args.smoke else f"cuda:{first_gpu + r}"
                children.append(
                    rank_child(role, RankSpec(whole, size, r, device, args.transport, args.wait_s))
                )
        prefill, decode = children[:a], children[a:]
        expect_all(children, Ready, args.wait_s)
        for tokens in args.tokens:
            runs = [
                handoff(prefill, decode, tokens, rep, args.wait_s) for rep in range(args.warmup + args.reps)
            ]
            doc["rows"].append(layout_row(args, whole, f"{a}x{b}", tokens, runs, doc))
        grace = 30.0
    finally:
        stop_all(children, grace)


def layout_row(args, whole: KVLayout, name: str, tokens: int, runs: list, doc: dict) -> dict:
    """The row of one layout and size; every rep's checksums passed (a decode rank stops the run otherwise)."""
    nbytes, timed = whole.bytes_per_block * whole.blocks_for_tokens(tokens), runs[args.warmup :]
    seconds, gbps = kv_common.median_rate([s for s, _, _ in runs], args.warmup, nbytes)
    same = [r["handoff_gbps"] for r in doc["rows"] if r["layout"] == "1x1" and r["tokens"] == tokens]
    equal = gbps if name == "1x1" else same[0] if same else None
    raw = [max(r[f"{k}_gbps"] for k in RAW_KINDS) for r in doc["raw"] if r["tokens"] == tokens]
    sent = [phases for _, _, shipped in timed for s in shipped for phases in s.phases]
    phases = dict(sender=kv_common.median_phases(sent),
                  receiver=kv_common.median_phases([lane.phases for _, landed, _ in timed for lane in landed]))  # fmt: skip
    row = dict(layout=name, tokens=tokens, bytes=nbytes, handoff_s=seconds, handoff_gbps=gbps,
               pct_of_1x1=100 * gbps / equal if equal else None, pct_of_raw=100 * gbps / raw[0] if raw else None,
               decode_rank_bytes=[lane.num_bytes for lane in runs[-1][1]], checksum_ok=True,
               cold_handoff_s=runs[0][0], phases_s=phases)  # fmt: skip
    print(f"{name:5s} {tokens:6d} tokens: handoff {seconds * 1e3:8.2f} ms {gbps:7.2f} GB/s, "
          f"{pct(row['pct_of_1x1'])} of 1x1, {pct(row['pct_of_raw'])} of raw nccl "
          f"(first {runs[0][0] * 1e3:.1f} ms)", flush=True)  # fmt: skip
    return row


def pct(value: float | None) -> str:
    return "    - " if value is None else f"{value:5.1f}%"


def print_table(doc: dict) -> None:
    print(f"\n{'layout':6s} {'tokens':>6s} {'MiB':>8s} | {'handoff ms':>10s} {'GB/s':>7s} | {'% 1x1':>6s} "
          f"{'% raw':>6s} | MiB per decode rank")  # fmt: skip
    for r in doc["rows"]:
        per_rank = " ".join(f"{n / 2**20:.4g}" for n in r["decode_rank_bytes"])
        print(f"{r['layout']:6s} {r['tokens']:6d} {r['bytes'] / 2**20:8.4g} | {r['handoff_s'] * 1e3:10.2f} "
              f"{r['handoff_gbps']:7.2f} | {pct(r['pct_of_1x1'])} {pct(r['pct_of_raw'])} | {per_rank}")  # fmt: skip
    for note in doc["skipped"]:
        print(f"skipped {note}")


def parse_layouts(text: str, model_heads: int) -> list[tuple[int, int]]:
    """'2x1,1x2' -> [(1, 1), (2, 1), (1, 2)]: 1x1 (the equal-layout baseline) first, named or not. Raises
    ValueError naming the layout."""
    out = [(1, 1)]
    for item in text.split(","):
        if not re.fullmatch(r"\d+x\d+", item.strip()):
            raise ValueError(f"--layouts: {item!r} is not PREFILLxDECODE, e.g. 2x1")
        a, b = map(int, item.strip().split("x"))
        try:
            handoff_plan(a, b, model_heads)
        except ConfigError as exc:
            raise ValueError(f"--layouts {item.strip()}: {exc}") from None
        out += [(a, b)] if (a, b) not in out else []
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill-tp", type=int, default=2)
    parser.add_argument("--decode-tp", type=int, default=1)
    parser.add_argument("--layouts", default="", help="PREFILLxDECODE list, e.g. 1x1,2x1,1x2,2x2 (default: "
                        "--prefill-tp x --decode-tp); 1x1 runs first, named or not")  # fmt: skip
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--model-kv-heads", type=int, default=8)
    parser.add_argument("--transport", choices=("nccl", "tcp"), default="nccl")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="CPU, tcp, a tiny layout: checks the driver")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    if args.smoke and not args.out:
        parser.error("--smoke: give --out FILE (smoke numbers never go to bench/results)")
    if args.smoke:
        args.model_kv_heads, args.layouts, args.tokens, args.transport = 4, "1x1,2x1,1x2", "16,64", "tcp"
        args.warmup, args.reps = 1, 2
    if args.reps < 1 or args.warmup < 0:
        parser.error("--reps must be >= 1 and --warmup >= 0")
    try:
        args.layouts = parse_layouts(
            args.layouts or f"{args.prefill_tp}x{args.decode_tp}", args.model_kv_heads
        )
        args.tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError as exc:
        parser.error(str(exc))
    args.wait_s = 30.0 if args.smoke else 300.0
    return args


def whole_layout(args) -> KVLayout:
    if args.smoke:  # 4 layers, 4 KV heads of dim 8, block 4
        return KVLayout(4, 4, 8, 4, -(-max(args.tokens) // 4) + 16, "bfloat16")
    return replace(kv_common.llama3_8b_layout(max(args.tokens)), num_kv_heads=args.model_kv_heads)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("needs CUDA GPUs (--smoke runs on a CPU)")
    gpus = 0 if args.smoke else torch.cuda.device_count()
    names = [torch.cuda.get_device_name(i) for i in range(gpus)]
    whole, started = whole_layout(args), time.time()
    meta = dict(argv=[sys.argv[0], *(sys.argv[1:] if argv is None else argv)], gpu=names[0] if names else "cpu",
                gpus=names, torch=torch.__version__, **({} if args.smoke else kv_common.nccl_versions()),
                transport=args.transport, warmup=args.warmup, reps=args.reps, layout=str(whole), method=METHOD,
                commit=os.environ.get("TANDEM_COMMIT", ""))  # fmt: skip
    slug = re.sub(r"[^a-z0-9]+", "-", meta["gpu"].lower()).strip("-")
    out = pathlib.Path(args.out or ROOT / "bench" / "results" / f"kv_sharded_{slug}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    doc: dict = dict(meta=meta, raw=[], rows=[], skipped=[], complete=False)

    def write() -> None:
        meta["seconds"] = round(time.time() - started, 1)
        out.write_text(json.dumps(doc, indent=1))

    try:
        if not args.smoke and gpus >= 2:  # first: a run cut short still has its baseline
            doc["raw"] = run_raw(args, whole)
            write()
        for a, b in args.layouts:
            if not args.smoke and a + b > gpus:
                doc["skipped"].append(f"{a}x{b}: needs {a + b} GPUs, {gpus} here")
                print(f"skipping {doc['skipped'][-1]}", flush=True)
                continue
            run_layout(args, whole, a, b, doc)
            write()
        doc["complete"] = True
    finally:  # what finished, also when a layout failed
        write()
    print_table(doc)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
