"""Timing an engine's steps in the GPU benchmarks: bench/offline_drive.py's load and its StepProbe (each launch
timed as the step its record came back with, the GPU's idle time, the spread of single steps), bench/host_step.py
(the host's work per step) and bench/diag/long_steps.py (what ran inside a long step), on the CPU with a tiny
model; the probe's GPU path with events on the CPU's clock."""

from __future__ import annotations

import json
import time

import pytest

from bench import offline_throughput, step_probe
from bench.harness import Deadline, RunDevice, build_engine, random_prompts
from model_runtime.config import SchedulerConfig
from model_runtime.request import SamplingParams
from model_runtime.sampler import Sampler

pytestmark = pytest.mark.unit


def test_drive_keeps_the_admission_limit_and_aborts_when_out_of_time(tiny_model):
    engine = build_engine(
        tiny_model, RunDevice.for_mode(smoke=True), SchedulerConfig(8, 64, max_model_len=64), 0.9
    )
    shape = offline_throughput.Shape(8, 4)
    prompts = random_prompts(5, 8, engine.model_config.vocab_size, seed=0)
    driven = offline_throughput.drive(engine, shape, prompts, 2, Deadline(60))
    counts, split, complete = driven.counts, driven.split, driven.complete
    assert driven.decode_profile is None and driven.prefill_profile is None  # not asked for
    assert complete and counts == [4] * 5
    assert split.peak_running == 2  # the engine allows 8; the driver keeps 2 in it
    assert split.prefill_steps >= 3 and split.decode_steps >= 3  # 3 admission waves, each decodes 3 steps
    assert "schedule" not in vars(engine.scheduler)  # the probe took its wrapper away
    assert "advance" not in vars(engine.scheduler) and "execute" not in vars(engine.runner)
    assert isinstance(engine.sampler, Sampler)  # and gave the sampler back
    # The decode steps' wall time split: the forward and sampler, and the host work before and after them.
    assert 0 < split.decode_gpu_s < split.decode_s and split.decode_schedule_s > 0 and split.decode_post_s > 0
    assert split.decode_gpu_s + split.decode_schedule_s + split.decode_post_s <= split.decode_s
    late = Deadline(budget_s=1e-6, grace_s=0.0)
    driven = offline_throughput.drive(engine, shape, prompts, 2, late)
    counts, complete = driven.counts, driven.complete
    assert not complete and sum(counts) < 20 and not engine.has_unfinished()  # stopped after a step, aborted


def test_drive_with_steps_scheduled_ahead_counts_every_token_and_does_not_split_the_overlapped_host_work(
    tiny_model,
):
    scheduler = SchedulerConfig(8, 64, max_model_len=64, async_scheduling=True)
    engine = build_engine(tiny_model, RunDevice.for_mode(smoke=True), scheduler, 0.9)
    prompts = random_prompts(5, 8, engine.model_config.vocab_size, seed=0)
    driven = offline_throughput.drive(engine, offline_throughput.Shape(8, 4), prompts, 2, Deadline(60))
    counts, split, complete = driven.counts, driven.split, driven.complete
    assert complete and counts == [4] * 5 and engine.steps_ahead > 0
    assert split.decode_steps >= 3 and split.decode_s > 0
    # Its host work ran while the step before it computed: nothing to split, and no wrapper left behind.
    assert split.decode_schedule_s == split.decode_post_s == 0.0
    assert "execute" not in vars(engine.runner) and isinstance(engine.sampler, Sampler)


