"""`tandem serve` with router.processes 2: a real CPU cluster (Ray, one colocated worker on the embedded model)
whose second router is a standalone process on router.port + 1 and router.metrics_port + 1. Both routers serve
requests (the second learns the worker from the controller's pushes), `tandem bench --server a,b` spreads its
requests over both, both routers count theirs on their own /metrics and both are in the Prometheus target list,
the second router killed is started again on its port and serves again, and stopping the service stops the
second router too. A second router's port that is taken fails the start-up,
naming the process and the port; router API keys without an admin key for the pushes are refused at start."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from bench.dvc_cpu import child_pids
from tandem_client import Client
from tandem_client.errors import TandemError
from tests.e2e.cluster import make_cluster
from tests.loopback import consecutive_free_ports, port_open
from tests.polling import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def requests_counted(metrics_address: str) -> float:
    """tandem_requests_total summed over its labels, from one router's /metrics."""
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("tandem_requests_total{")
    )


def serves(address: str) -> bool:
    """One short request through the router at `address` succeeds."""
    try:
        with Client(address, timeout=5) as client:
            return len(client.generate(token_ids=[1, 2, 3], max_tokens=2, ignore_eos=True).token_ids) == 2
    except TandemError:
        return False


def test_two_router_processes_serve_one_deployment_and_stop_together(tmp_path: Path) -> None:
    port, metrics_port = consecutive_free_ports(2), consecutive_free_ports(2)
    file_sd = tmp_path / "targets.json"
    serve = make_cluster(
        tmp_path,
        colocated=1,
        router={"port": port, "metrics_port": metrics_port, "processes": 2},
        metrics_file_sd=file_sd,
    )
    serve.port, serve.address = port, f"127.0.0.1:{port}"
    first, second = f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"
    with serve:
        ready = next(line for line in serve.lines if "Tandem is serving" in line)
        assert first in ready and second in ready
        for address in (first, second):
            with Client(address) as client:
                result = client.generate(token_ids=[1, 2, 3, 4], max_tokens=3, ignore_eos=True)
            assert len(result.token_ids) == 3, address
        report = tmp_path / "bench.json"
        bench = subprocess.run(
            [sys.executable, "-m", "tandem_cli.cli", "bench", "--server", f"{first},{second}",
             "--num-requests", "6", "--rate", "6", "--input-len", "8", "--output-len", "4",
             "--json", str(report)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert bench.returncode == 0, bench.stderr[-3000:]
        counts = json.loads(report.read_text())["counts"]
        assert counts["succeeded"] == counts["sent"] == 6
        # 1 + 3 requests each: the direct call and every other bench request.
        assert requests_counted(f"127.0.0.1:{metrics_port}") == 4
        assert requests_counted(f"127.0.0.1:{metrics_port + 1}") == 4
        groups = json.loads(file_sd.read_text())
        routers = next(g["targets"] for g in groups if g["labels"]["component"] == "router")
        assert sorted(routers) == sorted([f"127.0.0.1:{metrics_port}", f"127.0.0.1:{metrics_port + 1}"])
        # A router process that dies is started again on its ports and gets the worker set again.
        assert serve.proc is not None
        (pid,) = child_pids(serve.proc.pid, "deploy.router")
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: serves(second), timeout_s=60, what="the restarted router to serve a request")
        log = "".join(serve.lines)
        assert "router process 1 exited with -9" in log and "restarting it in 1s (1/10)" in log
        assert f"router process 1 is serving again on {second}" in log
        assert child_pids(serve.proc.pid, "deploy.router") not in ((), (pid,))
    assert serve.exit_code == 0, "".join(serve.lines[-30:])
    assert not port_open(port + 1), "the second router outlived tandem serve"


def test_a_taken_port_of_the_second_router_fails_the_start_naming_it(tmp_path: Path) -> None:
    port = consecutive_free_ports(2)
    held = socket.socket()
    held.bind(("127.0.0.1", port + 1))
    held.listen()
    try:
        serve = make_cluster(tmp_path, colocated=1, router={"port": port, "processes": 2})
        with pytest.raises(RuntimeError, match="exited with 1") as failed, serve:
            pass
    finally:
        held.close()
    text = str(failed.value)
    assert "router process 1 (router.processes)" in text
    assert f"router.port: cannot bind the router to 127.0.0.1:{port + 1}" in text
    assert not port_open(port), "the first router outlived the failed start"


def test_router_processes_behind_api_keys_without_an_admin_key_are_refused_at_start(tmp_path: Path) -> None:
    """The extra routers would never take the worker set (RouterControl asks an admin key): refused, exit 2."""
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [{"name": "alpha", "secret": "tk-alpha-0123456789abcdef"}]}))
    serve = make_cluster(
        tmp_path,
        colocated=1,
        router={"port": consecutive_free_ports(2), "processes": 2, "auth": {"api_keys_file": str(keys)}},
        env={"TANDEM_API_KEY": ""},
    )
    with pytest.raises(RuntimeError, match="exited with 2") as failed, serve:
        pass
    assert "set controller.admin_key_file (or TANDEM_API_KEY) to an admin key" in str(failed.value)
