"""tandem_cli.bench.processes: how one benchmark's requests are shared among client processes, and the records
crossing back as JSON lines (no pickle between the processes)."""

from __future__ import annotations

import pytest

from tandem_cli.bench.loadgen import Outcome, Pacing, RequestRecord
from tandem_cli.bench.processes import record_from_json, record_to_json, shares
from tandem_cli.bench.stats import Timeline
from tandem_cli.bench.workload import BenchConfigError, RequestSpec

pytestmark = pytest.mark.unit


def specs(n: int) -> list[RequestSpec]:
    return [RequestSpec(i, (5, 6, i), 4) for i in range(n)]


def test_open_loop_shares_keep_each_requests_own_arrival_time() -> None:
    arrivals = tuple(0.1 * i for i in range(7))
    parts = shares(specs(7), Pacing(arrivals=arrivals), 3)
    assert [[s.index for s in mine] for mine, _ in parts] == [[0, 3, 6], [1, 4], [2, 5]]
    for mine, pacing in parts:
        assert pacing.arrivals == tuple(arrivals[s.index] for s in mine)


def test_closed_loop_shares_split_the_concurrency_and_never_outnumber_it() -> None:
    parts = shares(specs(10), Pacing(concurrency=5), 2)
    assert [p.concurrency for _, p in parts] == [3, 2]
    assert sorted(s.index for mine, _ in parts for s in mine) == list(range(10))
    assert len(shares(specs(10), Pacing(concurrency=2), 4)) == 2  # 2 in flight: 2 processes at most
    assert len(shares(specs(2), Pacing(arrivals=(0.0, 0.5)), 4)) == 2  # shares without requests are left out
    with pytest.raises(BenchConfigError, match="--processes"):
        shares(specs(2), Pacing(concurrency=1), 0)


def test_a_record_survives_its_json_line() -> None:
    records = [
        RequestRecord(3, 12, 6, 0.25, Timeline(((0.01, 1), (0.02, 5)), 0.03), Outcome.SUCCEEDED, None, 4),
        RequestRecord(4, 12, 6, 0.5, Timeline((), 0.7), Outcome.FAILED, "DEADLINE_EXCEEDED", None),
    ]
    assert [record_from_json(record_to_json(r)) for r in records] == records


def test_an_open_loop_behind_its_schedule_sends_nothing_past_the_duration_bound() -> None:
    """The open loop stops at the duration bound by the clock too: a loop that fell 5 s behind a 2 s schedule
    (a busy machine) sends none of its late requests, and one on time sends those due before the bound (1.5 s
    of slack for a loaded test machine)."""
    import asyncio
    import time

    from tandem_cli.bench.loadgen import RunLimits, _open_loop

    class Counting:  # the recorder's part the loop uses: run(spec) as a task
        def __init__(self) -> None:
            self.sent: list[int] = []

        async def run(self, spec: RequestSpec) -> int:
            self.sent.append(spec.index)
            return spec.index

    specs = [RequestSpec(i, (1, 2), 2) for i in range(3)]

    async def send(behind_s: float) -> list[int]:
        recorder = Counting()
        start = time.perf_counter() - behind_s
        tasks = await _open_loop(recorder, specs, [0.0, 0.05, 0.5], RunLimits(duration_s=2.0), start)  # type: ignore[arg-type]
        await asyncio.gather(*tasks)
        return recorder.sent

    assert asyncio.run(send(5.0)) == []
    assert asyncio.run(send(0.0)) == [0, 1, 2]
