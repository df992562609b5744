"""deploy.autoscaler.load: each pool's load over the window from the workers' readings (WorkerInfo as Admin.Status
lists it): prefill by busy share, decode and colocated by KV occupancy, projected onto one worker fewer."""

from __future__ import annotations

import pytest

from deploy.autoscaler.load import LoadTracker, PoolLoad
from model_runtime.roles import WorkerRole
from tandem_api.tandem.v1 import admin_pb2

pytestmark = pytest.mark.unit

P, D, C = WorkerRole.PREFILL, WorkerRole.DECODE, WorkerRole.COLOCATED
READY, STARTING = admin_pb2.WORKER_STATE_READY, admin_pb2.WORKER_STATE_STARTING


def info(wid: str, role: WorkerRole, busy: float = 0.0, used: int = 0, total: int = 100, state=READY):
    return admin_pb2.WorkerInfo(
        worker_id=wid, role=role.wire, state=state, busy_seconds_total=busy, kv_blocks_used=used,
        kv_blocks_total=total,
    )  # fmt: skip


class Workers:
    def __init__(self) -> None:
        self.now: list[admin_pb2.WorkerInfo] = []

    def __call__(self) -> list[admin_pb2.WorkerInfo]:
        return self.now


def test_busy_share_is_the_busy_seconds_gained_over_the_window_per_worker() -> None:
    workers = Workers()
    tracker = LoadTracker(workers)
    workers.now = [info("p0", P, busy=100.0), info("p1", P, busy=50.0), info("d0", D, used=10)]
    tracker.read(0.0)
    workers.now = [info("p0", P, busy=104.0), info("p1", P, busy=52.0), info("d0", D, used=30)]
    tracker.read(5.0)
    workers.now = [info("p0", P, busy=108.0), info("p1", P, busy=54.0), info("d0", D, used=20)]
    tracker.read(10.0)
    loads = tracker.loads(10.0)
    assert loads[P].busy_share == pytest.approx((0.8 + 0.4) / 2) and loads[P].workers == 2
    assert loads[D].kv_occupancy == pytest.approx(0.3)  # the peak in the window, not the last reading
    assert loads[P].load == loads[P].busy_share and loads[D].load == loads[D].kv_occupancy
    assert loads[P].projected(1) == pytest.approx(1.2)
    # A shorter window sees the last two readings only.
    assert tracker.loads(5.0)[D].kv_occupancy == pytest.approx(0.3)
    assert tracker.loads(4.0)[P].busy_share is None  # one reading: no elapsed time, no share


def test_workers_that_are_not_ready_or_report_no_busy_time_are_left_out() -> None:
    workers = Workers()
    tracker = LoadTracker(workers)
    workers.now = [info("p0", P, busy=10.0), info("p1", P, busy=0.0), info("p2", P, busy=5.0, state=STARTING)]
    tracker.read(0.0)
    workers.now = [info("p0", P, busy=12.0), info("p1", P, busy=0.0), info("p2", P, busy=9.0, state=STARTING)]
    tracker.read(4.0)
    load = tracker.loads(10.0)[P]
    assert load.workers == 2 and load.busy_share == pytest.approx(0.5)  # p0 only: p1 gave no reading
    workers.now = [info("p0", P, busy=1.0), info("p1", P, busy=3.0)]  # p0 restarted under the same id
    tracker.read(8.0)
    assert tracker.loads(10.0)[P].busy_share is None  # p1 has no earlier reading, p0 counts from zero again


def test_a_worker_that_joined_within_the_window_does_not_count_until_it_spans_it() -> None:
    workers = Workers()
    tracker = LoadTracker(workers)
    workers.now = [info("p0", P, busy=1.0)]
    tracker.read(0.0)
    workers.now = [info("p0", P, busy=3.0), info("p1", P, busy=0.5)]
    tracker.read(4.0)
    load = tracker.loads(10.0)[P]
    assert load.workers == 2 and load.busy_share == pytest.approx(0.5)
    assert load.projected(1) == pytest.approx(1.0)


def test_no_readings_no_load() -> None:
    tracker = LoadTracker(Workers())
    assert tracker.loads(10.0) == {}
    tracker.read(0.0)
    assert tracker.loads(10.0) == {}
    assert PoolLoad(C, 2).projected(1) is None and PoolLoad(C, 0, kv_occupancy=0.5).projected(1) is None
    assert PoolLoad(C, 2, kv_occupancy=0.3).projected(1) == pytest.approx(0.6)
