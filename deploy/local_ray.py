"""Starting a private local Ray node that a loaded host may be slow to bring up.

`ray.init(address="local")` gives its GCS 30 s (RAY_gcs_server_port_wait_time_s) to write its port file and its
raylet a fixed 30 s to register; on a busy host (a 2-core CI box running two test sessions, a node still loading
another model) either can pass, and the start fails with "Timed out waiting for file ..gcs_server_port.." or "The
current node timed out during startup". The processes of a start that failed keep running (Ray's reaper only
stops them when this process exits), so a second try would compete with them. The controller therefore, per
failed try: reads why from the session's own logs (the error Ray raises rarely says), stops that session's
processes, and tries again with a fresh session.

    prepare_environment()                   # before `import ray`
    session = newest_session()              # this process's newest session directory (None: Ray made none)
    why = failed_start_logs(session)        # the tails of its gcs_server/raylet .err/.out
    stopped = stop_failed_start(session)    # its processes (GCS, raylet, their agents), terminated
"""

from __future__ import annotations

import contextlib
import glob
import os

import psutil

GCS_PORT_WAIT_S = 90  # Ray's default is 30; a node that is merely slow should not fail for that
STOP_GRACE_S = 5.0
LOG_TAIL_LINES = 3
LOG_FILES = ("gcs_server.err", "gcs_server.out", "raylet.err", "raylet.out")


def prepare_environment() -> None:
    """Settings a private local node needs, set before `ray` is first imported (where Ray reads them); the
    operator's own values win."""
    # Ray 2.60 on Linux swaps a loopback node address for the host's routable one unless this is 0, and reads it
    # once, when `ray` is imported: a local cluster must keep all of its traffic on 127.0.0.1.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_gcs_server_port_wait_time_s", str(GCS_PORT_WAIT_S))


def newest_session(pid: int | None = None) -> str | None:
    """This process's newest Ray session directory (Ray names them session_<time>_<pid>, under its temp root),
    or None."""
    from ray._common.utils import get_default_ray_temp_dir

    pid = os.getpid() if pid is None else pid
    sessions = glob.glob(os.path.join(get_default_ray_temp_dir(), f"session_*_{pid}"))
    return max(sessions, key=os.path.getmtime) if sessions else None


def _tail(path: str, lines: int) -> list[str]:
    try:
        with open(path, errors="replace") as f:
            text = f.read()[-16384:]
    except OSError:
        return []
    return [line.strip() for line in text.splitlines() if line.strip()][-lines:]


def failed_start_logs(session: str) -> str:
    """The last lines of the session's GCS and raylet logs, one part per file that has any ("" when none)."""
    parts = []
    for name in LOG_FILES:
        tail = _tail(os.path.join(session, "logs", name), LOG_TAIL_LINES)
        if tail:
            parts.append(f"{name}: " + " | ".join(tail))
    return "; ".join(parts)


def stop_failed_start(session: str) -> int:
    """Terminate this process's descendants that belong to the session (their command line names it), with
    theirs (the raylet's agents and idle workers do not name it); SIGKILL what outlives STOP_GRACE_S. Returns how
    many were stopped."""
    doomed: dict[int, psutil.Process] = {}
    for child in psutil.Process().children(recursive=True):
        try:
            if any(session in arg for arg in child.cmdline()):
                doomed[child.pid] = child
                doomed.update((p.pid, p) for p in child.children(recursive=True))
        except psutil.Error:  # gone already, or not ours to read
            continue
    for proc in doomed.values():
        with contextlib.suppress(psutil.Error):  # gone already
            proc.terminate()
    _, alive = psutil.wait_procs(list(doomed.values()), timeout=STOP_GRACE_S)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    return len(doomed)
