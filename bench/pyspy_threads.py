"""Which threads of a worker hold Python's interpreter lock: start_py_spy/finish_py_spy record every worker
process with `py-spy record --format raw --threads --gil` (bench/disagg_vs_colocated.py --py-spy RATE), and the
command line prints each thread's share of the samples and, for every thread but the engine loop, its heaviest
innermost frames, i.e. what competes with the engine's kernel launches.

    python3 bench/pyspy_threads.py bench/results/.../pyspy_*.txt [--frames 5]
"""

from __future__ import annotations

import argparse
import math
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

ENGINE_THREAD = "engine-loop"
_THREAD = re.compile(r"^thread \(\d+\): (?P<name>.*)$|^thread \(\d+\)$")


WORKER_TITLE = "^ray::WorkerProcess"  # the process title Ray gives each worker actor (deploy/actors.py)


def start_py_spy(label: str, seconds: float, out_dir: Path) -> list[tuple[subprocess.Popen, Path]]:
    """py-spy on every worker process for one point (--py-spy RATE): which threads hold the interpreter lock
    while the engine steps (issue 14's cached-prefix TTFT, twice the engine-alone time in the worker). Raw
    folded stacks with thread names, only samples that hold the GIL, to out_dir/pyspy_<label>_<pid>.txt. Needs
    py-spy on PATH (its manylinux wheel travels in .whl) and ptrace rights; says why not otherwise."""
    if shutil.which("py-spy") is None:
        print("--py-spy: no py-spy on PATH; the point runs unprofiled", file=sys.stderr)
        return []
    found = subprocess.run(["pgrep", "-f", WORKER_TITLE], capture_output=True, text=True).stdout.split()
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", label)
    spies = []
    for pid in found:
        out = out_dir / f"pyspy_{slug}_{pid}.txt"
        cmd = ["py-spy", "record", "--pid", pid, "--duration", str(math.ceil(seconds)), "--rate", "250",
               "--format", "raw", "--threads", "--gil", "--nonblocking", "--output", str(out)]  # fmt: skip
        spies.append(
            (subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True), out)
        )
    print(f"--py-spy: recording {len(spies)} worker process(es) for {seconds:g} s", file=sys.stderr)
    return spies


def finish_py_spy(spies: list[tuple[subprocess.Popen, Path]]) -> None:
    for proc, out in spies:
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        if proc.returncode != 0 or not out.exists():
            print(f"--py-spy: {out.name}: exit {proc.returncode}: {err.strip()[-300:]}", file=sys.stderr)


def thread_shares(lines: list[str]) -> tuple[Counter[str], dict[str, Counter[str]], int]:
    """(samples per thread name, samples per innermost frame of each thread, all samples) of py-spy raw lines
    ("frame;frame;... count", the first frame naming the thread)."""
    threads: Counter[str] = Counter()
    leaves: dict[str, Counter[str]] = {}
    total = 0
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        match = _THREAD.match(frames[0])
        name = (match["name"] or "unnamed") if match else "unnamed"
        n = int(count)
        threads[name] += n
        leaves.setdefault(name, Counter())[frames[-1]] += n
        total += n
    return threads, leaves, total


def report(paths: list[Path], frames: int = 5) -> str:
    out = []
    for path in paths:
        threads, leaves, total = thread_shares(path.read_text().splitlines())
        out.append(f"{path.name}: {total} samples holding the GIL")
        for name, n in threads.most_common():
            out.append(f"  {n / total:6.1%}  {name}")
            if name != ENGINE_THREAD:
                for frame, m in leaves[name].most_common(frames):
                    out.append(f"            {m / total:6.1%}  {frame}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--frames", type=int, default=5, help="innermost frames shown per thread (default 5)")
    args = p.parse_args(argv)
    missing = [f for f in args.files if not f.is_file()]
    if missing:
        p.error(f"no such file: {missing[0]}")
    print(report(args.files, args.frames))
    return 0


if __name__ == "__main__":
    sys.exit(main())
