"""bench/disagg_vs_colocated.py's issue-20 additions: the multi-turn chat trace, the refined sweep near the knee,
the interactive SLO set judged from each request's (TTFT, TPOT), and the closed-loop batch case's summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.disagg_vs_colocated import ascending_sweep, refine_rates
from bench.dvc_summary import (
    INTERACTIVE,
    capacity_at,
    gpu_seconds_per_1k_tokens,
    rate_points,
    share_at,
    summarize_closed_loop,
)
from bench.dvc_tables import closed_loop_table
from bench.dvc_workloads import CHAT_IDS, CHAT_SESSIONS, CHAT_TURNS, WORKLOADS, chat_trace

pytestmark = pytest.mark.unit


def test_each_chat_turn_resends_its_conversation_so_far_behind_one_system_prompt(tmp_path: Path) -> None:
    workload = WORKLOADS["chat"]
    path = tmp_path / "chat.jsonl"
    count = CHAT_SESSIONS * (CHAT_TURNS + 2)
    chat_trace(path, count, seed=7, workload=workload)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == count
    system = lines[0]["prompt_token_ids"][: workload.shared_prefix]
    low, high = CHAT_IDS
    for n, line in enumerate(lines):
        ids = line["prompt_token_ids"]
        assert ids[: workload.shared_prefix] == system and all(low <= i < high for i in ids)
        assert 64 <= line["output_len"] <= 256
        turn = (n // CHAT_SESSIONS) % CHAT_TURNS
        if turn == 0:  # a conversation's first turn: the system prompt and one user message
            assert 64 <= len(ids) - workload.shared_prefix <= 256
        else:  # the previous turn's whole prompt, its reply's stand-in tokens, then a new message
            before = lines[n - CHAT_SESSIONS]
            grown = len(ids) - len(before["prompt_token_ids"]) - before["output_len"]
            assert ids[: len(before["prompt_token_ids"])] == before["prompt_token_ids"] and 64 <= grown <= 256
    again = tmp_path / "again.jsonl"
    chat_trace(again, count, seed=7, workload=workload)
    other = tmp_path / "other.jsonl"
    chat_trace(other, count, seed=8, workload=workload)
    assert again.read_text() == path.read_text() and other.read_text() != path.read_text()
    assert json.loads(other.read_text().splitlines()[0])["prompt_token_ids"][: len(system)] == system


def test_the_sweep_stops_after_two_misses_and_refines_between_the_last_met_and_the_first_miss() -> None:
    shares = {12: 1.0, 16: 0.95, 20: 0.8, 24: 0.85, 28: 0.2}
    ran: list[float] = []

    def run(rate: float) -> float | None:
        ran.append(rate)
        return shares[rate]

    assert ascending_sweep([12, 16, 20, 24, 28], run) == (16, 20) and ran == [12, 16, 20, 24]
    assert ascending_sweep([12, 16, 28, 20], run) == (16, 28)  # below half: stop at once
    assert ascending_sweep([12, 16], lambda r: None) == (None, None)  # the budget stopped it
    assert refine_rates(16, 20, 1) == (17, 18, 19) and refine_rates(4, 6, 0.5) == (4.5, 5, 5.5)
    assert refine_rates(20, 21, 1) == ()


def _point(rate: float, sent: int, samples: list, tokens: float = 1000.0) -> dict:
    return {"settings": {"rate": rate}, "counts": {"sent": sent}, "slo_samples": samples,
            "goodput": {"share": 1.0}, "output_token_throughput": tokens}  # fmt: skip


def test_another_slo_set_is_judged_from_each_requests_ttft_and_tpot() -> None:
    fast, slow_tpot, slow_ttft = [0.2, 0.01, 3.0], [0.2, 0.04, 9.0], [0.8, 0.01, 3.0]
    points = [
        _point(4, 10, [fast] * 10),
        _point(6, 10, [fast] * 9 + [[0.3, None, 0.3]]),  # one output token: judged on TTFT alone
        _point(8, 10, [fast] * 8 + [slow_tpot, slow_ttft]),
        _point(10, 10, [fast] * 10),  # past a miss: not a capacity
    ]
    assert [share_at(p, INTERACTIVE) for p in points] == [1.0, 1.0, 0.8, 1.0]
    assert capacity_at(points, INTERACTIVE) == 6
    cancelled = _point(12, 10, [fast] * 9)  # one of ten sent never finished
    assert share_at(cancelled, INTERACTIVE) == 0.9
    assert capacity_at([{**points[0], "slo_samples": None}], INTERACTIVE) is None
    assert gpu_seconds_per_1k_tokens(points[0], gpus=4) == 4.0


def test_refined_rates_are_read_in_rate_order() -> None:
    run = {"points": [_point(r, 1, []) for r in (12, 16, 20, 13, 14)]}
    assert [p["settings"]["rate"] for p in rate_points(run)] == [12, 13, 14, 16, 20]


def test_the_batch_case_reports_its_worse_runs_output_tokens_per_second() -> None:
    def run_file(gpus: int, tokens: list[float]) -> dict:
        points = [{**_point(0, 200, []), "output_token_throughput": t, "ttft": {"p90": 1.0}, "tpot": {"p99": 0.05}}
                  for t in tokens]  # fmt: skip
        return {"gpus": gpus, "card": "H200", "workload_spec": {"concurrency": 200}, "points": points}

    out = summarize_closed_loop(
        "batch", {"colocated-4": run_file(4, [26_000, 25_000]), "disagg": run_file(2, [])}
    )
    row = out["colocated-4"]
    assert row["output_tokens_per_s"] == 25_000 and row["output_tokens_per_s_per_gpu"] == 6_250
    assert row["runs"] == 2 and "disagg" not in out
    assert row["every_run_output_tokens_per_s"] == [26_000, 25_000]  # in the order they ran
    assert "| 26,000 / 25,000 |" in closed_loop_table([out])
    assert row["full_batch_output_tokens_per_s"] is None  # these runs recorded no full-batch window
