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

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem_client import Client
from tests.e2e.cluster import engine_section

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]
PROMPT = "The capital of France is"
MAX_TOKENS = 8
RAY_PORT_FLAGS = (
    "--port",
    "--dashboard-port",
    "--ray-client-server-port",
    "--dashboard-agent-listen-port",
    "--dashboard-agent-grpc-port",
    "--runtime-env-agent-port",
    "--metrics-export-port",
    "--node-manager-port",
    "--object-manager-port",
)


def free_ports(count: int) -> list[int]:
    """Distinct free loopback ports (all held open together so none repeats)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


def ray_cli() -> str:
    """The `ray` script of this interpreter's environment (CI does not put the venv on PATH)."""
    candidate = Path(sys.executable).parent / "ray"
    if not candidate.exists():
        pytest.skip(f"no ray command next to {sys.executable}")
    return str(candidate)


class RayHead:
    """A single-node Ray head with the job server, on loopback, owned by this test."""

    def __init__(self, root: Path) -> None:
        self.root = root
        ports = free_ports(len(RAY_PORT_FLAGS))
        self.flags = [item for flag, port in zip(RAY_PORT_FLAGS, ports) for item in (flag, str(port))]
        self.dashboard = f"http://127.0.0.1:{ports[1]}"
        token = root / "auth_token"
        token.write_text(secrets.token_hex(32))
        self.env = {
            **os.environ,
            # The job's `python` must be this interpreter (its packages), and so must Ray's own processes.
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            # On Linux `ray start` turns --node-ip-address 127.0.0.1 into the host's routable address; this
            # switch (meant for single-node macOS/Windows) keeps the node, and so every worker, on loopback.
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            # Token auth with a token of our own: no dependence on (or write to) ~/.ray/auth_token.
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(token),
            "RAY_USAGE_STATS_ENABLED": "0",
            "PYTHONUNBUFFERED": "1",
        }
        self.env.pop("RAY_ADDRESS", None)
        self.proc: subprocess.Popen | None = None
        self.seen: dict[int, str] = {}  # pid -> name of every process observed in this cluster

    def start(self, timeout_s: float = 90.0) -> None:
        with open(self.root / "ray_start.log", "w") as log:  # Popen keeps its own copy of the fd
            self.proc = subprocess.Popen(
                [ray_cli(), "start", "--head", "--block", "--num-cpus", "2", "--node-ip-address", "127.0.0.1"]
                + ["--dashboard-host", "127.0.0.1", "--include-dashboard", "true", "--disable-usage-stats"]
                + ["--temp-dir", str(self.root / "ray"), *self.flags],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,  # its own session: every Ray process it starts shares the session id
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"ray start exited with {self.proc.returncode}:\n{self.log('ray_start.log')}"
                )
            if "block forever" in self.log("ray_start.log"):
                return
            time.sleep(0.5)
        raise RuntimeError(f"ray start did not finish in {timeout_s}s:\n{self.log('ray_start.log')}")

    def ray(self, *args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
        return subprocess.run(
            [ray_cli(), *args], env=self.env, cwd=REPO, capture_output=True, text=True, timeout=timeout_s
        )

    def log(self, name: str) -> str:
        path = self.root / name
        return path.read_text(errors="replace") if path.exists() else ""

    def processes(self) -> list[psutil.Process]:
        """Alive processes of this cluster: the ray start process, its session, and all their descendants
        (the job driver runs in a session of its own, under the job supervisor)."""
        if self.proc is None:
            return []
        found: dict[int, psutil.Process] = {}
        for proc in psutil.process_iter(["pid", "name"]):
            try:
                if os.getsid(proc.pid) == self.proc.pid:
                    found[proc.pid] = proc
            except (ProcessLookupError, PermissionError):
                continue
        for root in list(found.values()):
            try:
                found.update({child.pid: child for child in root.children(recursive=True)})
            except psutil.NoSuchProcess:
                continue
        return list(found.values())

    def remember(self) -> None:
        for proc in self.processes():
            try:
                self.seen[proc.pid] = " ".join(proc.cmdline())[:120] or proc.name()
            except psutil.Error:
                continue

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM to `ray start --block` stops the processes it started; SIGKILL whatever outlives that."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.remember()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def leftovers(self, timeout_s: float = 20.0) -> list[str]:
        """Processes of this cluster still alive after `timeout_s` (Ray's orphan watchers poll once a second)."""
        deadline = time.monotonic() + timeout_s
        while True:
            alive = [f"{pid} {name}" for pid, name in self.seen.items() if _alive(pid)]
            alive += [
                f"{p.pid} {p.name()}" for p in self.processes() if p.pid not in self.seen and _alive(p.pid)
            ]
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.5)

    def kill_leftovers(self) -> None:
        for pid in list(self.seen) + [p.pid for p in self.processes()]:
            if _alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def write_config(root: Path, router_port: int) -> Path:
    """What tests/e2e/cluster.py runs, as a deploy config for the job: embedded model, 1 + 1 CPU workers."""
    config = {
        "model": "smollm2-135m-instruct",
        "mode": "disaggregated",
        "router": {"host": "127.0.0.1", "port": router_port, "metrics_port": 0},
        "controller": {"health_interval_s": 0.5, "drain_timeout_s": 10},
        "prefill": {"replicas": 1, "num_gpus": 0, "engine": engine_section(64)},
        "decode": {"replicas": 1, "num_gpus": 0, "engine": engine_section(64)},
    }
    path = root / "tandem.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def health(address: str) -> int | None:
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
            return int(reply.status)
    except grpc.RpcError:
        return None


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def job_status(head: RayHead, job_id: str) -> str:
    """The job's status word, read from `ray job status` (it prints a sentence per status)."""
    out = head.ray("job", "status", "--log-style", "record", "--address", head.dashboard, job_id).stdout
    sentences = {"succeeded": "SUCCEEDED", "was stopped": "STOPPED", "failed": "FAILED"}
    for sentence, status in sentences.items():
        if f"Job '{job_id}' {sentence}" in out:
            return status
    marker = f"Status for job '{job_id}': "
    if marker in out:
        return out.split(marker, 1)[1].split()[0].rsplit(".", 1)[-1]
    return f"unknown: {out.strip()[-300:]}"


