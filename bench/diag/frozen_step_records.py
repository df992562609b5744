"""What frozen per-sequence records cost the host's step: StepOutput and ScheduledChunk as slotted dataclasses
(as shipped) against frozen copies of them, swapped in and out of one engine in turn. CPU, about two minutes.

    PYTHONPATH=. python3 bench/diag/frozen_step_records.py [sync|ahead]

One of each is built per sequence per step; a frozen dataclass's __init__ sets every field through
object.__setattr__. Each round runs 20 decode steps of 512 sequences (bench/host_step.py's engine: a tiny model,
the host work per step = wall minus the model's forward and logits calls); the two variants alternate for 12
rounds, so the machine's drift hits both alike, and the fastest and the median round of each are printed.

Measured (2026-11-28, the 2-core CI box, torch 2.13 CPU), host ms per step, fastest / median round:
synchronous frozen 6.15 / 7.71, slotted 4.91 / 6.41; ahead frozen 6.22 / 7.46, slotted 5.30 / 6.48; a second
synchronous run frozen 4.81 / 5.48, slotted 3.91 / 4.51; a second ahead run frozen 5.13 / 6.89, slotted 4.52 /
5.58.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import model_runtime.engine as engine_module
import model_runtime.scheduler as scheduler_module
from bench import host_step
from bench.harness import RunDevice, smoke_model_dir

ROUNDS, STEPS, BATCH = 12, 20, 512


def frozen_copy(cls: type) -> type:
    """The same fields and defaults, as a frozen dataclass without slots (how both classes were before)."""
    fields = [
        (f.name, f.type, dataclasses.field(default=f.default))
        if f.default is not dataclasses.MISSING
        else (f.name, f.type)
        for f in dataclasses.fields(cls)
    ]
    return dataclasses.make_dataclass(f"Frozen{cls.__name__}", fields, frozen=True)


def swap(output_cls: type, chunk_cls: type) -> None:
    """The classes the engine's outputs and the scheduler's chunks are built from (module globals)."""
    setattr(engine_module, "StepOutput", output_cls)  # noqa: B010
    setattr(scheduler_module, "ScheduledChunk", chunk_cls)  # noqa: B010


def main() -> None:
    ahead = sys.argv[1:] == ["ahead"]
    torch.set_num_threads(1)
    shipped = (engine_module.StepOutput, scheduler_module.ScheduledChunk)
    variants = {"frozen": tuple(frozen_copy(c) for c in shipped), "slotted": shipped}
    engine = host_step.full_batch(
        smoke_model_dir(), BATCH, ahead, ROUNDS * STEPS * len(variants), RunDevice.for_mode(smoke=True)
    )
    clock = host_step.ModelClock(engine)
    host_ms: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for _ in range(ROUNDS):
            for name, (output_cls, chunk_cls) in variants.items():
                swap(output_cls, chunk_cls)
                clock.seconds, t0 = 0.0, time.perf_counter()
                for _ in range(STEPS):
                    engine.step()
                host_ms[name].append((time.perf_counter() - t0 - clock.seconds) / STEPS * 1e3)
    finally:
        swap(*shipped)
        clock.close()
    mode = "ahead" if ahead else "synchronous"
    for name, values in host_ms.items():
        values.sort()
        print(
            f"{mode} {name}: host {values[0]:.2f} ms per step fastest, {values[len(values) // 2]:.2f} median"
        )


if __name__ == "__main__":
    main()
