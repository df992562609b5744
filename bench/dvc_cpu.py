"""bench/disagg_vs_colocated.py's CPU meter: how many cores the `tandem serve` process (router, controller), its
other router processes and the bench client used over one point, read from /proc, and the warning when one of
them was saturated (its own queueing is then in the point's latencies)."""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path


def _stat_fields(stat: Path) -> list[str]:
    """The fields of a /proc/<pid>/stat after the command name (which may hold spaces and parentheses):
    state, ppid, pgrp, session, tty, tpgid, flags, 4 fault counts, utime, stime, ... Raises OSError or
    IndexError when the process is gone."""
    return stat.read_text().rsplit(")", 1)[1].split()


def process_cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system) a process has used, from /proc (Linux); None where there is no /proc."""
    try:
        fields = _stat_fields(Path(f"/proc/{pid}/stat"))
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


SATURATED_CORES = 0.85  # a single-threaded loop this busy queues what it serves (the router's event loop)


def _client_cpu_seconds() -> float:
    """This process's CPU seconds plus those of its children that have exited (the client processes of a
    point sent with --client-processes, reaped by the time it ends)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


class CpuMeter:
    """How many cores the `tandem serve` process (router, controller) and the bench client (this process and
    its client processes: `clients` of them share the load) used over one point. One Python event loop past
    SATURATED_CORES adds its own queueing to the latencies."""

    def __init__(self, serve_pid: int | None, clients: int = 1, router_pids: tuple[int, ...] = ()) -> None:
        self._pid = serve_pid
        self._clients = clients
        self._serve = None if serve_pid is None else process_cpu_seconds(serve_pid)
        self._client = _client_cpu_seconds()
        # router.processes > 1: the other router processes, each one event loop (the busiest is reported)
        self._routers = {pid: process_cpu_seconds(pid) for pid in router_pids}
        self._wall = time.monotonic()

    def read(self) -> dict[str, float]:
        wall = max(1e-9, time.monotonic() - self._wall)
        # Per client process: the load is spread evenly over them (tandem_cli.bench.processes).
        client = (_client_cpu_seconds() - self._client) / wall / self._clients
        cores = {"bench_client_cores": round(client, 3)}
        serve = None if self._pid is None else process_cpu_seconds(self._pid)
        if serve is not None and self._serve is not None:
            cores["serve_process_cores"] = round((serve - self._serve) / wall, 3)
        busiest = [
            (now - before) / wall
            for pid, before in self._routers.items()
            if before is not None and (now := process_cpu_seconds(pid)) is not None
        ]
        if busiest:
            cores["busiest_other_router_cores"] = round(max(busiest), 3)
        return cores


def child_pids(parent: int, command_part: str) -> tuple[int, ...]:
    """Processes whose parent is `parent` and whose command line contains `command_part` (Linux /proc; () where
    there is none): the extra router processes of a `tandem serve`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(_stat_fields(stat)[1]) != parent:
                continue
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
        if command_part in cmdline:
            found.append(int(stat.parent.name))
    return tuple(sorted(found))


def process_label(key: str) -> str:
    """ "serve process" for CpuMeter's "serve_process_cores"."""
    return key.removesuffix("_cores").replace("_", " ")


def cpu_line(cores: dict[str, float]) -> str:
    """The point's CPU use for its progress line, with a warning when a process was saturated."""
    parts = [f"{process_label(name)} {value:.2f} cores" for name, value in cores.items()]
    hot = [process_label(name) for name, v in cores.items() if v >= SATURATED_CORES]
    warning = f" (saturated: {', '.join(hot)}; its queueing is in the latencies)" if hot else ""
    return f"; CPU: {', '.join(parts)}{warning}" if parts else ""