def wait_serving(head: RayHead, job_id: str, address: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    next_status = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        if health(address) == health_pb2.HealthCheckResponse.SERVING:
            return
        if time.monotonic() > next_status:  # a CLI call costs a Python start-up: only now and then
            status = job_status(head, job_id)
            if status in ("FAILED", "STOPPED", "SUCCEEDED"):
                raise AssertionError(
                    f"job {job_id} ended ({status}) before serving:\n{job_logs(head, job_id)}"
                )
            next_status = time.monotonic() + 5.0
        time.sleep(0.5)
    raise AssertionError(f"router {address} not SERVING after {timeout_s}s:\n{job_logs(head, job_id)}")


def job_logs(head: RayHead, job_id: str) -> str:
    """The driver's output, and the status message (why a job failed before its entrypoint ran)."""
    logs = head.ray("job", "logs", "--address", head.dashboard, job_id, timeout_s=30).stdout[-4000:]
    status = head.ray("job", "status", "--log-style", "record", "--address", head.dashboard, job_id).stdout
    return f"{logs}\n{status[-2000:]}"


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


def test_ray_job_submit_serves_and_stops_cleanly(offline_text: subprocess.Popen, head: RayHead) -> None:
    router_port = free_ports(1)[0]
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
    job_id = _job_id(submitted.stdout + submitted.stderr)
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
    deadline = time.monotonic() + 30
    while port_open(router_port) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not port_open(router_port), "the router still listens after `ray job stop`"
    head.stop()
    left = head.leftovers()
    assert not left, f"processes left after the head stopped: {left}"


def _job_id(output: str) -> str:
    for line in output.splitlines():
        if "Job '" in line and "submitted successfully" in line:
            return line.split("Job '", 1)[1].split("'", 1)[0]
    raise AssertionError(f"no job id in `ray job submit` output:\n{output[-2000:]}")
