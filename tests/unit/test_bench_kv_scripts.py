"""The KV handoff benchmarks (bench/kv_transfer.py, bench/kv_sharded.py) and their process machinery
(bench/child_procs.py, bench/kv_common.py) on CPU: each script end to end in --smoke mode, checking the JSON it
writes; a failing child ends a run with its error and leaves no process behind; the landed blocks' self-check
refuses blocks that did not land. The GPU runs happen on the GPU machine; these keep the scripts correct."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from bench.child_procs import Child, Ready, expect_all, stop_all
from tests.unit.test_bench_gpu_scripts import smoke_script

pytestmark = pytest.mark.unit


def test_kv_transfer_smoke_moves_the_blocks_and_reports_send_to_landed(tmp_path):
    """bench/kv_transfer.py's driver on a CPU (two processes, tcp): every rep's landed blocks passed their
    checksum against the sent ones (the script stops otherwise), and each row has the three times with
    send->landed inside the handoff (it starts after the reservation's pipe hop)."""
    doc = smoke_script("kv_transfer.py", tmp_path / "kv.json")
    rows = doc["rows"]
    assert doc["complete"] and doc["raw"] == []  # no raw baselines on a CPU
    assert [(r["transport"], r["tokens"], r["checksum_ok"]) for r in rows] == [
        ("tcp", 16, True),
        ("tcp", 64, True),
    ]
    for row in rows:
        assert 0 < row["send_to_landed_s"] <= row["handoff_s"], row
        assert (
            row["bytes"] == -(-row["tokens"] // 16) * 32 * 2 * 16 * 8 * 128 * 2
        )  # Llama-3-8B: 128 KiB a token
        assert row["phases_s"]["receiver"] and row["phases_s"]["sender"]


def _processes_marked(mark: str) -> list[int]:
    """Live processes whose environment holds TANDEM_TEST_MARK=mark: a script started with it and every process
    it started (they inherit it). A zombie's environment reads empty."""
    needle, pids = f"TANDEM_TEST_MARK={mark}".encode(), []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours
            if needle in environ.read_bytes().split(b"\0"):
                pids.append(int(environ.parent.name))
    return pids


def test_kv_transfer_child_failure_ends_the_run_with_its_error(tmp_path):
    """The prefill process raises at its first handoff (the script's test hook) while the decode process waits
    for the landing: the driver stops at once with the prefill process's error (not after the decode side's
    30 s wait), exits non-zero, leaves no process behind, and its JSON says the run is not complete."""
    script = Path(__file__).resolve().parents[2] / "bench" / "kv_transfer.py"
    out, mark = tmp_path / "kv.json", uuid.uuid4().hex
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(script), "--smoke", "--out", str(out), "--inject-prefill-fault"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TANDEM_TEST_MARK": mark},
    )
    assert done.returncode != 0 and time.monotonic() - started < 25, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]  # the driver's own exception, carrying the child's
    assert "injected fault (--inject-prefill-fault)" in last, done.stderr[-3000:]
    assert "RuntimeError: prefill process: Traceback" in done.stderr  # raised by the driver
    doc = json.loads(out.read_text())
    assert not doc["complete"] and doc["rows"] == []
    deadline = time.monotonic() + 10  # multiprocessing's resource tracker leaves once the script has gone
    while (left := _processes_marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == [], f"processes left running: {left}"


def test_child_procs_report_a_failing_child_at_once_and_stop_all_kills_a_hung_one():
    """bench/child_procs.py on a CPU, builtins as the roles: one child raises while it builds (int("not a
    number")) while another hangs (time.sleep): the wait on both raises at once with the failing child's name
    and traceback, not after its timeout; a wait on the hung one alone names it as still running; stop_all
    kills it (and only it), and is safe to call again."""
    hung, bad = Child("hung child", time.sleep, 60), Child("bad child", int, "not a number")
    try:
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"(?s)^bad child: Traceback.*ValueError: invalid literal"):
            expect_all([hung, bad], Ready, 30)
        assert time.monotonic() - started < 10
        with pytest.raises(TimeoutError, match=r"no Ready within 0 s from hung child \(still running\)"):
            hung.expect(Ready, 0.3)
    finally:
        killed = stop_all([hung, bad], 0.2)
    assert killed == ["hung child"] and hung.proc.exitcode == -signal.SIGKILL and bad.proc.exitcode == 1
    assert stop_all([hung, bad], 0.2) == []


