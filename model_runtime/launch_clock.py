"""When a step-ahead engine in a serving loop should schedule its next step: shortly before the running one ends,
not as soon as it starts.

A step-ahead engine (model_runtime.step_ahead) schedules and launches step N+1 right after step N starts on the
GPU. A request that arrives while N runs (a new prompt, or a decode worker's landed KV) then misses N+1, already
scheduled, and joins N+2: it waits for the rest of N and all of N+1 before its own step, one step more than in a
synchronous engine. On 2x H200 (docs/performance.md, "Decode workers scheduling ahead: the second token") that
step was most of the distance between a client's first and second token.

Scheduled late instead, at the in-flight step's expected end less the host's time to schedule and launch (and a
margin), N+1 takes what arrived while N ran, and the GPU still finds N+1 queued when N ends. The EngineLoop waits
for that moment with its inbox open (arrivals and aborts run meanwhile); an offline run (LLM.generate) does not
wait. What it needs to know:

    clock.launched(host_s)                    step() spent host_s from its start to the next step's launch
    clock.running(now, batch, decode_only)    the step just launched (or now in flight) began on the GPU at now
    clock.done(now)                           the in-flight step's tokens reached the host at now
    clock.launch_at()                         perf_counter time to schedule the next step, or None: at once

Only decode-only steps are timed and waited for: their GPU time is steady for a batch size (bucketed by powers of
two), while a step with prompt chunks varies with them. A wrong estimate costs little in one direction (too short:
the step launches early, as without the clock) and a bubble in the other (too long: the GPU idles until the
launch), so the estimate is each bucket's recent minimum-weighted average and the lead is generous.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MARGIN_S = 0.0015  # lead beyond the host's own launch time: the loop's wake-up and the interpreter lock
HOST_WEIGHT = 1.5  # the host's recent launch time, times this, is part of the lead
EMA = 0.3  # weight of a new measurement in the running averages


@dataclass
class LaunchClock:
    margin_s: float = MARGIN_S
    _gpu_s: dict[int, float] = field(default_factory=dict)  # batch bucket -> decode step's GPU time (average)
    _host_s: float = 0.0  # step()'s host time from its start to the next launch (average)
    _start: float | None = None  # when the in-flight step began on the GPU
    _bucket: int | None = None  # its batch bucket; None: not a decode-only step (not timed, not waited for)

    def launched(self, host_s: float) -> None:
        self._host_s = host_s if self._host_s == 0.0 else self._host_s + EMA * (host_s - self._host_s)

    def running(self, now: float, batch: int, decode_only: bool) -> None:
        self._start = now
        self._bucket = _bucket(batch) if decode_only and batch > 0 else None

    def done(self, now: float) -> None:
        if self._start is not None and self._bucket is not None:
            took = now - self._start
            old = self._gpu_s.get(self._bucket)
            # Faster steps count fully, slower ones at the average's weight: a stall (a collection, another
            # process on the GPU) should not stretch the next waits into bubbles.
            self._gpu_s[self._bucket] = took if old is None or took < old else old + EMA * (took - old)
        self._start = None
        self._bucket = None

    def launch_at(self) -> float | None:
        if self._start is None or self._bucket is None:
            return None
        gpu_s = self._gpu_s.get(self._bucket)
        if gpu_s is None:
            return None
        lead = HOST_WEIGHT * self._host_s + self.margin_s
        if gpu_s <= lead:
            return None
        return self._start + gpu_s - lead


def _bucket(batch: int) -> int:
    return 1 << math.ceil(math.log2(batch))
