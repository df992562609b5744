"""Where a step's GPU time goes: the torch profiler around a callable, kernels grouped by name.

Used by bench/decode_step.py --profile on the graph-replayed decode step (CUDA graph kernels are reported one by
one by CUPTI), so a step that misses its floor names its expensive kernels and the launch gaps between them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile


@dataclass(frozen=True)
class KernelTime:
    name: str
    calls_per_step: float
    us_per_step: float
    share: float  # of the summed kernel time


@dataclass(frozen=True)
class StepProfile:
    step_us: float  # wall time per step (CUDA events are not used: profiler overhead included)
    kernel_us: float  # summed kernel time per step; step_us - kernel_us is idle GPU (launch gaps, host)
    kernels_per_step: float
    top: list[KernelTime]
    host_top: list[KernelTime] | None = None  # host ops by self CPU time per step (share of the step's wall)


def profile_step(fn: Callable[[], object], reps: int = 20, top: int = 15) -> StepProfile:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
    totals: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = totals.setdefault(_short(event.name), [0.0, 0.0])
            entry[0] += 1
            entry[1] += event.device_time_total
    kernel_us = sum(t for _, t in totals.values())
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]
    step_us = start.elapsed_time(end) * 1e3 / reps
    host = sorted(
        (a for a in prof.key_averages() if a.self_cpu_time_total > 0), key=lambda a: -a.self_cpu_time_total
    )[:top]
    return StepProfile(
        step_us=step_us,
        kernel_us=kernel_us / reps,
        kernels_per_step=sum(n for n, _ in totals.values()) / reps,
        top=[
            KernelTime(name, n / reps, t / reps, t / kernel_us if kernel_us else 0.0)
            for name, (n, t) in ranked
        ],
        host_top=[
            KernelTime(
                _short(a.key),
                a.count / reps,
                a.self_cpu_time_total / reps,
                a.self_cpu_time_total / reps / step_us,
            )
            for a in host
        ],
    )


def _short(name: str) -> str:
    return name if len(name) <= 90 else name[:87] + "..."


def print_profile(title: str, p: StepProfile) -> None:
    print(
        f"\n{title}: step {p.step_us:.0f} us, kernels {p.kernel_us:.0f} us ({p.kernels_per_step:.0f} per step)"
    )
    for k in p.top:
        print(f"  {k.us_per_step:8.1f} us {100 * k.share:5.1f}% x{k.calls_per_step:5.0f}  {k.name}")
    if p.host_top:
        print("  host, self CPU time per step (share of the step's wall time):")
        for k in p.host_top:
            print(f"  {k.us_per_step:8.1f} us {100 * k.share:5.1f}% x{k.calls_per_step:5.0f}  {k.name}")
