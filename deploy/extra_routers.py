"""The router processes `tandem serve` runs beside its own when router.processes > 1.

One router process relays on the order of 10k tokens/s (its event loop is the limit: docs/operations.md,
`tandem_router_event_loop_lag_seconds`), so a node whose workers make more than that needs more routers, as the
chart's router.replicas gives on Kubernetes. Process i (1 .. processes - 1) is `python -m deploy.router --config
<the same file> --process-index i`: a standalone router on the configured ports + i that learns the workers from
the controller's pushes (deploy.publish.RouterPublisher), like a router pod.

    extra = ExtraRouters(config_path, count)
    extra.start(timeout_s)        # returns once each printed its address; raises RuntimeError with its output
    extra.addresses, extra.metrics_addresses
    extra.stop()                  # SIGTERM (each drains), then SIGKILL whatever outlives the grace period
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

SERVING = re.compile(r"^Tandem router serving .+ on (\S+)$")
METRICS = re.compile(r"^Router metrics on (\S+)$")
STOP_GRACE_S = 30.0


class ExtraRouters:
    def __init__(self, config_path: str | None, count: int) -> None:
        self._config_path = config_path
        self._count = count
        self._procs: list[subprocess.Popen[str]] = []
        self._lines: list[list[str]] = []
        self.addresses: tuple[str, ...] = ()
        self.metrics_addresses: tuple[str, ...] = ()

    def start(self, timeout_s: float) -> None:
        """Start every process and wait until each serves. RuntimeError (naming the process and quoting its
        last lines) when one exits first or is not serving within timeout_s; the caller then calls stop()."""
        for index in range(1, self._count + 1):
            command = [sys.executable, "-m", "deploy.router", "--process-index", str(index)]
            if self._config_path:
                command += ["--config", self._config_path]
            proc = subprocess.Popen(
                command,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
            lines: list[str] = []
            self._procs.append(proc)
            self._lines.append(lines)
            threading.Thread(
                target=_pump, args=(proc, lines), name=f"router-{index}-out", daemon=True
            ).start()
        deadline = time.monotonic() + timeout_s
        addresses: list[str] = []
        metrics: list[str] = []
        for index, (proc, lines) in enumerate(zip(self._procs, self._lines), start=1):
            address = ""
            while not address:
                address = _first_match(SERVING, lines)
                if address:
                    break
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"router process {index} (router.processes) exited with {proc.returncode}: "
                        + " | ".join(line.strip() for line in lines[-5:])
                    )
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"router process {index} (router.processes) was not serving after {timeout_s:g}s: "
                        + " | ".join(line.strip() for line in lines[-5:])
                    )
                time.sleep(0.05)
            addresses.append(address)
            metrics.append(_first_match(METRICS, lines))
        self.addresses = tuple(addresses)
        self.metrics_addresses = tuple(m for m in metrics if m)

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM each (a router drains what it relays), SIGKILL what is still running after grace_s."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self._procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        self._procs = []


def _pump(proc: subprocess.Popen[str], lines: list[str]) -> None:
    """Keep the process's output (its address, or why it failed), echoing it to our stderr."""
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        print(f"[router {proc.pid}] {line}", end="", file=sys.stderr, flush=True)


def _first_match(pattern: re.Pattern[str], lines: list[str]) -> str:
    for line in list(lines):
        match = pattern.match(line.strip())
        if match:
            return match.group(1)
    return ""
