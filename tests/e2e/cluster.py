"""A real Tandem cluster for end-to-end tests: `tandem serve` as a subprocess (Ray, router, workers), on loopback.

    with ServeProcess(tmp_path, prefill=2, decode=2) as cluster:
        Client(cluster.address) ...

Stopping sends SIGTERM and waits for a clean exit; `exit_code` and `health_seen` (the router's health answers
observed while the workers were still starting) are kept for assertions.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

from tests.loopback import free_port, health

READY_LINE = "Tandem is serving"
STANDARD_PREFILL = STANDARD_DECODE = 2  # the shared standard cluster's pools (tests/e2e/conftest.py)


def engine_section(num_blocks: int) -> dict:
    return {
        "cache": {"block_size": 16, "num_blocks": num_blocks},
        "scheduler": {"max_num_seqs": 32, "max_num_batched_tokens": 512},
        "device": {"device": "cpu"},
    }


class ServeProcess:
    def __init__(
        self,
        tmp_path: Path,
        *,
        prefill: int = 1,
        decode: int = 1,
        colocated: int = 0,
        num_blocks: int = 256,
        model: str = "smollm2-135m-instruct",
        extra: dict | None = None,
        start_timeout_s: float = 300.0,
        metrics_port: int = 0,
        metrics_file_sd: Path | None = None,
        http_port: int = 0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.env = env  # on top of this process's environment (a joined Ray cluster's auth token, ...)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        # The OpenAI-compatible HTTP API: off (0) unless a test asks for it (its default port is 8000).
        self.http_address = f"http://127.0.0.1:{http_port}" if http_port else ""
        mode = "colocated" if colocated else "disaggregated"
        config: dict = {
            "model": model,
            "mode": mode,
            "router": {
                "host": "127.0.0.1",
                "port": self.port,
                "http_port": http_port,
                "metrics_port": metrics_port,
            },
            # heartbeat_timeout_s: how long an engine loop may go without a step before the controller replaces
            # the worker. One 512-token CPU step of a worker beside both halves of `make test` once took over the
            # default 10 s, and the controller replaced a working prefill worker mid-test. The hang tests stop a
            # worker's process (SIGSTOP), which unanswered heartbeats catch in seconds, not the loop's age.
            "controller": {"health_interval_s": 0.5, "drain_timeout_s": 20, "heartbeat_timeout_s": 60},
        }
        for role, replicas in (("prefill", prefill), ("decode", decode), ("colocated", colocated)):
            if replicas:
                config[role] = {"replicas": replicas, "num_gpus": 0, "engine": engine_section(num_blocks)}
        self.metrics_file_sd = metrics_file_sd
        if metrics_file_sd is not None:
            config["router"]["metrics_file_sd"] = str(metrics_file_sd)
        for key, value in (extra or {}).items():
            config[key] = value
        self.config_path = tmp_path / "tandem.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.lines: list[str] = []
        self.health_seen: list[int] = []
        self.exit_code: int | None = None
        self._ready = threading.Event()

    def __enter__(self) -> ServeProcess:
        env = {**os.environ, **(self.env or {}), "PYTHONUNBUFFERED": "1", "RAY_DEDUP_LOGS": "0"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tandem_cli.cli", "serve", "--config", str(self.config_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        threading.Thread(target=self._pump, daemon=True).start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self._ready.is_set():
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"tandem serve exited with {self.proc.returncode}:\n" + "".join(self.lines[-40:])
                )
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("tandem serve did not become ready:\n" + "".join(self.lines[-40:]))
            self._probe_health()
            time.sleep(0.2)
        return self

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if READY_LINE in line:
                self._ready.set()

    def _probe_health(self) -> None:
        status = health(self.address, timeout_s=0.5)
        if status is not None:
            self.health_seen.append(status)

    def stop(self, timeout_s: float = 90.0) -> int:
        if self.proc is None or self.exit_code is not None:
            return self.exit_code or 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.exit_code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.exit_code = self.proc.wait(10)
            raise
        return self.exit_code

    def __exit__(self, *exc) -> None:
        self.stop()


def make_cluster(
    tmp_path, *, router: dict | None = None, controller: dict | None = None, **kwargs
) -> ServeProcess:
    """A ServeProcess whose router/controller sections get these keys on top of the ones it writes (its
    `extra` would replace a whole section, port included)."""
    serve = ServeProcess(tmp_path, **kwargs)
    config = yaml.safe_load(serve.config_path.read_text())
    config["router"].update(router or {})
    config["controller"].update(controller or {})
    serve.config_path.write_text(yaml.safe_dump(config))
    return serve
