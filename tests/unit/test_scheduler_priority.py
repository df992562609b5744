"""Priority classes in the engine's scheduler (real Scheduler, BlockPool and Requests; a fake model that samples
one fixed token): waiting interactive prompts are admitted before waiting batch ones, FIFO within a class, a
running batch request is never preempted for an interactive one, a batch prompt older than batch_max_wait_s takes
its turn by arrival, and landed KV waiting for a decode slot follows the same order. Also the worker's mapping of
the wire's PriorityClass (unset = interactive, as before classes existed)."""

from __future__ import annotations

import pytest

from model_runtime.block_pool import BlockPool
from model_runtime.config import ConfigError, SchedulerConfig
from model_runtime.request import Priority, Request, RequestStatus, SamplingParams, SchedulerOutput
from model_runtime.scheduler import Scheduler
from tandem_api.tandem.v1 import worker_pb2
from tests.fake_clock import ManualClock
from worker_host.convert import priority_from_proto

pytestmark = pytest.mark.unit

BS = 4
INT, BAT = Priority.INTERACTIVE, Priority.BATCH


def make(clock: ManualClock, seqs: int = 1, budget: int = 64, max_wait_s: float = 30.0) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, batch_max_wait_s=max_wait_s)
    return Scheduler(cfg, BlockPool(64, BS, True), BS, 256, clock=clock)


def req(rid: str, priority: Priority, arrival: float, prompt: int = 5, max_tokens: int = 2) -> Request:
    tokens = [hash(rid) % 1000 + i for i in range(prompt)]  # distinct prompts: no prefix hits between them
    sampling = SamplingParams(max_tokens=max_tokens)
    return Request(rid, tokens, sampling, arrival_time=arrival, priority=priority)


def step(s: Scheduler) -> SchedulerOutput:
    """One engine step with a fake model: every sampled chunk gets token 7; finish at the length cap."""
    out = s.schedule()
    s.advance(out)
    for chunk in out.chunks:
        if chunk.sample and s.get(chunk.request.request_id) is chunk.request:
            s.append_token(chunk.request, 7)
            if chunk.request.num_tokens == s.token_cap(chunk.request):
                s.finish(chunk.request, RequestStatus.FINISHED_LENGTH)
    return out


def admission_order(s: Scheduler, steps: int = 40) -> list[str]:
    """Request ids in the order their first chunk ran."""
    seen: list[str] = []
    for _ in range(steps):
        for chunk in step(s).chunks:
            if chunk.request.request_id not in seen:
                seen.append(chunk.request.request_id)
    return seen


def test_waiting_interactive_prompts_go_before_earlier_batch_ones_fifo_within_each_class() -> None:
    clock = ManualClock()
    s = make(clock)  # one sequence slot: admission order is the whole story
    for i, (rid, priority) in enumerate(
        [("b1", BAT), ("i1", INT), ("b2", BAT), ("i2", INT), ("i3", INT), ("b3", BAT)]
    ):
        s.add(req(rid, priority, arrival=clock.now + i * 0.001))
    assert s.num_waiting == 6
    assert admission_order(s) == ["i1", "i2", "i3", "b1", "b2", "b3"]
    assert not s.has_unfinished()


def test_without_classes_admission_stays_first_come_first_served() -> None:
    clock = ManualClock()
    s = make(clock)
    for i, rid in enumerate(["a", "b", "c", "d"]):
        s.add(req(rid, INT, arrival=clock.now + i))
    assert admission_order(s) == ["a", "b", "c", "d"]


def test_a_running_batch_request_is_not_preempted_for_an_arriving_interactive_one() -> None:
    clock = ManualClock()
    s = make(clock, seqs=1)
    s.add(batch := req("b", BAT, clock.now, max_tokens=4))
    assert [c.request.request_id for c in step(s).chunks] == ["b"]
    s.add(inter := req("i", INT, clock.now))
    while not batch.is_finished:  # the batch request keeps its slot until it ends
        out = step(s)
        assert [c.request.request_id for c in out.chunks] == ["b"] and not out.preempted
        assert inter.status is RequestStatus.WAITING
    assert batch.num_preemptions == 0
    assert [c.request.request_id for c in step(s).chunks] == ["i"]


