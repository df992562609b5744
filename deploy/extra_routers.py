"""The router processes `tandem serve` runs beside its own when router.processes > 1.

One router process relays on the order of 10k tokens/s (its event loop is the limit: docs/operations.md,
`tandem_router_event_loop_lag_seconds`), so a node whose workers make more than that needs more routers, as the
chart's router.replicas gives on Kubernetes. Process i (1 .. processes - 1) is `python -m deploy.router --config
<the same file> --process-index i`: a standalone router on the configured ports + i that learns the workers from
the controller's pushes (deploy.publish.RouterPublisher), like a router pod.

    extra = ExtraRouters(config_path, count)
    extra.start(timeout_s)        # returns once each printed its address; raises RuntimeError with its output
    extra.addresses, extra.metrics_addresses
    extra.supervise(restart_limit, say)   # a router process that exits is started again, as a pod would be
    extra.stop()                  # SIGTERM (each drains), then SIGKILL whatever outlives the grace period

A restarted process serves on the same ports (its index fixes them), and the publisher's periodic push gives
it the worker set within one controller.health_interval_s.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

SERVING = re.compile(r"^Tandem router serving .+ on (\S+)$")
METRICS = re.compile(r"^Router metrics on (\S+)$")
STOP_GRACE_S = 30.0
SUPERVISE_INTERVAL_S = 0.5
RESTART_BACKOFF_S = (1.0, 2.0, 5.0, 10.0)  # before the 1st, 2nd, 3rd and every later restart of one process
RESTART_SERVING_S = 60.0  # for a restarted process to serve again


class _Process:
    """One router process and what it printed (its address, or why it failed)."""

    def __init__(self, index: int, config_path: str | None) -> None:
        command = [sys.executable, "-m", "deploy.router", "--process-index", str(index)]
        if config_path:
            command += ["--config", config_path]
        self.index = index
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        threading.Thread(target=self._pump, name=f"router-{index}-out", daemon=True).start()

    def _pump(self) -> None:
        """Keep the process's output, echoing it to our stderr."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            print(f"[router {self.index}] {line}", end="", file=sys.stderr, flush=True)

    def wait_serving(self, deadline: float) -> tuple[str, str]:
        """(gRPC address, metrics address or "") once it serves; RuntimeError when it exits first or the
        deadline passes."""
        while True:
            address = _first_match(SERVING, self.lines)
            if address:
                return address, _first_match(METRICS, self.lines)
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"router process {self.index} (router.processes) exited with {self.proc.returncode}: "
                    + self.last_lines()
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"router process {self.index} (router.processes) was not serving in time: "
                    + self.last_lines()
                )
            time.sleep(0.05)

    def last_lines(self) -> str:
        return " | ".join(line.strip() for line in self.lines[-5:])


class ExtraRouters:
    def __init__(self, config_path: str | None, count: int) -> None:
        self._config_path = config_path
        self._count = count
        self._procs: list[_Process] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None
        self.restarts = [0] * count  # per process, since start
        self.addresses: tuple[str, ...] = ()
        self.metrics_addresses: tuple[str, ...] = ()

    def start(self, timeout_s: float) -> None:
        """Start every process and wait until each serves. RuntimeError (naming the process and quoting its
        last lines) when one exits first or is not serving within timeout_s; the caller then calls stop()."""
        with self._lock:
            self._procs = [_Process(index, self._config_path) for index in range(1, self._count + 1)]
        deadline = time.monotonic() + timeout_s
        served = [p.wait_serving(deadline) for p in self._procs]
        self.addresses = tuple(address for address, _ in served)
        self.metrics_addresses = tuple(metrics for _, metrics in served if metrics)

    def supervise(
        self,
        restart_limit: int,
        say: Callable[[str], None],
        moved: Callable[[tuple[str, ...]], None] = lambda addresses: None,
    ) -> None:
        """From now on, start a process that exits again (after a short backoff), up to restart_limit times
        each; say() tells the operator what happened. A restarted process serves on the same ports, except
        with router.port 0, where it binds new ones: then moved(addresses) gets the new list."""
        thread = threading.Thread(
            target=self._supervise, args=(restart_limit, say, moved), name="router-supervisor", daemon=True
        )
        self._supervisor = thread
        thread.start()

    def _supervise(
        self, restart_limit: int, say: Callable[[str], None], moved: Callable[[tuple[str, ...]], None]
    ) -> None:
        while not self._stopping.wait(SUPERVISE_INTERVAL_S):
            with self._lock:
                exited = [(i, p) for i, p in enumerate(self._procs) if p.proc.poll() is not None]
            for i, process in exited:
                if self._stopping.is_set():
                    return
                code = process.proc.returncode
                if self.restarts[i] >= restart_limit:
                    if self.restarts[i] == restart_limit:  # said once
                        say(
                            f"router process {process.index} exited with {code} and was restarted "
                            f"{restart_limit} times (controller.restart_limit): left down; its clients must use "
                            "the other routers"
                        )
                        self.restarts[i] += 1
                    continue
                delay = RESTART_BACKOFF_S[min(self.restarts[i], len(RESTART_BACKOFF_S) - 1)]
                self.restarts[i] += 1
                say(
                    f"router process {process.index} exited with {code} ({process.last_lines() or 'no output'});"
                    f" restarting it in {delay:g}s ({self.restarts[i]}/{restart_limit})"
                )
                if self._stopping.wait(delay):
                    return
                with self._lock:
                    if self._stopping.is_set():
                        return
                    restarted = self._procs[i] = _Process(process.index, self._config_path)
                try:
                    address, _ = restarted.wait_serving(time.monotonic() + RESTART_SERVING_S)
                except RuntimeError as exc:  # the next pass sees it exited, and counts the next restart
                    if self._stopping.is_set():  # stop() ended it: nothing to report
                        return
                    say(str(exc))
                    continue
                if address != self.addresses[i]:
                    self.addresses = (*self.addresses[:i], address, *self.addresses[i + 1 :])
                    moved(self.addresses)
                say(f"router process {process.index} is serving again on {address}")

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM each (a router drains what it relays), SIGKILL what is still running after grace_s. No
        process is started again from here on."""
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=5)
        with self._lock:
            procs, self._procs = [p.proc for p in self._procs], []
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def _first_match(pattern: re.Pattern[str], lines: list[str]) -> str:
    for line in list(lines):
        match = pattern.match(line.strip())
        if match:
            return match.group(1)
    return ""
