"""`tandem bench`: flags -> BenchSettings -> run_benchmark -> a summary on stdout, JSON and PNG files.

The `tandem` command line (tandem_cli.cli) registers this subcommand with add_bench_parser.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import tempfile
from pathlib import Path

from tandem_cli.bench.report import BenchReport, BenchSettings, format_summary
from tandem_cli.bench.stats import SLO, parse_slo
from tandem_cli.bench.transports import DEFAULT_OPENAI_SERVER, PROTOCOLS
from tandem_cli.bench.workload import BenchConfigError, parse_dist
from tandem_client.channel import ADDRESS_ENV, DEFAULT_ADDRESS, resolve_address

DEFAULT_NUM_REQUESTS = 100
DEFAULT_DRAIN_S = 30.0


def _number(text: str) -> float:
    """argparse type for numbers; ranges are checked by BenchSettings, whose messages name the flag."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def add_bench_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "bench",
        help="load-test a running router: latency percentiles, throughput, goodput under SLOs",
        description="Send synthetic (or traced) requests to a router and measure TTFT, TPOT, ITL and e2e "
        "latency. Prompts are random token ids; every request sets ignore_eos and max_tokens, so output "
        "lengths are exact. DIST is N, uniform:LOW:HIGH or normal:MEAN:STDDEV (token counts).",
    )
    p.add_argument(
        "--server",
        metavar="HOST:PORT",
        help=f"router address (default: ${ADDRESS_ENV} or {DEFAULT_ADDRESS}; with --protocol openai "
        f"the HTTP API's base URL, default {DEFAULT_OPENAI_SERVER}); several routers of one deployment "
        "separated by commas (tandem serve's router.processes): requests take them in turn, and with "
        "--processes each process takes its own",
    )
    p.add_argument(
        "--protocol",
        choices=PROTOCOLS,
        default="grpc",
        help="grpc (default): tandem.v1.Generation through the SDK; openai: streaming /v1/completions over "
        "HTTP, the same requests, to compare the two front doors",
    )
    pace = p.add_mutually_exclusive_group(required=True)
    pace.add_argument(
        "--rate", type=_number, metavar="R", help="open loop: R requests/s on average (inf: all at once)"
    )
    pace.add_argument("--concurrency", type=_integer, metavar="C", help="closed loop: C requests in flight")
    p.add_argument(
        "--burstiness",
        type=_number,
        default=1.0,
        metavar="B",
        help="gamma shape of inter-arrival times: 1 (default) is Poisson, < 1 burstier, > 1 more regular",
    )
    p.add_argument(
        "--num-requests",
        type=_integer,
        metavar="N",
        help=f"requests to send (default: the trace's length, else {DEFAULT_NUM_REQUESTS})",
    )
    p.add_argument("--duration", type=_number, metavar="S", help="stop sending after S seconds")
    p.add_argument(
        "--drain",
        type=_number,
        default=DEFAULT_DRAIN_S,
        metavar="S",
        help=f"with --duration: wait S more seconds, then cancel what still runs (default {DEFAULT_DRAIN_S:g})",
    )
    p.add_argument(
        "--warm-up",
        type=_number,
        default=0.0,
        metavar="S",
        help="first send the same load for S seconds (other prompts), cancel what still runs and count none of "
        "it, so the measured run meets warm kernels, caches and CUDA graphs (default 0: none)",
    )
    p.add_argument("--input-len", default="256", metavar="DIST", help="prompt tokens (default 256)")
    p.add_argument("--output-len", default="128", metavar="DIST", help="output tokens (default 128)")
    p.add_argument(
        "--shared-prefix",
        type=_integer,
        default=0,
        metavar="N",
        help="every prompt starts with the same N tokens (a shared system prompt) before its --input-len "
        "tokens; the report shows how many prompt tokens the prefix cache served",
    )
    p.add_argument(
        "--trace",
        metavar="FILE.jsonl",
        help='lengths per request instead of DISTs: {"input_len": N, "output_len": M} or '
        '{"prompt_token_ids": [...], "output_len": M} per line',
    )
    p.add_argument("--seed", type=_integer, default=0, metavar="S", help="seed for prompts and arrivals")
    p.add_argument(
        "--slo", metavar="ttft=S,tpot=S,e2e=S", help="goodput targets in seconds, e.g. ttft=0.5,tpot=0.05"
    )
    p.add_argument("--json", metavar="OUT.json", help="write the full report (config, commit, per request)")
    p.add_argument("--plot-dir", metavar="DIR", help="write latency CDF plots (PNG; needs matplotlib)")
    p.add_argument("--timeout", type=_number, metavar="S", help="gRPC deadline per request in seconds")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument(
        "--processes",
        type=_integer,
        default=1,
        metavar="N",
        help="send the load from N client processes (default 1); one tops out near 20k output tokens/s",
    )
    p.set_defaults(handler=cmd_bench)


