"""One benchmark run end to end: ask the router what it serves, build the workload, send it, report.

    report = run_benchmark(BenchSettings(server="127.0.0.1:50051", rate=4.0, ...))

This is what `tandem bench` calls, and what sweep drivers (bench/disagg_vs_colocated.py) call per point.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from tandem_cli.bench.loadgen import Pacing, RunLimits, RunResult, run_load, served_model
from tandem_cli.bench.report import BenchReport, BenchSettings, build_report, git_commit
from tandem_cli.bench.workload import (
    BenchConfigError,
    RequestSpec,
    TraceEntry,
    arrival_offsets,
    build_requests,
    read_trace,
)
from tandem_client.types import ModelInfo


def check_fits(settings: BenchSettings, trace: Sequence[TraceEntry], model: ModelInfo) -> None:
    """Every request must fit the model's context (prompt + output <= max_model_len); checked before sending
    anything so a bad flag fails in a second, not after a partial run."""
    if settings.shared_prefix and any(e.prompt_token_ids for e in trace):
        raise BenchConfigError(
            f"--shared-prefix: --trace {settings.trace} gives whole prompts (prompt_token_ids)"
        )
    if trace:
        longest = max(e.input_len + e.output_len for e in trace)
        where = f"--trace {settings.trace}"
    else:
        longest = settings.input_len.upper_bound() + settings.output_len.upper_bound()
        where = "--input-len + --output-len"
    if settings.shared_prefix:
        longest += settings.shared_prefix
        where = f"--shared-prefix + {where}"
    if model.max_model_len and longest > model.max_model_len:
        raise BenchConfigError(
            f"{where}: requests of up to {longest} tokens do not fit {model.id}'s max_model_len "
            f"{model.max_model_len}"
        )
    if trace:
        bad = [i for e in trace for i in e.prompt_token_ids if i >= model.vocab_size]
        if bad:
            raise BenchConfigError(f"--trace: token id {bad[0]} is >= the vocab_size {model.vocab_size}")


def _pacing(settings: BenchSettings, count: int) -> Pacing:
    if settings.rate is not None:
        offsets = arrival_offsets(count, settings.rate, settings.burstiness, settings.seed)
        return Pacing(arrivals=tuple(offsets))
    return Pacing(concurrency=settings.concurrency)


async def _run(settings: BenchSettings, progress: bool) -> tuple[ModelInfo, RunResult]:
    trace = read_trace(settings.trace) if settings.trace else []
    model = await served_model(settings.server, settings.protocol)
    check_fits(settings, trace, model)
    specs: list[RequestSpec] = build_requests(
        settings.num_requests,
        settings.input_len,
        settings.output_len,
        model.vocab_size,
        settings.seed,
        trace,
        settings.shared_prefix,
    )
    limits = RunLimits(settings.duration_s, settings.drain_s, settings.timeout_s)
    pacing = _pacing(settings, len(specs))
    if settings.processes > 1:
        from tandem_cli.bench.processes import run_processes

        run = await asyncio.to_thread(
            run_processes,
            settings.server,
            specs,
            pacing,
            limits,
            settings.processes,
            settings.protocol,
            progress,
        )
    else:
        run = await run_load(settings.server, specs, pacing, limits, progress, settings.protocol)
    return model, run


def run_benchmark(settings: BenchSettings, *, progress: bool = True) -> BenchReport:
    """Run one benchmark against settings.server (blocking; starts its own event loop)."""
    model, run = asyncio.run(_run(settings, progress))
    return build_report(settings, model.id, run, git_commit())
