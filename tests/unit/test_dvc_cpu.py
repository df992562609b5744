"""bench/disagg_vs_colocated.py's CPU meter: how many cores the `tandem serve` process (router, controller) and
the bench client used over a point, read from /proc, and the warning when one of them was saturated."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from bench.dvc_cpu import SATURATED_CORES, CpuMeter, cpu_line, process_cpu_seconds

pytestmark = pytest.mark.unit


def test_a_busy_process_reads_about_one_core_and_an_idle_one_about_none() -> None:
    busy = subprocess.Popen(
        [sys.executable, "-c", "import time\nend = time.time() + 3\nwhile time.time() < end: pass"]
    )
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"])
    try:
        time.sleep(0.5)  # past both interpreters' start-up
        meters = CpuMeter(busy.pid), CpuMeter(idle.pid)
        time.sleep(1.5)
        hot, cold = (m.read()["serve_process_cores"] for m in meters)
    finally:
        busy.kill(), idle.kill()
        busy.wait(), idle.wait()
    assert hot > 0.5 and cold < 0.1, (hot, cold)


def test_the_busiest_other_router_process_is_found_among_the_children_and_measured() -> None:
    """child_pids finds a `tandem serve`'s extra routers by parent and command line (here: this test's own
    children, one busy and one idle, with "deploy.router" in their command lines)."""
    from bench.dvc_cpu import child_pids

    busy = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nend = time.time() + 3\nwhile time.time() < end: pass",
            "deploy.router",
        ]
    )
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)", "deploy.router"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"])
    try:
        time.sleep(0.5)
        pids = child_pids(os.getpid(), "deploy.router")
        assert pids == tuple(sorted((busy.pid, idle.pid)))
        meter = CpuMeter(None, router_pids=pids)
        time.sleep(1.5)
        busiest = meter.read()["busiest_other_router_cores"]
    finally:
        for proc in (busy, idle, other):
            proc.kill()
            proc.wait()
    # The spinning child's share, not the idle one's (about 0): on the 2-core CI box beside the other test half
    # it got exactly 0.5 of a core once, so the bound sits well under that and well above idle.
    assert busiest > 0.25, busiest
    assert child_pids(os.getpid(), "deploy.router") == ()  # gone


def test_process_cpu_seconds_counts_this_process_and_not_a_missing_one() -> None:
    before = process_cpu_seconds(os.getpid())
    assert before is not None
    end = time.process_time() + 0.2
    while time.process_time() < end:
        pass
    after = process_cpu_seconds(os.getpid())
    assert after is not None and after - before >= 0.1
    assert process_cpu_seconds(2**22 + 1) is None  # above Linux's pid limit: no such process


def test_the_line_names_each_process_and_warns_when_one_was_saturated() -> None:
    calm = cpu_line({"bench_client_cores": 0.31, "serve_process_cores": 0.42})
    assert calm == "; CPU: bench client 0.31 cores, serve process 0.42 cores"
    hot = cpu_line({"bench_client_cores": 0.2, "serve_process_cores": SATURATED_CORES + 0.05})
    assert "saturated: serve process" in hot and "bench client" not in hot.split("saturated")[1]
    assert cpu_line({}) == ""


def test_the_summary_lists_the_points_where_a_process_was_saturated() -> None:
    from bench.dvc_summary import saturated_points
    from bench.dvc_tables import saturation_table

    def point(rate: float, cpu: dict) -> dict:
        return {"settings": {"rate": rate}, "cpu": cpu}

    points = {
        "disagg-1p3d": [point(16, {"serve_process_cores": 0.4}), point(32, {"serve_process_cores": 0.97})],
        "colocated": [
            point(8, {"bench_client_cores": 0.9, "serve_process_cores": 0.2}),
            {"settings": {"rate": 2}},
        ],
    }
    rows = saturated_points(points)
    assert rows == [
        {"deployment": "disagg-1p3d", "rate": 32, "serve_process_cores": 0.97},
        {"deployment": "colocated", "rate": 8, "bench_client_cores": 0.9},
    ]
    table = saturation_table([{"workload": "decode-heavy", "saturated": rows}])
    assert "| decode-heavy | disagg-1p3d | 32 | serve process 0.97 |" in table
    assert "| decode-heavy | colocated | 8 | bench client 0.90 |" in table
    assert saturation_table([{"workload": "w", "saturated": []}]) == ""
