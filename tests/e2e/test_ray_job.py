"""`ray job submit` end to end, on CPU: the documented way to run Tandem on a Ray cluster you already have.

    ray start --head (loopback, dashboard = job server)  ->  ray job submit --working-dir . -- python -m deploy.job
    -> router gRPC health SERVING -> one request == the offline engine's greedy text -> ray job stop -> STOPPED,
    router port closed -> the head is stopped -> no process of this cluster is left.

Everything stays on 127.0.0.1 and in a private temp dir, and the test never runs `ray stop`: that command stops
every Ray on the machine, including clusters that other tests or people run beside this one. Stopping the
`ray start --block` process stops exactly the processes it started; then the test checks that none of the
cluster's processes (everything in its session and every process seen under it) is still alive.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem_client import Client
from tandem_client.errors import TandemError
from tests.e2e.ray_head import REPO, RayHead, job_id_of, job_logs, job_status, wait_serving, write_config
from tests.loopback import free_port, port_open
from tests.polling import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

PROMPT = "The capital of France is"
MAX_TOKENS = 8


@pytest.fixture
def offline_text() -> Iterator[subprocess.Popen]:
    """The same prompt through the offline engine (greedy), started first so that it overlaps the cluster's
    start-up; the test reads its answer with `read_offline`."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem_cli.cli", "generate", "--offline", "--json"]
        + ["--max-tokens", str(MAX_TOKENS), "--temperature", "0", PROMPT],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def read_offline(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, f"tandem generate --offline failed:\n{err[-2000:]}"
    return str(json.loads(out.strip().splitlines()[-1])["text"])


@pytest.fixture
def head() -> Iterator[RayHead]:
    # A short private dir: Ray's unix socket paths must stay under 107 bytes.
    root = Path(tempfile.mkdtemp(prefix="tandem-rayjob-", dir="/tmp"))
    cluster = RayHead(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()  # a no-op when the test stopped it already
        if cluster.leftovers(timeout_s=20):
            cluster.kill_leftovers()
        shutil.rmtree(root, ignore_errors=True)


def tandem_router_answers(address: str) -> bool:
    """A Tandem router serves at `address` (its ListModels answers; any other server there does not)."""
    try:
        with Client(address, timeout=2) as client:
            return bool(client.list_models())
    except TandemError:
        return False


def test_ray_job_submit_serves_and_stops_cleanly(offline_text: subprocess.Popen, head: RayHead) -> None:
    router_port = free_port()
    address = f"127.0.0.1:{router_port}"
    config = write_config(head.root, router_port)
    submitted = head.ray(
        *("job", "submit", "--address", head.dashboard, "--no-wait", "--working-dir", "."),
        # Ray SIGKILLs a stopped job's driver after 3 s by default; the drain needs longer (docs/operations.md).
        *("--runtime-env-json", json.dumps({"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "60"}})),
        *("--", "python", "-m", "deploy.job", "--config", str(config)),
        timeout_s=120,
    )
    assert submitted.returncode == 0, submitted.stdout[-2000:] + submitted.stderr[-2000:]
    job_id = job_id_of(submitted.stdout + submitted.stderr)
    try:
        wait_serving(head, job_id, address, timeout_s=150)
        with Client(address) as client:
            result = client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0)
        assert result.text, "empty completion"
        assert result.finish_reason in ("length", "stop")
        assert result.text == read_offline(offline_text)
        head.remember()
    finally:
        stopped = head.ray("job", "stop", "--address", head.dashboard, job_id, timeout_s=90)
    assert stopped.returncode == 0, stopped.stdout[-2000:] + stopped.stderr[-2000:]
    assert job_status(head, job_id) == "STOPPED"
    logs = job_logs(head, job_id)
    # The driver got SIGTERM, drained and removed its workers before Ray's stop grace period ran out.
    assert "[tandem] stopped" in logs, logs
    # Our router is gone from its address. (Not "the port is closed": once freed, the port is an ordinary
    # ephemeral one, and a Ray process starting meanwhile may bind it; a clean-clone run once saw that.)
    wait_until(
        lambda: not tandem_router_answers(address),
        30,
        "the router to stop answering after `ray job stop`",
        lambda: f"port {router_port} open: {port_open(router_port)}",
    )
    head.stop()
    left = head.leftovers()
    assert not left, f"processes left after the head stopped: {left}"
