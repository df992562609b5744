"""bench/pyspy_threads.py reads py-spy's raw output: each thread's share of the GIL samples and the innermost
frames of the threads that compete with the engine loop."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.pyspy_threads import report, thread_shares

pytestmark = pytest.mark.unit

RAW = """\
thread (101): engine-loop;Thread.run (threading.py:982);Engine.step (model_runtime/engine.py:237) 70
thread (101): engine-loop;Thread.run (threading.py:982);Sampler.sample (model_runtime/sampler.py:40) 10
thread (102): colocated-0-rpc_3;_serve (grpc/_server.py:900);worker_info (worker_host/rpc.py:66) 12
thread (103): gil-probe;GilProbe._run (worker_host/gil_probe.py:60) 5
thread (104);Thread.run (threading.py:982);poll (selectors.py:1) 3
not a sample line
"""


def test_threads_share_the_gil_samples_and_their_innermost_frames_are_counted(tmp_path: Path) -> None:
    threads, leaves, total = thread_shares(RAW.splitlines())
    assert total == 100
    assert threads == {"engine-loop": 80, "colocated-0-rpc_3": 12, "gil-probe": 5, "unnamed": 3}
    assert leaves["colocated-0-rpc_3"] == {"worker_info (worker_host/rpc.py:66)": 12}
    path = tmp_path / "pyspy.txt"
    path.write_text(RAW)
    text = report([path], frames=1)
    assert "100 samples" in text and " 80.0%  engine-loop" in text
    assert "12.0%  worker_info (worker_host/rpc.py:66)" in text
    assert "Engine.step" not in text  # the engine loop's own frames are not what competes with it
