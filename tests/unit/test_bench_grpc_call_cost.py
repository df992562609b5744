"""bench/grpc_call_cost.py end to end (real gRPC servers on 127.0.0.1, a few requests): every case it reports was
timed, and the JSON says what ran."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_it_times_a_new_call_and_a_held_stream_against_both_servers(tmp_path: Path) -> None:
    out = tmp_path / "cost.json"
    run = subprocess.run(
        [sys.executable, "bench/grpc_call_cost.py", "--n", "10", "--payload-bytes", "100", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["settings"]["n"] == 10 and doc["settings"]["payload_bytes"] == 100
    assert set(doc["results"]) == {"sync server", "asyncio server"}
    for cases in doc["results"].values():
        assert set(cases) == {"new call", "stream"}
        for q in cases.values():
            assert 0 < q["median_ms"] <= q["p90_ms"] < 10_000, q


def test_it_refuses_too_few_requests(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "bench/grpc_call_cost.py", "--n", "3", "--out", str(tmp_path / "x.json")],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 2 and "--n must be >= 10" in run.stderr
    assert not (tmp_path / "x.json").exists()
