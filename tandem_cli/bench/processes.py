"""One benchmark's load from several client processes (`tandem bench --processes N`).

One client process spends about 50 us of CPU on each token it receives (the gRPC read, the SDK's types, the
timeline), so it tops out near 20k output tokens/s, below what one node of GPUs can produce. Past that, its
own event loop's queueing shows up as TTFT. With N processes, each sends its share of the same requests:

    request i -> process i mod N        open loop: its own arrival times, unchanged; closed loop: C / N in flight
    every process starts at one wall-clock instant, so the arrival times and sent_at of all shares line up

Each child reads its share from a JSON job file and writes its records as JSON lines. Nothing passes between
the processes through pickle. Progress: each child appends one byte per finished request to a progress file,
and the parent's bar counts those bytes.

    python -m tandem_cli.bench.processes JOB.json RECORDS.jsonl PROGRESS    (what the parent runs per child)
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

from tandem_cli.bench.loadgen import (
    Outcome,
    Pacing,
    Progress,
    RequestRecord,
    RunLimits,
    RunResult,
    run_load,
)
from tandem_cli.bench.stats import Timeline
from tandem_cli.bench.transports import servers
from tandem_cli.bench.workload import BenchConfigError, RequestSpec

START_DELAY_S = 5.0  # the children import grpc and the SDK and connect before the common start instant
POLL_S = 0.25


def shares(specs: Sequence[RequestSpec], pacing: Pacing, n: int) -> list[tuple[list[RequestSpec], Pacing]]:
    """Request i to share i mod n, with its own arrival time (open loop) or an even part of the concurrency
    (closed loop: never more processes than requests in flight). Shares without requests are left out."""
    if n < 1:
        raise BenchConfigError(f"--processes: must be >= 1, got {n}")
    if pacing.concurrency is not None:
        n = min(n, pacing.concurrency)
    out = []
    for i in range(n):
        mine = list(specs[i::n])
        if not mine:
            continue
        if pacing.arrivals is not None:
            out.append((mine, Pacing(arrivals=tuple(pacing.arrivals[i::n]))))
        else:
            assert pacing.concurrency is not None  # exactly one of the two (Pacing checks)
            per = pacing.concurrency // n + (1 if i < pacing.concurrency % n else 0)
            out.append((mine, Pacing(concurrency=per)))
    return out


def record_to_json(record: RequestRecord) -> str:
    data = asdict(record)
    data["outcome"] = record.outcome.value
    return json.dumps(data)


def record_from_json(line: str) -> RequestRecord:
    data = json.loads(line)
    timeline = Timeline(
        tuple((float(t), int(k)) for t, k in data["timeline"]["deltas"]), data["timeline"]["end"]
    )
    return RequestRecord(
        data["index"],
        data["input_len"],
        data["output_len"],
        data["sent_at"],
        timeline,
        Outcome(data["outcome"]),
        data["error_code"],
        data["cached_tokens"],
    )


def run_processes(
    address: str,
    specs: Sequence[RequestSpec],
    pacing: Pacing,
    limits: RunLimits,
    n: int,
    protocol: str = "grpc",
    progress: bool = True,
) -> RunResult:
    """Send `specs` from n child processes (see the module docstring); one record per request sent."""
    from tqdm import tqdm

    parts = shares(specs, pacing, n)
    start_at = time.time() + START_DELAY_S
    routers = servers(address)  # several: each process takes its own of them (or its own subset)
    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as tmp:
        children = []
        for i, (mine, share) in enumerate(parts):
            job, out, ticks, err = (
                Path(tmp) / f"{name}-{i}" for name in ("job.json", "records.jsonl", "progress", "stderr")
            )
            mine_to = routers[i % len(routers)] if len(routers) <= n else ",".join(routers[i::n])
            job.write_text(json.dumps(_job(mine_to, protocol, mine, share, limits, start_at)))
            ticks.touch()
            cmd = [sys.executable, "-m", "tandem_cli.bench.processes", str(job), str(out), str(ticks)]
            # stderr to a file, not a pipe: nobody reads a pipe while the child runs, and a full one would
            # stop the child.
            with err.open("w") as stderr:
                children.append(_Child(subprocess.Popen(cmd, stderr=stderr), out, ticks, err))
        with tqdm(
            total=len(specs), file=sys.stderr, disable=not progress, unit="req", desc="tandem bench"
        ) as bar:
            _wait(children, bar)
        records = [record_from_json(line) for c in children for line in c.records.read_text().splitlines()]
    records.sort(key=lambda r: r.index)
    end = max((r.sent_at + r.timeline.end for r in records), default=0.0)
    return RunResult(tuple(records), end)


def _job(
    address: str, protocol: str, specs: list[RequestSpec], pacing: Pacing, limits: RunLimits, start_at: float
) -> dict:
    return {
        "address": address,
        "protocol": protocol,
        "specs": [[s.index, list(s.prompt_token_ids), s.output_len] for s in specs],
        "arrivals": None if pacing.arrivals is None else list(pacing.arrivals),
        "concurrency": pacing.concurrency,
        "limits": asdict(limits),
        "start_at": start_at,
    }


@dataclass(frozen=True)
class _Child:
    proc: subprocess.Popen
    records: Path  # its RequestRecords, one JSON line each, written when it ends
    ticks: Path  # one byte per finished request
    stderr: Path


def _wait(children: list[_Child], bar: Progress) -> None:
    """Until every child has exited; the bar follows their progress files. A child that failed fails the run
    with its error, after the others were stopped."""
    shown = 0
    while True:
        done = sum(c.ticks.stat().st_size for c in children)
        bar.update(done - shown)
        shown = done
        codes = [c.proc.poll() for c in children]
        failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            for c in children:
                c.proc.kill()
                c.proc.wait()
            child = children[failed[0]]
            err = child.stderr.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"tandem bench: client process {failed[0]} exited {codes[failed[0]]}: {err}")
        if all(code == 0 for code in codes):
            return
        time.sleep(POLL_S)


class _FileProgress:
    def __init__(self, stream: IO[bytes]) -> None:
        self._stream = stream

    def update(self, n: int) -> None:
        self._stream.write(b"." * n)
        self._stream.flush()


def child(job_path: str, out_path: str, progress_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    specs = [RequestSpec(i, tuple(ids), n) for i, ids, n in job["specs"]]
    arrivals = job["arrivals"]
    pacing = (
        Pacing(arrivals=tuple(arrivals)) if arrivals is not None else Pacing(concurrency=job["concurrency"])
    )
    limits = RunLimits(**job["limits"])
    with open(progress_path, "ab") as ticks:
        delay = job["start_at"] - time.time()
        if delay > 0:
            time.sleep(delay)
        run = asyncio.run(
            run_load(
                job["address"], specs, pacing, limits, protocol=job["protocol"], bar=_FileProgress(ticks)
            )
        )
    Path(out_path).write_text("".join(record_to_json(r) + "\n" for r in run.records))


if __name__ == "__main__":
    child(*sys.argv[1:4])
