"""A Ray head of a test's own, on loopback, and the `ray job` calls the Ray-job e2e test (test_ray_job.py) makes.

Everything stays on 127.0.0.1 and in a private temp dir, and nothing here runs `ray stop`: that command stops
every Ray on the machine, including clusters that other tests or people run beside this one. Stopping the
`ray start --block` process stops exactly the processes it started; `leftovers()` then finds any of the
cluster's processes (everything in its session and every process seen under it) still alive.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml
from grpc_health.v1 import health_pb2

from tests.e2e.cluster import engine_section
from tests.loopback import free_ports, health

REPO = Path(__file__).resolve().parents[2]
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


def ray_cli() -> str:
    """The `ray` script of this interpreter's environment (CI does not put the venv on PATH)."""
    candidate = Path(sys.executable).parent / "ray"
    if not candidate.exists():
        pytest.skip(f"no ray command next to {sys.executable}")
    return str(candidate)


class RayHead:
    """A Ray head with the job server, on loopback, owned by this test.

    node_ip 127.0.0.1 (the default): a single-node cluster. Any other loopback address (127.0.0.2, ...): a head
    that other nodes may join (tests/e2e/ray_nodes.py), each node on its own loopback address, so that Ray sees
    distinct nodes on one machine while every byte stays on the loopback interface.
    """

    def __init__(
        self,
        root: Path,
        node_ip: str = "127.0.0.1",
        resources: dict[str, float] | None = None,
        system_config: dict | None = None,
        num_cpus: int = 2,
        labels: dict[str, str] | None = None,
    ) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.node_ip = node_ip
        self.extra = ["--num-cpus", str(num_cpus)]
        if resources:
            self.extra += ["--resources", json.dumps(resources)]
        if system_config:
            self.extra += ["--system-config", json.dumps(system_config)]
        if labels:
            self.extra += ["--labels", ",".join(f"{key}={value}" for key, value in labels.items())]
        ports = free_ports(len(RAY_PORT_FLAGS))
        self.flags = [item for flag, port in zip(RAY_PORT_FLAGS, ports) for item in (flag, str(port))]
        self.dashboard = f"http://127.0.0.1:{ports[1]}"
        self.gcs_address = f"{node_ip}:{ports[0]}"
        token = root / "auth_token"
        token.write_text(secrets.token_hex(32))
        self.env = {
            **os.environ,
            # The job's `python` must be this interpreter (its packages), and so must Ray's own processes.
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            # On Linux `ray start` turns --node-ip-address 127.0.0.1 into the host's routable address; this
            # switch (meant for single-node macOS/Windows) keeps the node, and so every worker, on loopback. It
            # also refuses other nodes, so a multi-node head leaves it on: Ray keeps 127.0.0.2 and the like as
            # they are (only 127.0.0.1, ::1 and "localhost" are swapped).
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0" if node_ip == "127.0.0.1" else "1",
            # Token auth with a token of our own: no dependence on (or write to) ~/.ray/auth_token.
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(token),
            "RAY_USAGE_STATS_ENABLED": "0",
            "PYTHONUNBUFFERED": "1",
        }
        self.env.pop("RAY_ADDRESS", None)
        self.proc: subprocess.Popen | None = None
        self.seen: dict[int, str] = {}  # pid -> name of every process observed in this cluster

    def command(self) -> list[str]:
        return (
            [ray_cli(), "start", "--head", "--block", "--node-ip-address", self.node_ip, *self.extra]
            + ["--dashboard-host", "127.0.0.1", "--include-dashboard", "true", "--disable-usage-stats"]
            + ["--temp-dir", str(self.root / "ray"), *self.flags]
        )

    def start(self, timeout_s: float = 90.0) -> None:
        with open(self.root / "ray_start.log", "w") as log:  # Popen keeps its own copy of the fd
            self.proc = subprocess.Popen(
                self.command(),
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
        "router": {"host": "127.0.0.1", "port": router_port, "http_port": 0, "metrics_port": 0},
        "controller": {"health_interval_s": 0.5, "drain_timeout_s": 10},
        "prefill": {"replicas": 1, "num_gpus": 0, "engine": engine_section(64)},
        "decode": {"replicas": 1, "num_gpus": 0, "engine": engine_section(64)},
    }
    path = root / "tandem.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


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
        if health(address, timeout_s=1.0) == health_pb2.HealthCheckResponse.SERVING:
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


def job_id_of(output: str) -> str:
    for line in output.splitlines():
        if "Job '" in line and "submitted successfully" in line:
            return line.split("Job '", 1)[1].split("'", 1)[0]
    raise AssertionError(f"no job id in `ray job submit` output:\n{output[-2000:]}")
