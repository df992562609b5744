"""`tandem bench` end to end: a real CPU service (`tandem serve`, 1 prefill + 1 decode, the embedded model) and
the bench command as a subprocess. Loads are tiny: the point is that runs complete, counts reconcile and the
JSON holds what the flags asked for, not the numbers themselves."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tandem_client import Client
from tests.e2e.cluster import ServeProcess

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def cluster(standard_cluster: ServeProcess) -> ServeProcess:
    """The shared standard cluster (tests/e2e/conftest.py): these tests only send it requests."""
    return standard_cluster


def run_bench(address: str, out: Path, *flags: str, timeout_s: float = 120.0) -> tuple[dict, str]:
    """Run `tandem bench`; returns (the JSON report, stdout)."""
    cmd = [
        sys.executable,
        "-m",
        "tandem_cli.cli",
        "bench",
        "--server",
        address,
        "--json",
        str(out),
        *flags,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def assert_reconciled(counts: dict) -> None:
    assert counts["sent"] == counts["succeeded"] + counts["failed"] + counts["cancelled"]
    assert counts["failed"] == sum(counts["failed_by_code"].values())


def wait_idle(address: str, timeout_s: float = 20.0) -> None:
    """Cancelled requests must release their KV blocks on every worker."""
    deadline = time.monotonic() + timeout_s
    with Client(address) as client:
        while True:
            busy = [(w.worker_id, w.kv_blocks_used) for w in client.status().workers if w.kv_blocks_used]
            if not busy:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"workers still hold KV blocks after the bench: {busy}")
            time.sleep(0.3)


def test_small_bounded_run_completes_with_exact_lengths(cluster, tmp_path):
    report, stdout = run_bench(
        cluster.address, tmp_path / "run.json",
        "--rate", "4", "--num-requests", "12", "--input-len", "16", "--output-len", "8",
        "--seed", "3", "--slo", "ttft=30,tpot=10", "--plot-dir", str(tmp_path / "plots"),
    )  # fmt: skip
    counts = report["counts"]
    assert_reconciled(counts)
    assert counts["sent"] == counts["succeeded"] == 12, counts
    rows = report["requests"]
    assert [r["output_tokens"] for r in rows] == [8] * 12  # ignore_eos + max_tokens: exact lengths
    assert all(r["input_len"] == 16 for r in rows)
    assert report["output_token_throughput"] * report["duration_s"] == pytest.approx(12 * 8)
    for metric in ("ttft", "tpot", "itl", "e2e"):
        s = report[metric]
        assert 0 <= s["p50"] <= s["p90"] <= s["p99"] <= s["max"], (metric, s)
    assert report["itl"]["count"] == 12 * 7  # n - 1 inter-token gaps per request
    assert report["ttft"]["p99"] <= report["e2e"]["p99"]
    # generous SLOs: everything meets them on an idle CPU service
    assert report["goodput"]["met"] == 12 and report["goodput"]["share"] == 1.0
    assert report["settings"]["rate"] == 4.0 and report["settings"]["seed"] == 3
    assert report["model"] and "commit" in report
    assert "goodput (ttft=30.0,tpot=10.0): 12/12" in stdout
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "plots" / "latency_cdf.png").stat().st_size > 0


def test_duration_bound_cancels_what_still_runs(cluster, tmp_path):
    # 400 output tokens take the CPU service several seconds, so every request sent in the first second is
    # still running at duration + drain = 1 s and gets cancelled; none is sent after 1 s.
    report, _ = run_bench(
        cluster.address, tmp_path / "cut.json",
        "--rate", "6", "--num-requests", "40", "--input-len", "16", "--output-len", "400",
        "--duration", "1", "--drain", "0", "--no-progress",
    )  # fmt: skip
    counts = report["counts"]
    assert_reconciled(counts)
    assert 1 <= counts["sent"] < 40, counts
    assert counts["cancelled"] >= 1, counts
    assert all(r["sent_at"] < 1.0 for r in report["requests"])
    assert report["duration_s"] < 10


def test_cancelled_requests_release_their_kv_blocks(cluster):
    wait_idle(cluster.address, timeout_s=10.0)


def test_closed_loop_trace_run(cluster, tmp_path):
    trace = tmp_path / "trace.jsonl"
    lines = [{"input_len": 5, "output_len": 3}, {"prompt_token_ids": [1000, 1001, 1002], "output_len": 2}]
    trace.write_text("\n".join(json.dumps(line) for line in lines * 2) + "\n")
    report, _ = run_bench(
        cluster.address,
        tmp_path / "closed.json",
        "--concurrency",
        "2",
        "--trace",
        str(trace),
        "--no-progress",
    )
    assert_reconciled(report["counts"])
    assert report["counts"]["succeeded"] == 4  # --num-requests defaults to the trace's length
    rows = report["requests"]
    assert [(r["input_len"], r["output_tokens"]) for r in rows] == [(5, 3), (3, 2), (5, 3), (3, 2)]
    assert report["settings"]["concurrency"] == 2 and report["settings"]["rate"] is None


def test_the_openai_protocol_drives_the_http_api_with_the_same_workload(cluster, tmp_path):
    report, stdout = run_bench(
        cluster.http_address, tmp_path / "http.json",
        "--protocol", "openai", "--concurrency", "3", "--num-requests", "6", "--input-len", "16",
        "--output-len", "6", "--timeout", "60", "--no-progress",
    )  # fmt: skip
    assert_reconciled(report["counts"])
    assert report["counts"]["succeeded"] == 6, report["counts"]
    assert [r["output_tokens"] for r in report["requests"]] == [6] * 6  # counted from each chunk's token ids
    assert report["itl"]["count"] == 6 * 5
    assert report["settings"]["protocol"] == "openai" and report["settings"]["server"] == cluster.http_address
    assert "succeeded 6" in stdout


@pytest.mark.parametrize("protocol", ["grpc", "openai"])
def test_a_shared_prefix_is_served_from_the_prefix_cache_and_reported(cluster, tmp_path, protocol):
    # One request at a time: the 64-token prefix (4 full blocks of 16) is computed at most once per worker that
    # prefills (the first request on each; placement then prefers the holders), every other request finds it
    # cached. The engine reports what it reused, per request, through usage.cached_prompt_tokens.
    address = cluster.http_address if protocol == "openai" else cluster.address
    with Client(cluster.address) as client:
        workers = len(client.status().workers)
    n = 3 * workers
    report, stdout = run_bench(
        address, tmp_path / "prefix.json",
        "--protocol", protocol, "--concurrency", "1", "--num-requests", str(n), "--shared-prefix", "64",
        "--input-len", "8", "--output-len", "2", "--seed", "11", "--no-progress",
    )  # fmt: skip
    assert report["counts"]["succeeded"] == n, report["counts"]
    rows = report["requests"]
    assert all(r["input_len"] == 72 for r in rows)
    cached = [r["cached_tokens"] for r in rows]
    assert all(c is not None and 0 <= c <= 72 for c in cached), cached
    assert sum(c < 64 for c in cached) <= workers, cached
    use = report["prefix_cache"]
    assert use["prompt_tokens"] == n * 72 and use["cached_tokens"] == sum(cached)
    assert f"prefix cache: {sum(cached)}/{n * 72}" in stdout


def test_bad_flag_exits_2_naming_the_flag(cluster):
    proc = subprocess.run(
        [sys.executable, "-m", "tandem_cli.cli", "bench", "--server", cluster.address, "--rate", "1",
         "--input-len", "uniform:9:2"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "--input-len" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("pace", [("--rate", "6"), ("--concurrency", "3")], ids=["open-loop", "closed-loop"])
def test_several_client_processes_send_every_request_once_and_report_them_together(cluster, tmp_path, pace):
    report, _ = run_bench(
        cluster.address, tmp_path / "run.json",
        *pace, "--processes", "2", "--num-requests", "10", "--input-len", "12", "--output-len", "6", "--seed", "5",
    )  # fmt: skip
    counts = report["counts"]
    assert_reconciled(counts)
    assert counts["sent"] == counts["succeeded"] == 10, counts
    rows = report["requests"]
    assert sorted(r["index"] for r in rows) == list(range(10))  # each request from one process, once
    assert [r["output_tokens"] for r in rows] == [6] * 10
    assert report["settings"]["processes"] == 2
    if pace[0] == "--rate":  # each request leaves at its own arrival time, counted from its process's start
        sent = [r["sent_at"] for r in sorted(rows, key=lambda r: r["index"])]
        assert max(sent) < 10.0, sent  # 10 arrivals at 6/s: about 1.7 s


def test_a_warm_up_is_sent_first_and_not_counted(cluster, tmp_path):
    """--warm-up S: the same load for S seconds with other prompts, cancelled at its end, none of it in the
    report; the report's settings record it. A bad value or a trace is refused naming the flag."""
    out = tmp_path / "run.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tandem_cli.cli", "bench", "--server", cluster.address, "--json", str(out),
         "--concurrency", "2", "--num-requests", "6", "--input-len", "16", "--output-len", "8", "--seed", "7",
         "--warm-up", "2"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    warm = re.search(
        r"tandem: warm-up: (\d+) requests in 2 s \((\d+) finished, (\d+) cancelled\), not counted",
        proc.stderr,
    )
    assert warm is not None, proc.stderr[-2000:]
    assert int(warm[1]) >= 2 and int(warm[1]) == int(warm[2]) + int(warm[3])
    report = json.loads(out.read_text())
    assert report["settings"]["warm_up_s"] == 2.0
    assert report["counts"]["sent"] == report["counts"]["succeeded"] == 6  # only the measured run's requests
    wait_idle(cluster.address)  # the cancelled warm-up requests released their blocks
    trace = tmp_path / "trace.jsonl"
    trace.write_text(json.dumps({"input_len": 5, "output_len": 3}) + "\n")
    refused = {
        "--warm-up: must be": ["--warm-up", "-1"],
        "--warm-up: not with --trace": ["--warm-up", "1", "--trace", str(trace)],
    }
    for wanted, flags in refused.items():
        bad = subprocess.run(
            [sys.executable, "-m", "tandem_cli.cli", "bench", "--server", cluster.address, "--concurrency", "1", *flags],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert bad.returncode == 2 and wanted in bad.stderr and "Traceback" not in bad.stderr, bad.stderr[
            -1000:
        ]