def test_child_procs_name_a_child_that_exits_silently_and_put_the_earliest_failure_first():
    """Two children that failed one after the other, waited on latest first: the error lists the earlier
    (the cause) first. A child that exits without a reply (os._exit(3)) is named with its exit code."""
    children = []
    try:
        for name, role, arg in (
            ("first child", int, "x"),
            ("second child", int, "y"),
            ("dead child", os._exit, 3),
        ):
            children.append(Child(name, role, arg))
            children[-1].proc.join(10)  # each one done before the next starts: their failures are ordered
        first, second, dead = children
        with pytest.raises(RuntimeError) as failed:
            expect_all([second, first], Ready, 5)
        text = str(failed.value)
        assert 0 <= text.index("first child: Traceback") < text.index("second child: Traceback"), text
        with pytest.raises(RuntimeError, match=r"^dead child exited without a reply \(exit code 3\)$"):
            dead.expect(Ready, 5)
    finally:
        left = stop_all(children, 1.0)
    assert left == []  # all had exited


def test_kv_transfer_self_check_refuses_blocks_that_did_not_land():
    """The decode process's check after each rep: landed blocks match the source checksum and are zeroed, so
    the next rep's lease on the same ids (the free list hands them out again) fails if nothing landed."""
    from bench import kv_common

    gen = torch.Generator().manual_seed(0)
    source = torch.randn(2, 2, 12, 4, 2, 8, generator=gen).to(torch.bfloat16)  # [L, K|V, blocks, B, H, D]
    cache = torch.zeros_like(source)
    src, ids = [5, 9, 2], [7, 3, 11]
    expected = kv_common.kv_checksum(source, src)
    cache[:, :, ids] = source[:, :, src]
    kv_common.check_landed(cache, ids, expected, "rep 0")
    assert not cache.any()  # zeroed for the next rep
    with pytest.raises(RuntimeError, match="CHECKSUM MISMATCH: rep 1"):
        kv_common.check_landed(cache, ids, expected, "rep 1")  # nothing landed this time
    cache[:, :, ids] = source[:, :, src]
    cache[1, 0, ids[1], 3, 1, 7] += 1
    with pytest.raises(RuntimeError, match="CHECKSUM MISMATCH: rep 2"):
        kv_common.check_landed(cache, ids, expected, "rep 2")  # one element off


def test_kv_sharded_smoke_lands_every_rank_its_heads(tmp_path):
    """bench/kv_sharded.py's driver on a CPU (one process per rank, tcp): prefill TP=2 -> decode TP=1 and
    TP=1 -> TP=2 next to the equal layout 1x1. Every rep's landed blocks passed their checksum against the
    whole model's data (a decode rank stops the script otherwise), each decode rank got exactly its share of
    the heads, and the percentages compare against the 1x1 row of the same size."""
    doc = smoke_script("kv_sharded.py", tmp_path / "sharded.json")
    assert doc["complete"] and doc["skipped"] == [] and doc["raw"] == []  # no raw NCCL baseline on a CPU
    rows = {(r["layout"], r["tokens"]): r for r in doc["rows"]}
    assert list(rows) == [(layout, tokens) for layout in ("1x1", "2x1", "1x2") for tokens in (16, 64)]
    for (layout, tokens), row in rows.items():
        decode_tp = int(layout.split("x")[1])
        # a block: 4 layers x K, V x 4 tokens x 4 heads x head dim 8 x 2 bytes = 2048
        whole = -(-tokens // 4) * 2048
        assert row["checksum_ok"] and row["bytes"] == whole, row
        assert row["decode_rank_bytes"] == [whole // decode_tp] * decode_tp, row
        assert row["handoff_s"] > 0 and row["handoff_gbps"] == pytest.approx(whole / row["handoff_s"] / 1e9)
        equal = rows["1x1", tokens]["handoff_gbps"]
        assert row["pct_of_1x1"] == pytest.approx(100 * row["handoff_gbps"] / equal), row
        assert row["pct_of_raw"] is None and row["phases_s"]["sender"] and row["phases_s"]["receiver"], row


def test_kv_sharded_self_check_refuses_one_wrong_element():
    """The check a decode rank runs after each landing: its blocks hold its heads of the prompt's source
    blocks (here decode rank 1 of 2, written by hand), and one changed element stops the run."""
    from bench import kv_sharded

    whole = kv_sharded.KVLayout(2, 4, 8, 4, 20, "bfloat16")
    rank = kv_sharded.DecodeRank(kv_sharded.RankSpec(whole, 2, 1, "cpu", "tcp", 5.0))
    try:
        src, ids = kv_sharded.source_ids(rank.layout, 10), [7, 3, 12]
        model = kv_sharded.rank_data(whole, whole, torch.device("cpu"))
        assert torch.equal(rank.expected, model[:, :, :, :, 2:4])  # rank 1 of 2 holds heads 2-3 of 4
        rank.cache[:, :, ids] = rank.expected[:, :, src]
        rank.check(ids, 10)
        assert not rank.cache[:, :, ids].any()  # zeroed for the next rep
        rank.cache[:, :, ids] = rank.expected[:, :, src]
        rank.cache[1, 1, ids[2], 0, 1, 5] += 1
        with pytest.raises(RuntimeError, match="CHECKSUM MISMATCH: decode rank 1 at 10 tokens"):
            rank.check(ids, 10)
    finally:
        rank.close()
