"""An engine's start-up reports where it is: weights loaded in 10% steps ending at 100%, then the KV cache.
A worker's stage follows it, and its actor answers with it (what `tandem serve` shows while workers load)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from deploy.actors import WorkerProcess
from model_runtime.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from model_runtime.engine import Engine
from model_runtime.startup import StartupProgress
from tests.model.tiny_models import write_tiny_gguf, write_tiny_hf
from worker_host.spec import WorkerSpec

pytestmark = pytest.mark.unit

LOADING = re.compile(r"loading weights: (\d+)% \(([\d.]+) of ([\d.]+) GiB\)")


def test_weight_progress_comes_in_ten_percent_steps_and_ends_at_one_hundred() -> None:
    lines: list[str] = []
    progress = StartupProgress(lines.append)
    total = 1000
    for done in range(0, total + 1, 7):  # many small tensors: one line per 10% step, not per tensor
        progress.weights(done, total)
    progress.weights(total, total)
    percents = [int(LOADING.match(line).group(1)) for line in lines]  # type: ignore[union-attr]
    assert percents == list(range(0, 101, 10))


def test_graph_progress_is_throttled_and_silent_without_a_reporter() -> None:
    lines: list[str] = []
    progress = StartupProgress(lines.append)
    for done in range(1, 36):
        progress.graphs(done, 35)
    assert len(lines) <= 11 and lines[-1] == "capturing CUDA graphs: 35 of 35"
    StartupProgress(None).weights(1, 2)  # no reporter: nothing to call, nothing raised


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_an_engine_reports_its_load_from_start_to_the_kv_cache(tmp_path: Path, fmt: str) -> None:
    model = write_tiny_hf(tmp_path) if fmt == "hf" else write_tiny_gguf(tmp_path)
    lines: list[str] = []
    config = EngineConfig(
        model=str(model),
        cache=CacheConfig(block_size=4, num_blocks=32),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
        device=DeviceConfig(device="cpu"),
    )
    engine = Engine(config, on_progress=lines.append)
    assert lines[0].startswith("reading the model config") and lines[-1] == "sizing the KV cache"
    loads = [LOADING.match(line) for line in lines if line.startswith("loading weights")]
    percents = [int(m.group(1)) for m in loads if m]
    assert percents == sorted(percents) and percents[-1] == 100
    last = loads[-1]
    assert last is not None and last.group(2) == last.group(3)  # all of it, and the total is the model's
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    assert float(last.group(3)) == pytest.approx(weight_bytes / 2**30, abs=0.05)


def test_a_worker_actor_reports_its_stage_before_and_while_it_starts() -> None:
    from decode_worker.worker import DecodeWorker

    spec = WorkerSpec(worker_id="decode-0", role="decode", engine=EngineConfig())
    process = WorkerProcess(spec)
    assert process.startup_stage() == "importing the engine"
    worker = process.worker = DecodeWorker(spec)  # what start() does before it loads the engine
    assert process.startup_stage() == "starting"
    worker._progress("loading weights: 40% (0.1 of 0.2 GiB)")  # the engine's on_progress
    assert process.startup_stage() == "loading weights: 40% (0.1 of 0.2 GiB)"
