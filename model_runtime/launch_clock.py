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
    clock.running(start, batch, decode_only, idle)
                                              the step launched began on the GPU at `start` (host clock); idle:
                                              the step before it had ended when it was launched
    clock.done(gpu_s)                         the in-flight step's tokens are on the host; its GPU time
                                              (CUDA events around it), or None when it was not timed
    clock.launch_at()                         perf_counter time to schedule the next step, or None: at once

Step times come from CUDA events, not from when the host saw the tokens: a launch held back too long delays
the host's wait as well, and timing steps by it would grow each estimate by the lateness it caused. A launch
the clock held back that still found the GPU idle (`misses`) widens the margin a little, an on-time one narrows
it back, within [margin_s, MAX_MARGIN_S].

Only decode-only steps are timed and waited for: their GPU time is steady for a batch size (bucketed by powers of
two), while a step with prompt chunks varies with them. A wrong estimate costs little in one direction (too short:
the step launches early, as without the clock) and a bubble in the other (too long: the GPU idles until the
launch), so the estimate is each bucket's recent minimum-weighted average and the lead is generous.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from model_runtime.config import LATE_LAUNCH_MARGIN_S, LATE_LAUNCH_MAX_MARGIN_S

# lead beyond the host's own launch time: the loop's wake-up and the interpreter lock (scheduler.late_launch_margin_s)
MARGIN_S = LATE_LAUNCH_MARGIN_S
MAX_MARGIN_S = LATE_LAUNCH_MAX_MARGIN_S
MISS_STEP_S = 0.0005  # margin added by a held launch that found the GPU idle
HOST_WEIGHT = 1.5  # the host's recent launch time, times this, is part of the lead
EMA = 0.3  # weight of a new measurement in the running averages


@dataclass
class LaunchClock:
    margin_s: float = MARGIN_S
    misses: int = 0  # launches held back that found the GPU idle all the same
    held: int = 0  # launches for which launch_at gave a time (the loop may still have been late for it)
    _extra_s: float = 0.0  # margin learnt from misses
    _gpu_s: dict[int, float] = field(default_factory=dict)  # batch bucket -> decode step's GPU time (average)
    _host_s: float = 0.0  # step()'s host time from its start to the next launch (average)
    _start: float | None = None  # when the in-flight step began on the GPU
    _bucket: int | None = None  # its batch bucket; None: not a decode-only step (not timed, not waited for)
    _advised = False  # launch_at gave a time for the step about to be launched

    def launched(self, host_s: float) -> None:
        self._host_s = host_s if self._host_s == 0.0 else self._host_s + EMA * (host_s - self._host_s)

    def running(self, start: float, batch: int, decode_only: bool, idle: bool = False) -> None:
        if self._advised:
            self.held += 1
            if idle:
                self.misses += 1
                self._extra_s = min(MAX_MARGIN_S - self.margin_s, self._extra_s + MISS_STEP_S)
            else:
                self._extra_s *= 0.97
        self._advised = False
        self._start = start
        self._bucket = _bucket(batch) if decode_only and batch > 0 else None

    def done(self, gpu_s: float | None) -> None:
        if gpu_s is not None and self._bucket is not None:
            old = self._gpu_s.get(self._bucket)
            # Faster steps count fully, slower ones at the average's weight: a stall (a collection, another
            # process on the GPU) should not stretch the next waits into bubbles.
            self._gpu_s[self._bucket] = gpu_s if old is None or gpu_s < old else old + EMA * (gpu_s - old)
        self._start = None
        self._bucket = None

    def launch_at(self) -> float | None:
        if self._start is None or self._bucket is None:
            return None
        gpu_s = self._gpu_s.get(self._bucket)
        if gpu_s is None:
            return None
        lead = HOST_WEIGHT * self._host_s + self.margin_s + self._extra_s
        if gpu_s <= lead:
            return None
        self._advised = True
        return self._start + gpu_s - lead


def _bucket(batch: int) -> int:
    return 1 << math.ceil(math.log2(batch))