def test_interactive_prompts_fill_a_step_first_and_batch_takes_the_budget_left() -> None:
    clock = ManualClock()
    s = make(clock, seqs=8, budget=12)
    s.add(req("b1", BAT, clock.now, prompt=8))
    s.add(req("i1", INT, clock.now + 1, prompt=8))
    out = s.schedule()
    # i1 first (8 tokens), then b1 gets the 4 tokens left as the first chunk of its prompt
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("i1", 8), ("b1", 4)]


def test_a_batch_prompt_older_than_the_age_bound_takes_its_turn_by_arrival() -> None:
    clock = ManualClock()
    s = make(clock, max_wait_s=10.0)
    s.add(req("i0", INT, clock.now - 1))  # arrived before b1: still goes first
    s.add(req("b1", BAT, clock.now))
    s.add(req("b2", BAT, clock.now + 1))
    order: list[str] = []
    # steady interactive load: a new interactive prompt arrives every step, so one always waits
    for i in range(60):
        clock.now += 0.5
        s.add(req(f"i{i + 1}", INT, clock.now))
        for chunk in step(s).chunks:
            if chunk.request.request_id not in order:
                order.append(chunk.request.request_id)
    assert order[0] == "i0"
    b1, b2 = order.index("b1"), order.index("b2")
    # b1 waited until it was 10 s old, then went before every interactive prompt that arrived after it
    # (one admission every 2 steps of 0.5 s: i0 .. i9 went first, then b1 at 10.5 s of age)
    assert order[:b1] == [f"i{i}" for i in range(10)], order[: b1 + 1]
    assert b1 < b2 < len(order)  # b2 too, in its turn: batch is delayed, never starved


def test_batch_max_wait_zero_is_plain_arrival_order() -> None:
    clock = ManualClock()
    s = make(clock, max_wait_s=0.0)
    for i, (rid, priority) in enumerate([("b1", BAT), ("i1", INT), ("b2", BAT), ("i2", INT)]):
        s.add(req(rid, priority, arrival=clock.now + i))
    clock.now += 10
    assert admission_order(s) == ["b1", "i1", "b2", "i2"]


def test_landed_kv_waiting_for_a_decode_slot_goes_interactive_first() -> None:
    clock = ManualClock()
    s = make(clock, seqs=1)
    s.add(holder := req("h", INT, clock.now, max_tokens=3))
    step(s)  # h holds the only slot
    landed = []
    for i, (rid, priority) in enumerate([("b", BAT), ("i", INT)]):
        r = req(rid, priority, clock.now + i, prompt=6, max_tokens=3)
        r.status = RequestStatus.WAITING_FOR_KV
        r.block_ids = s.pool.allocate(2)
        r.output_token_ids = [9]
        r.num_computed_tokens = 6
        s.add_running(r)
        landed.append(r)
    order = admission_order(s)
    assert holder.is_finished and order == ["h", "i", "b"]


def test_an_aborted_waiting_request_leaves_its_class_queue() -> None:
    clock = ManualClock()
    s = make(clock)
    s.add(req("b1", BAT, clock.now))
    s.add(req("i1", INT, clock.now))
    s.add(req("i2", INT, clock.now))
    s.abort("i1")
    s.abort("b1")
    assert s.num_waiting == 1
    assert admission_order(s) == ["i2"]


def test_batch_max_wait_is_validated() -> None:
    with pytest.raises(ConfigError, match=r"scheduler\.batch_max_wait_s"):
        SchedulerConfig(batch_max_wait_s=-1.0)
    with pytest.raises(ConfigError, match=r"scheduler\.batch_max_wait_s"):
        SchedulerConfig(batch_max_wait_s=float("inf"))


def test_the_wire_class_maps_unset_to_interactive() -> None:
    assert priority_from_proto(worker_pb2.PRIORITY_CLASS_NORMAL) is INT
    assert priority_from_proto(worker_pb2.PRIORITY_CLASS_INTERACTIVE) is INT
    assert priority_from_proto(worker_pb2.PRIORITY_CLASS_BATCH) is BAT
    assert priority_from_proto(99) is INT  # a class this worker does not know yet
    assert worker_pb2.PrefillRequest().priority == worker_pb2.PRIORITY_CLASS_NORMAL
    assert worker_pb2.DecodeRequest().priority == worker_pb2.PRIORITY_CLASS_NORMAL
