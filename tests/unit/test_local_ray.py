"""A private local Ray node that fails to start: the controller says why from the session's own logs, stops the
failed session's processes (they outlive the failed ray.init) and tries again; after the last try the error names
the number of tries. Real processes throughout: a real Ray GCS that is given no time to publish its port, and
real child processes for the stop."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from deploy import local_ray

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[2]


def session_dir(root: Path, stamp: str, pid: int) -> Path:
    logs = root / "ray" / f"session_{stamp}_{pid}" / "logs"
    logs.mkdir(parents=True)
    return logs.parent


def test_failed_start_logs_are_the_tails_of_the_newest_session_of_this_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    older = session_dir(tmp_path, "2026-11-30_04-59-22_000001", os.getpid())
    (older / "logs" / "gcs_server.err").write_text("from the older session\n")
    os.utime(older, (time.time() - 60, time.time() - 60))
    other = session_dir(tmp_path, "2026-11-30_05-00-00_000001", os.getpid() + 1)  # another process's
    (other / "logs" / "raylet.err").write_text("from another process\n")
    newest = session_dir(tmp_path, "2026-11-30_04-59-54_000002", os.getpid())
    (newest / "logs" / "gcs_server.err").write_text(
        "line 1\n\nline 2\nline 3\nbind: Address already in use\n"
    )
    (newest / "logs" / "raylet.out").write_text("raylet: cannot register\n")

    assert local_ray.newest_session() == str(newest)
    why = local_ray.failed_start_logs(str(newest))
    assert why == (
        "gcs_server.err: line 2 | line 3 | bind: Address already in use; raylet.out: raylet: cannot register"
    )
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path / "none"))
    assert local_ray.newest_session() is None
    assert local_ray.failed_start_logs(str(tmp_path / "none" / "ray" / "session_x")) == ""


def test_stop_failed_start_stops_the_sessions_processes_and_their_children_only(tmp_path: Path) -> None:
    session = str(tmp_path / "ray" / f"session_x_{os.getpid()}")
    # A stand-in for a raylet: it names the session, and its own child (an agent) does not.
    raylet = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
            " time.sleep(60)",
            f"--session-dir={session}",
        ]
    )
    bystander = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "--session-dir=/elsewhere"]
    )
    try:
        deadline = time.monotonic() + 30
        while not psutil.Process(raylet.pid).children() and time.monotonic() < deadline:
            time.sleep(0.05)
        (agent,) = psutil.Process(raylet.pid).children()
        assert local_ray.stop_failed_start(session) == 2
        assert raylet.wait(10) is not None
        assert not agent.is_running() or agent.status() == psutil.STATUS_ZOMBIE
        assert bystander.poll() is None
    finally:
        bystander.kill()
        raylet.kill()


def test_a_local_ray_that_cannot_start_fails_after_three_tries_and_leaves_no_process() -> None:
    # A GCS given 0 s to publish its port always times out: every try fails as on an overloaded host.
    script = textwrap.dedent(
        """
        import psutil
        from deploy.config import parse_config
        from deploy.controller import Controller
        config = parse_config({"model": "dummy:tiny", "mode": "colocated", "colocated": {"replicas": 1}})
        try:
            Controller(config, lambda members, generation: None).connect()
            print("RESULT started")
        except Exception as exc:
            print("RESULT failed:", exc)
        print("LEFT", len(psutil.Process().children(recursive=True)))
        """
    )
    # A short temp root of its own: Ray's socket paths under it must stay within AF_UNIX's 107 bytes.
    root = Path(tempfile.mkdtemp(prefix="tandem-ray-"))
    env = {
        **os.environ,
        "RAY_gcs_server_port_wait_time_s": "0",
        "RAY_TMPDIR": str(root),
        "PYTHONPATH": str(REPO),
    }
    try:
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=REPO, timeout=100
        )
        sessions = list((root / "ray").glob("session_2*"))  # not session_latest
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out = done.stdout + done.stderr
    assert "RESULT failed: Timed out waiting for file" in out and "(after 3 tries" in out, out
    assert out.count("Ray did not start, try") == 2, out
    assert "LEFT 0" in out, out
    assert len(sessions) == 3, sessions
