"""The load generator: sends RequestSpecs to a router (open-loop arrivals or closed-loop concurrency) over gRPC
or the OpenAI-compatible HTTP API (tandem_cli.bench.transports) and records each stream's timeline.

Bounds: at most len(specs) requests, and no new request after `duration_s`; whatever still runs at
duration_s + drain_s is cancelled and counted as cancelled (the RPC is cancelled, so the server frees it too).
Each request also carries the deadline `timeout_s`; one that passes counts as failed (DEADLINE_EXCEEDED, or
HTTP_504 over HTTP).
"""

from __future__ import annotations

import asyncio
import enum
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from tandem_cli.bench.stats import Timeline
from tandem_cli.bench.transports import RequestFailed, Transport, transport_for
from tandem_cli.bench.workload import RequestSpec
from tandem_client.types import ModelInfo


class Outcome(enum.StrEnum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"  # by the load generator at the time bound


@dataclass(frozen=True)
class RequestRecord:
    index: int
    input_len: int
    output_len: int  # requested (max_tokens with ignore_eos)
    sent_at: float  # seconds since the benchmark started
    timeline: Timeline  # times relative to sent_at
    outcome: Outcome
    error_code: str | None = None  # gRPC status name (HTTP_<status> over HTTP) for FAILED
    cached_tokens: int | None = None  # prompt tokens the prefix cache served (succeeded requests)


@dataclass(frozen=True)
class Pacing:
    """Exactly one of: open loop (send times, seconds from start) or closed loop (requests in flight)."""

    arrivals: tuple[float, ...] | None = None
    concurrency: int | None = None

    def __post_init__(self) -> None:
        if (self.arrivals is None) == (self.concurrency is None):
            raise ValueError("Pacing: give exactly one of arrivals or concurrency")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"--concurrency: must be >= 1, got {self.concurrency}")


@dataclass(frozen=True)
class RunLimits:
    duration_s: float | None = None  # stop sending after this; None: send every request
    drain_s: float = 30.0  # then wait this long for running requests before cancelling them
    timeout_s: float | None = None  # gRPC deadline per request

    def hard_stop(self) -> float:
        return math.inf if self.duration_s is None else self.duration_s + self.drain_s


@dataclass(frozen=True)
class RunResult:
    records: tuple[RequestRecord, ...]
    duration_s: float  # first send to the last request's end (or the hard stop)


async def served_model(address: str, protocol: str = "grpc") -> ModelInfo:
    """The router's (first) served model: its vocab_size bounds random prompt ids."""
    async with transport_for(protocol, address) as transport:
        return await transport.served_model()


class Progress(Protocol):
    """Counts finished requests: the progress bar, or a client process's progress file (bench.processes)."""

    def update(self, n: int) -> object: ...


class _Recorder:
    """Runs one request and turns its stream into a RequestRecord, whatever happens to it."""

    def __init__(
        self, transport: Transport, start: float, timeout_s: float | None, progress: Progress
    ) -> None:
        self._transport, self._start, self._timeout, self._progress = transport, start, timeout_s, progress

    async def run(self, spec: RequestSpec) -> RequestRecord:
        sent = time.perf_counter()
        deltas: list[tuple[float, int]] = []
        outcome, code, cached = Outcome.FAILED, None, None

        def on_delta(tokens: int) -> None:
            deltas.append((time.perf_counter() - sent, tokens))

        try:
            cached = await self._transport.send(spec, self._timeout, on_delta)
            outcome = Outcome.SUCCEEDED
        except RequestFailed as exc:
            code = exc.code
        except asyncio.CancelledError:
            outcome = Outcome.CANCELLED  # only the load generator cancels these tasks (at its time bound)
        end = time.perf_counter() - sent
        self._progress.update(1)
        timeline = Timeline(tuple(deltas), end)
        return RequestRecord(
            spec.index,
            len(spec.prompt_token_ids),
            spec.output_len,
            sent - self._start,
            timeline,
            outcome,
            code,
            cached,
        )


async def _open_loop(
    recorder: _Recorder,
    specs: Sequence[RequestSpec],
    arrivals: Sequence[float],
    limits: RunLimits,
    start: float,
) -> list[asyncio.Task[RequestRecord]]:
    """Start each request at its send time; stop sending at the duration bound (by the schedule, and by the
    clock: a loop that fell behind its schedule does not send late requests past the bound)."""
    tasks = []
    for spec, offset in zip(specs, arrivals, strict=True):
        if limits.duration_s is not None and offset >= limits.duration_s:
            break
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if limits.duration_s is not None and time.perf_counter() - start >= limits.duration_s:
            break
        tasks.append(asyncio.create_task(recorder.run(spec)))
    return tasks


async def _closed_loop_worker(
    recorder: _Recorder, queue: list[RequestSpec], limits: RunLimits, start: float
) -> list[RequestRecord]:
    """One of `concurrency` loops: send the next request as soon as the previous one ends."""
    records = []
    while queue:
        if limits.duration_s is not None and time.perf_counter() - start >= limits.duration_s:
            break
        records.append(await recorder.run(queue.pop(0)))
    return records


async def _wait_until(tasks: Sequence[asyncio.Future], deadline: float) -> None:
    """Wait for the tasks until `deadline` (perf_counter), then cancel the rest and let them record."""
    if not tasks:
        return
    timeout = None if math.isinf(deadline) else max(0.0, deadline - time.perf_counter())
    _, pending = await asyncio.wait(tasks, timeout=timeout)
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending)


async def run_load(
    address: str,
    specs: Sequence[RequestSpec],
    pacing: Pacing,
    limits: RunLimits,
    progress: bool = True,
    protocol: str = "grpc",
    bar: Progress | None = None,
) -> RunResult:
    """Send `specs` as paced, within `limits`, over `protocol`; one record per request actually sent. `bar`
    counts finished requests instead of the progress bar on stderr (a client process of several)."""
    from tqdm import tqdm  # the progress bar goes to stderr so stdout stays clean for results

    with tqdm(
        total=len(specs),
        file=sys.stderr,
        disable=not progress or bar is not None,
        unit="req",
        desc="tandem bench",
    ) as shown:
        bar = shown if bar is None else bar
        async with transport_for(protocol, address) as transport:
            await transport.served_model()  # the HTTP API's requests name the model
            start = time.perf_counter()
            recorder = _Recorder(transport, start, limits.timeout_s, bar)
            deadline = start + limits.hard_stop()
            if pacing.arrivals is not None:
                # Sending ends by duration_s, before the hard stop, so the sender itself is never cut off.
                tasks = await _open_loop(recorder, specs, pacing.arrivals, limits, start)
                await _wait_until(tasks, deadline)
                records = [t.result() for t in tasks]
            else:
                queue = list(specs)
                n = min(pacing.concurrency or 1, len(queue))
                workers = [
                    asyncio.create_task(_closed_loop_worker(recorder, queue, limits, start)) for _ in range(n)
                ]
                await _wait_until(workers, deadline)
                records = [r for w in workers for r in w.result()]
            end = max((r.sent_at + r.timeline.end for r in records), default=0.0)
    records.sort(key=lambda r: r.index)
    return RunResult(tuple(records), end)
