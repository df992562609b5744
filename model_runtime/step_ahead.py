"""Step-ahead scheduling (scheduler.async_scheduling): the next step is scheduled and launched while the current
one still runs on the GPU, so the host work around a step stops leaving the GPU idle.

    Engine.step() with a step N in flight:
        advance(N); a pending token for each request N samples; schedule N+1 (requests whose pending token is
        their last are held out); launch N+1, its pending input ids fed on the device from N's sampled ids
        wait for N's tokens (a copy to pinned memory, started at launch); resolve them; stop rules; N's outputs

In a worker's EngineLoop, "schedule N+1" waits until shortly before N is expected to end, so that requests that
arrived while N ran join N+1 (scheduler.late_launch, model_runtime.launch_clock); offline engines schedule it at
once.

A request that N's token finishes (a stop token) has one wasted row in N+1, whose token is dropped. In colocated
and offline engines its blocks go back to the pool at once: only the compute stream writes KV there, so the next
owner's writes come after N+1's. A decode worker's KV receiver writes landed blocks from its own streams, so
its engine (Engine(kv_receiver=True)) fences them instead (BlockPool.fence): a block freed while step N+1 may
run stays out of the free list until N+1's tokens have been waited for. Prefill workers (they hand their blocks
off after one token) and tensor-parallel ranks (they replay the lead's host inputs) keep the synchronous step.
The pending token never enters a prefix-cache hash (hashes cover computed tokens only, and it is resolved before
N+1 is advanced). Seeded sampling draws the same noise: the output index counts the pending token. Unseeded random
rows may draw differently from a synchronous engine, since N+1 may carry rows that N finished.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from model_runtime.launch_clock import MARGIN_S, LaunchClock
from model_runtime.prompt_scores import PromptScores
from model_runtime.request import PENDING_TOKEN, Request, ScheduledChunk, SchedulerOutput
from model_runtime.sampler import LogprobsTensors, PendingIds, SamplerOutput, TokenLogprobs, to_device
from model_runtime.step_record import StepRecord, first_tokens

if TYPE_CHECKING:
    from model_runtime.block_pool import BlockPool
    from model_runtime.engine import StepOutput
    from model_runtime.model_runner import ModelRunner
    from model_runtime.scheduler import Scheduler


@dataclass(frozen=True)
class TokenFeed:
    """Input ids the host does not have yet: input_ids[rows] = values (both on the step's device)."""

    rows: torch.Tensor  # int64: rows of the next step's input ids
    values: torch.Tensor  # int64: the previous step's sampled ids for those rows

    def apply(self, input_ids: torch.Tensor) -> None:
        input_ids.index_copy_(0, self.rows, self.values)


class SampledIds:
    """Host copies of a step's sampled ids (and logprobs, when asked), started at launch and waited for later.
    The ids go to two pinned buffers in turn, so that a step's copy never overwrites the ids of the step before
    it, which the host may still be reading. Nothing here waits on the stream: a `.tolist()` of a device tensor
    would wait for the step launched after it too."""

    def __init__(self, max_rows: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self._buffers = [torch.zeros(max(1, max_rows), dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._next = 0
        self._cuda = pin

    def start(self, result: SamplerOutput, timed: bool = False) -> HostCopy:
        """timed: `done` can end an elapsed_time (a launch clock times the step with it)."""
        sampled = result.sampled_token_ids
        if not self._cuda:
            return HostCopy(sampled, result.logprobs, None)
        ids = self._buffers[self._next][: sampled.shape[0]]
        self._next ^= 1
        ids.copy_(sampled, non_blocking=True)
        # small: [B] and [B, N]; pinned by torch's caching host allocator
        logprobs = None if result.logprobs is None else result.logprobs.to_host()
        done = torch.cuda.Event(enable_timing=timed)
        done.record()
        return HostCopy(ids, logprobs, done)


@dataclass(frozen=True)
class HostCopy:
    ids: torch.Tensor  # [B] int64 on the host
    logprobs: LogprobsTensors | None  # on the host
    done: torch.cuda.Event | None  # recorded after the copies (None on a CPU: nothing to wait for)

    def wait(self, num_logprobs: tuple[int | None, ...]) -> tuple[list[int], list[TokenLogprobs | None]]:
        if self.done is not None:
            self.done.synchronize()
        host = SamplerOutput(self.ids, self.logprobs, num_logprobs)
        return self.ids.tolist(), host.logprobs_lists()


@dataclass
class InFlight:
    """A launched step: what it ran, its sampler's output (device tensors) and the host copy of its results."""

    out: SchedulerOutput
    sampled: list[ScheduledChunk]  # the chunks that sample, in the sampler's row order
    result: SamplerOutput | None  # None when no chunk samples
    host: HostCopy | None
    planned: StepRecord
    seq: int = 0  # the engine's launch count at its launch: the tag of the blocks freed while it may run
    began: torch.cuda.Event | None = None  # timed, recorded before its forward (a launch clock's step time)
    # its prompt scores' host copies (model_runtime.prompt_scores) and the event recorded after them
    prompt: PromptScores | None = None
    prompt_done: torch.cuda.Event | None = None

    def store_prompt_scores(self) -> None:
        """Wait for the step's prompt scores (if it had any) and store them into their requests."""
        if self.prompt is None:
            return
        if self.prompt_done is not None:
            self.prompt_done.synchronize()
        self.prompt.store()

    def gpu_seconds(self) -> float | None:
        """The step's GPU time, from before its forward to its tokens' copy, once its tokens were waited for;
        None when it was not timed."""
        if self.began is None or self.host is None or self.host.done is None:
            return None
        return self.began.elapsed_time(self.host.done) / 1e3

    def finished_on_device(self) -> bool:
        """Its tokens' copy is done (no wait); True for a step with nothing to copy."""
        return self.host is None or self.host.done is None or self.host.done.query()

    def tokens(self) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Wait for the sampled ids and return them with the logprobs (rows in `sampled` order)."""
        if self.result is None or self.host is None:
            return [], []
        return self.host.wait(self.result.num_logprobs)

    def feed_for(self, out: SchedulerOutput) -> TokenFeed | None:
        """The rows of `out`'s input ids that are this step's pending tokens, and their values on the device."""
        if self.result is None:
            return None
        index = {chunk.request.request_id: i for i, chunk in enumerate(self.sampled)}
        rows, sources, row = [], [], 0
        for chunk in out.chunks:
            request = chunk.request
            source = index.get(request.request_id)
            if (
                source is not None
                and request.output_token_ids
                and request.output_token_ids[-1] == PENDING_TOKEN
            ):
                rows.append(row + chunk.num_tokens - 1)  # the chunk's last token is the pending one
                sources.append(source)
            row += chunk.num_tokens
        if not rows:
            return None
        ids = self.result.sampled_token_ids
        # Pinned: a copy from pageable memory to the device would first wait for the stream, i.e. for this step.
        host = torch.tensor([rows, sources], dtype=torch.int64, pin_memory=ids.is_cuda)
        pairs = host.to(ids.device, non_blocking=True)
        return TokenFeed(pairs[0], ids.index_select(0, pairs[1]))


class AheadStepper:
    """Engine.step() for an engine that schedules ahead (the module docstring): it owns the step in flight, the
    launch count that tags fenced blocks, the host copies of sampled ids and the launch clock. The engine hands
    it its scheduler, runner and pool, and how to sample rows and emit a request's token."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        pool: BlockPool,
        sample: Callable[[torch.Tensor, list[Request], PendingIds | None], SamplerOutput],
        emit: Callable[[Request, int, TokenLogprobs | None], StepOutput],
        max_num_seqs: int,
        fence_frees: bool,
        late_launch: bool,
        late_launch_margin_s: float = MARGIN_S,
    ) -> None:
        self._scheduler, self._runner, self._pool = scheduler, runner, pool
        self._sample, self._emit = sample, emit
        self.fence_frees = (
            fence_frees  # a decode worker's engine: blocks freed while a step may run are fenced
        )
        self.flight: InFlight | None = None  # the step launched and not yet waited for
        self._launches = 0  # steps launched; InFlight.seq
        self._waited = 0  # the last launch whose device work is known done (its tokens were waited for)
        device = runner.kv_cache.device
        self._on_cuda = device.type == "cuda"
        self._sampled_ids = SampledIds(max_num_seqs, device)
        self.steps_ahead = 0  # steps scheduled and launched while the step before them ran
        # When a serving loop should schedule the next step (launch_at); None: at once
        self.clock: LaunchClock | None = None
        self._margin_s = late_launch_margin_s  # scheduler.late_launch_margin_s: each clock starts from it
        self.set_late_launch(late_launch)

    def set_late_launch(self, on: bool) -> bool:
        """Turn scheduler.late_launch on or off between steps; True when it can be on here (a GPU). The clock
        starts without timings."""
        self.clock = LaunchClock(margin_s=self._margin_s) if on and self._on_cuda else None
        return self._on_cuda

    def launch_at(self) -> float | None:
        """When to schedule the next step (the clock's time), or None: at once. A prompt already waiting ends
        the wait: the next step takes it (or could not, however long it waited), and a step with a prompt chunk
        takes the host longer to launch than the decode step the clock's lead is made for, so launched at
        the clock's time it would leave the GPU idle."""
        if self.clock is None or self.flight is None or self._scheduler.prompts_waiting:
            return None
        return self.clock.launch_at()

    def step(self) -> tuple[list[StepOutput], StepRecord | None]:
        """One step's outputs and record (None when nothing ran), with the next step launched before this one's
        tokens are waited for."""
        started = time.perf_counter()
        flight, self.flight = self.flight, None
        if flight is None:
            flight = self._launch(self._scheduler.schedule(), None)
            if flight is None:
                return [], None
        self._scheduler.advance(flight.out)
        hold = []
        for chunk in flight.sampled:
            request = chunk.request
            if request.is_finished:  # aborted while it ran
                continue
            self._scheduler.append_pending(request)
            if request.num_tokens >= self._scheduler.token_cap(request):
                hold.append(request.request_id)  # its pending token is its last: it finishes by length
        self.flight = self._launch(self._scheduler.schedule(frozenset(hold)), flight)
        launched = time.perf_counter()
        if self.flight is not None:
            self.steps_ahead += 1
        idle = self.clock is not None and flight.finished_on_device()  # the next launch found the GPU idle
        tokens, logprobs = flight.tokens()
        flight.store_prompt_scores()  # before the emits: a request's first output carries them
        if self.clock is not None:
            self._time_launch(flight, launched - started, launched if idle else time.perf_counter(), idle)
        if self.fence_frees:
            self._fence_passed(flight)
        results = []
        for chunk, token, lp in zip(flight.sampled, tokens, logprobs):
            if chunk.request.is_finished:  # aborted while it ran
                continue
            results.append(self._emit(chunk.request, token, lp))
        if self.fence_frees and self.flight is None:
            self._drop_fence()
        firsts = first_tokens(c.request for c in flight.sampled) if flight.planned.num_prefill else ()
        return results, replace(flight.planned, duration_s=time.perf_counter() - started, first_tokens=firsts)

    def _time_launch(self, done: InFlight, host_s: float, next_start: float, idle: bool) -> None:
        """`done`'s tokens are on the host: its GPU time goes to the clock. The step launched after it began on
        the GPU at `next_start`: when `done` ended (its tokens' arrival), or at its own launch if `done` had
        already ended by then (`idle`: the GPU waited for the host)."""
        assert self.clock is not None
        self.clock.done(done.gpu_seconds())
        if self.flight is not None:
            self.clock.launched(host_s)
            planned = self.flight.planned
            self.clock.running(next_start, planned.batch_size, planned.num_prefill == 0, idle)

    def _launch(self, out: SchedulerOutput, previous: InFlight | None) -> InFlight | None:
        """Queue `out`'s forward and sampler on the device and the sampled ids' copy to the host; `previous`:
        the step whose pending tokens `out` reads on the device."""
        if out.is_empty:
            return None
        self._launches += 1
        if self.fence_frees:  # from here on, a freed block may still be in this step's hands
            self._pool.fence = self._launches
        planned = StepRecord.planned(out)
        feed = previous.feed_for(out) if previous is not None else None
        began = None
        if self.clock is not None and self._on_cuda:  # the step's GPU time, for the launch clock
            began = torch.cuda.Event(enable_timing=True)
            began.record()
        logits = self._runner.execute(out, feed=feed)
        prompt, prompt_done = self._prompt_scores()
        sampled = [c for c in out.chunks if c.sample]
        if not sampled:
            return InFlight(out, sampled, None, None, planned, self._launches, None, prompt, prompt_done)
        requests = [c.request for c in sampled]
        result = self._sample(logits, requests, _pending_ids(requests, previous))
        host = self._sampled_ids.start(result, timed=began is not None)
        return InFlight(out, sampled, result, host, planned, self._launches, began, prompt, prompt_done)

    def _prompt_scores(self) -> tuple[PromptScores | None, torch.cuda.Event | None]:
        """The step's prompt scores, their copy to the host started, and an event after it (on a GPU)."""
        scores = self._runner.take_prompt_scores()
        if scores is None:
            return None, None
        host = scores.to_host()
        done = None
        if self._on_cuda:
            done = torch.cuda.Event()
            done.record()
        return host, done

    def _fence_passed(self, flight: InFlight) -> None:
        """`flight`'s tokens are on the host: it and every step launched before it are done on the device (one
        stream), so the blocks freed while they could run are free now. A step that sampled nothing was not
        waited for (on a GPU); its blocks wait for a later step's tokens, or _drop_fence."""
        if flight.result is not None or not self._on_cuda:
            self._waited = flight.seq
            self._pool.release_fenced(flight.seq)

    def _drop_fence(self) -> None:
        """Nothing is in flight: free every fenced block (after the device, if a step was not waited for)."""
        if self._waited < self._launches and self._on_cuda:
            torch.cuda.current_stream(self._runner.kv_cache.device).synchronize()
        self._waited = self._launches
        self._pool.fence = None
        self._pool.release_fenced()


def _pending_ids(requests: list[Request], previous: InFlight | None) -> PendingIds | None:
    """For the penalized rows of a step: their pending tokens, read on the device from `previous`'s sampled ids
    (a penalty counts every generated token, and the host does not have these yet). None when no row needs it."""
    if previous is None or previous.result is None or not any(r.sampling.penalized for r in requests):
        return None
    index = {chunk.request.request_id: i for i, chunk in enumerate(previous.sampled)}
    rows, sources = [], []
    for row, request in enumerate(requests):
        source = index.get(request.request_id)
        outputs = request.output_token_ids
        if request.sampling.penalized and source is not None and outputs and outputs[-1] == PENDING_TOKEN:
            rows.append(row)
            sources.append(source)
    if not rows:
        return None
    ids = previous.result.sampled_token_ids
    return PendingIds(tuple(rows), ids.index_select(0, to_device(sources, ids.device, torch.int64)))