def settings_from_args(args: argparse.Namespace) -> BenchSettings:
    if args.rate is not None and math.isnan(args.rate):
        raise BenchConfigError("--rate: must be > 0, got nan")
    num_requests = args.num_requests
    if num_requests is None:
        num_requests = None if args.trace else DEFAULT_NUM_REQUESTS
    if num_requests is None:
        from tandem_cli.bench.workload import read_trace

        num_requests = len(read_trace(args.trace))
    if args.protocol == "openai":
        server = args.server or DEFAULT_OPENAI_SERVER
    else:
        server = resolve_address(args.server)
    return BenchSettings(
        server=server,
        protocol=args.protocol,
        num_requests=num_requests,
        rate=args.rate,
        concurrency=args.concurrency,
        burstiness=args.burstiness,
        input_len=parse_dist(args.input_len, "--input-len"),
        output_len=parse_dist(args.output_len, "--output-len"),
        trace=args.trace,
        seed=args.seed,
        duration_s=args.duration,
        drain_s=args.drain,
        timeout_s=args.timeout,
        slo=parse_slo(args.slo) if args.slo else SLO(),
        shared_prefix=args.shared_prefix,
        processes=args.processes,
        warm_up_s=args.warm_up,
    )


# The warm-up's prompts come from seed + this, so the measured run's prompts are never in the prefix cache.
WARM_UP_SEED_OFFSET = 1_000_003


def warm_up_settings(settings: BenchSettings) -> BenchSettings:
    """The warm-up before a measured run: the same load and lengths for settings.warm_up_s seconds (at most
    the run's request count), other random prompts, and no drain: what still runs when the sending stops is
    cancelled."""
    return dataclasses.replace(
        settings,
        duration_s=settings.warm_up_s,
        drain_s=0.0,
        seed=settings.seed + WARM_UP_SEED_OFFSET,
        warm_up_s=0.0,
    )


def write_json(report: BenchReport, path: str) -> None:
    """Atomically (temp file + rename), so a reader never sees half a report."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(report.to_json() + "\n")
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def cmd_bench(args: argparse.Namespace) -> int:
    from tandem_cli.bench.runner import run_benchmark

    settings = settings_from_args(args)
    if settings.warm_up_s:
        warm = run_benchmark(warm_up_settings(settings), progress=False)
        print(
            f"tandem: warm-up: {warm.counts.sent} requests in {settings.warm_up_s:g} s "
            f"({warm.counts.succeeded} finished, {warm.counts.cancelled} cancelled), not counted",
            file=sys.stderr,
        )
    report = run_benchmark(settings, progress=not args.no_progress)
    print(format_summary(report))
    if args.json:
        write_json(report, args.json)
        print(f"tandem: wrote the report to {args.json}", file=sys.stderr)
    if args.plot_dir:
        from tandem_cli.bench.plots import LatencySamples, plot_latency_cdfs

        written = plot_latency_cdfs(
            {report.model: LatencySamples.from_report(report)},
            Path(args.plot_dir) / "latency_cdf.png",
            slo=None if report.settings.slo.is_empty() else report.settings.slo,
            title=f"tandem bench: {report.settings.server}",
        )
        if written is not None:
            print(f"tandem: wrote {written}", file=sys.stderr)
    return 0