class _ClockEvent:
    """torch.cuda.Event's timing calls on the CPU's clock: what the step probe's GPU path reads."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.at = 0.0

    def record(self) -> None:
        self.at = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _ClockEvent) -> float:
        return (end.at - self.at) * 1e3


@pytest.mark.parametrize("ahead", [False, True], ids=["synchronous", "ahead"])
def test_the_probe_times_each_launch_as_the_step_its_record_came_back_with(tiny_model, monkeypatch, ahead):
    """The GPU path, with events on the CPU's clock: every launch is queued and classified by the record of the
    step() that returns it (ahead, one step() later); each kind's GPU time is its own launches', and none is
    left over."""
    monkeypatch.setattr(step_probe.torch.cuda, "Event", _ClockEvent)
    scheduler = SchedulerConfig(8, 64, max_model_len=64, async_scheduling=ahead)
    engine = build_engine(tiny_model, RunDevice.for_mode(smoke=True), scheduler, 0.9)
    for i, prompt in enumerate(random_prompts(4, 8, engine.model_config.vocab_size, seed=0)):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    forward = engine.runner.model.forward

    def slow_prompts(input_ids, *args, **kwargs):  # the prompt step's launch lasts 1 s, a decode's far less
        if input_ids.numel() > 4:
            time.sleep(1.0)
        return forward(input_ids, *args, **kwargs)

    monkeypatch.setattr(engine.runner.model, "forward", slow_prompts)
    probe = step_probe.StepProbe(engine)
    probe._cuda = True  # the GPU path, on the CPU
    steps = []  # (the step's kind, whether it added GPU time): events complete at once here
    while engine.has_unfinished():
        before = probe.split.decode_gpu_s
        probe.step()
        kind = "prefill" if engine.last_step.num_prefill else "decode"
        steps.append((kind, probe.split.decode_gpu_s > before))
    probe.close()
    assert steps == [("prefill", False)] + [("decode", True)] * 4  # one prompt step, then 4 decode steps
    # The prompt step's own span, apart from the decodes': its 1 s, counted once (synchronous, within its wall).
    assert probe.split.prefill_timed_steps == 1 and probe.split.prefill_gpu_s >= 1.0
    assert ahead or probe.split.prefill_gpu_s <= probe.split.prefill_s
    # Each decode step's own launch, not the prompt's: a pairing off by one would count the 1 s. (The bound leaves
    # the four tiny decode launches room on a loaded box: at 0.2 s and 0.15 it failed there once.)
    assert probe.split.decode_steps == 4 and 0 < probe.split.decode_gpu_s < 1.0
    # Synchronous, a step's launch runs within its own step(); ahead (on the CPU, which runs a launch as it is
    # made) a decode step's launch ran inside the step() before it, so only the synchronous sums compare.
    assert ahead or probe.split.decode_gpu_s < probe.split.decode_s
    assert not probe._launches and not probe._timed  # every launch came back with its record and was read
    # The idle time before each decode launch: from the last launch's sampler to this launch's start. Synchronous,
    # that is the host's work between the steps (outputs, schedule, inputs); it never holds a launch itself.
    split = probe.split
    assert 0 <= split.decode_gpu_idle_s < split.decode_s + split.prefill_s - split.decode_gpu_s
    assert ahead or split.decode_gpu_idle_s > 0
    assert 0 < split.decode_wall_p50_s <= split.decode_wall_p90_s <= split.decode_wall_max_s <= split.decode_s


def test_the_probe_times_a_prompt_steps_inputs_landing_apart_from_its_launch(tiny_model, monkeypatch):
    """The inputs column: a prompt step whose host batch takes 0.5 s to build and send (after its first event is
    recorded, so the idle time before its launch cannot show it) counts those 0.5 s from the step before's
    sampler to its inputs on the device; the idle time stays below them."""
    monkeypatch.setattr(step_probe.torch.cuda, "Event", _ClockEvent)
    engine = build_engine(
        tiny_model, RunDevice.for_mode(smoke=True), SchedulerConfig(8, 64, max_model_len=64), 0.9
    )
    upload, slow = engine.runner._upload, []

    def slow_upload(batch):
        if slow:
            time.sleep(0.5)
        return upload(batch)

    setattr(engine.runner, "_upload", slow_upload)  # noqa: B010 (the probe wraps it; close() puts it back)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = random_prompts(2, 8, engine.model_config.vocab_size, seed=1)
    probe = step_probe.StepProbe(engine)
    probe._cuda = True  # the GPU path, on the CPU
    engine.add_request("first", prompts[0], greedy)
    probe.step()  # the first prompt step: no step before it, nothing to count
    engine.add_request("second", prompts[1], greedy)
    slow.append(True)
    probe.step()  # the second prompt beside the first's decode: a prompt step, its inputs 0.5 s late
    slow.clear()
    while engine.has_unfinished():
        probe.step()
    probe.close()
    split = probe.split
    assert split.prefill_steps == 2 and split.prefill_timed_steps == 2
    assert split.prefill_input_wait_s >= 0.5
    assert split.prefill_gpu_idle_s < 0.5 <= split.prefill_input_wait_s <= split.prefill_s
    assert vars(engine.runner)["_upload"] is slow_upload  # close() gave the runner its own wrapper back


def test_host_step_splits_each_decode_step_into_the_models_time_and_the_hosts(tmp_path):
    from bench import host_step

    out = tmp_path / "host.json"
    host_step.main(["--batches", "4,8", "--steps", "6", "--repeats", "1", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["ahead"]) for r in rows] == [(4, False), (4, True), (8, False), (8, True)]
    for r in rows:
        assert r["steps"] == 6 and r["model_ms"] > 0 and r["host_ms"] > 0
        assert r["wall_ms"] == pytest.approx(r["model_ms"] + r["host_ms"])
    with pytest.raises(SystemExit):
        host_step.main(["--modes", "later"])


def test_long_steps_times_each_step_and_puts_a_collection_in_the_step_it_ran_in(tiny_model, tmp_path):
    """bench/diag/long_steps.py's attribution: a full collection forced inside the third step shows in that
    step's row alone (its generation 2), and every step of the load has a row."""
    import gc

    from bench.diag import long_steps

    engine = build_engine(
        tiny_model, RunDevice.for_mode(smoke=True), SchedulerConfig(8, 64, max_model_len=64), 0.9
    )
    step, calls = engine.step, []

    def collecting_step():
        calls.append(None)
        if len(calls) == 3:
            gc.collect(2)
        return step()

    engine.step = collecting_step  # type: ignore[method-assign]
    shape = offline_throughput.Shape(8, 4)
    rows = long_steps.run(engine, shape, random_prompts(3, 8, engine.model_config.vocab_size, 0), 3, False)
    assert [r.index for r in rows] == list(range(len(calls)))  # every step ran something here
    assert rows[0].kind == "prefill" and [r.kind for r in rows[1:]] == ["decode"] * 3
    assert 2 in rows[2].gc_generations and rows[2].gc_ms > 0
    assert all(2 not in r.gc_generations for i, r in enumerate(rows) if i != 2)
    assert all(r.wall_ms > 0 and r.batch == 3 for r in rows)
    out = long_steps.main(["--smoke", "--top", "2", "--out", str(tmp_path / "steps.json")])
    doc = json.loads(out.read_text())
    assert doc["decode_median_ms"] > 0 and {s["kind"] for s in doc["steps"]} == {"prefill", "decode"}


def test_late_launch_times_every_request_of_each_phase_in_both_modes(tmp_path):
    """bench/late_launch.py's driver: arrivals through an EngineLoop, each request's first token and token rate,
    every output token counted (the run raises when one is missing). A CPU engine has no launch clock: nothing
    is held back, in either mode."""
    from bench import late_launch

    out = late_launch.main(["--smoke", "--out", str(tmp_path / "late.json")])
    doc = json.loads(out.read_text())
    phases = doc["phases"]
    assert [(p["mode"], p["kind"]) for p in phases] == [
        (mode, kind) for mode in late_launch.MODES for kind in ("closed", "open")
    ]
    assert all(p["output_tokens"] == p["requests"] * 4 and p["tokens_per_s"] > 0 for p in phases)
    assert all(0 < p["ttft_p50_ms"] <= p["ttft_p90_ms"] and p["tpot_p50_ms"] > 0 for p in phases)
    assert doc["late_launch_possible"] is False and all(p["launch_waits"] == 0 for p in phases)
