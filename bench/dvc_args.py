"""bench/disagg_vs_colocated.py's command line: its options, their defaults by mode (a GPU run or --smoke),
and the checks that refuse a bad value before any deployment starts (the driver's docstring explains them)."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.dvc_names import deployment_config
from bench.dvc_workloads import WORKLOADS, parse_rates
from tandem_cli.bench import SLO, parse_slo

# point_seed's repeat block for an autoscaled deployment's settling load (--settle-s): --repeats stays below it
SETTLE_SEED_BLOCK = 8
DESCRIPTION = (
    "Disaggregated against colocated deployments of the same engine on the same GPUs: which serves more requests "
    "within latency targets? (bench/disagg_vs_colocated.py's docstring has the workloads, SLOs and output)"
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=DESCRIPTION)
    p.add_argument(
        "--deployments",
        default="disagg,colocated",
        help="comma list of: disagg (1P+1D), colocated (2 replicas), colocated-N, disagg-PpDd; + -tpN: workers "
        "of N GPUs each; disagg + -ptpN / -dtpN: prefill / decode workers of N GPUs (1, 2, 4 or 8)",
    )
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma list of: {', '.join(WORKLOADS)}")
    p.add_argument(
        "--rates",
        action="append",
        default=[],
        help="comma list of req/s overriding every chosen workload's sweep, or WORKLOAD=r,r,... for one "
        "workload (repeatable: --rates prefill-heavy=4,8 --rates decode-heavy=16,32)",
    )
    # Defaults by mode (GPU run / --smoke) are filled in below: None means "not given".
    p.add_argument("--duration", type=float, help="seconds of arrivals per point (default 30; smoke 4)")
    p.add_argument(
        "--batch-duration",
        type=float,
        help="seconds of a closed-loop run (the batch workload; default --duration), so that one call can run "
        "the batch case for a minute and the rate sweeps at short points",
    )
    p.add_argument(
        "--batch-concurrency",
        type=int,
        help="requests in flight in the closed-loop batch workload instead of its 200 (e.g. 50: one GPU's share "
        "of the 4-GPU node the issue describes)",
    )
    p.add_argument("--drain", type=float, help="seconds to wait after sending (default 30; smoke 10)")
    p.add_argument("--min-requests", type=int, help="requests per point at least (default 20; smoke 4)")
    p.add_argument("--slo", type=parse_slo, help="default ttft=1,tpot=0.05 (smoke: ttft=5,tpot=0.5)")
    p.add_argument("--repeats", type=int, help="runs of each point, all kept (1-8; default 2, smoke 1)")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the whole list of deployments this many times in turn (A, B, A, B), each on a fresh "
        "`tandem serve`, every run kept (default 1): an A/B on one machine then sees its drift on both sides",
    )
    p.add_argument(
        "--warm-up-s", type=float, help="seconds at each warm-up rate, 0: none (default 5; smoke 2)"
    )
    p.add_argument(
        "--settle-s",
        type=float,
        help="autoscaled deployments: seconds of each rate's load before its runs, not recorded, for the "
        "autoscaler to resize (default 40; smoke 6; 0: none)",
    )
    p.add_argument(
        "--refine",
        type=float,
        default=0.0,
        help="after the sweep, rates this far apart (req/s) between the highest met and the first missed "
        "(0: none; issue 20 asks for 1)",
    )
    p.add_argument(
        "--py-spy",
        type=float,
        help="record every worker process with py-spy (GIL holders, by thread) during this rate's first run",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--client-processes",
        type=int,
        default=1,
        help="send each point's load from this many client processes (tandem bench --processes; one tops out "
        "near 20k output tokens/s)",
    )
    p.add_argument(
        "--model",
        help="the served model instead of the configs' dummy:llama-3-8b (--smoke: the embedded one)",
    )
    p.add_argument(
        "--budget-s", type=float, default=540.0, help="stop starting points after this (default 540)"
    )
    p.add_argument("--start-timeout-s", type=float, default=900.0, help="for tandem serve to become ready")
    p.add_argument("--summarize-only", action="store_true", help="only rebuild the summary and plots")
    p.add_argument(
        "--include",
        type=Path,
        action="append",
        default=[],
        help="with --summarize-only: also read the results files in this directory (repeatable), e.g. a "
        "2-GPU run beside a 4-GPU one; the summary and plots go to --out",
    )
    p.add_argument("--smoke", action="store_true", help="CPU dry run of the whole driver (needs --out)")
    p.add_argument("--out", type=Path, help="results and logs here instead of bench/results")
    args = p.parse_args(argv)
    if args.smoke and args.out is None:
        p.error("--smoke: give --out DIR (smoke numbers never go to bench/results)")
    if args.include and not args.summarize_only:
        p.error("--include: only with --summarize-only (a sweep writes its own results to --out)")
    missing = [str(d) for d in args.include if not d.is_dir()]
    if missing:
        p.error(f"--include: no such directory {missing[0]}")
    # Smoke: short points and CPU-sized targets, so that a sweep goes past its first point.
    smoke, gpu = (
        (4.0, 10.0, 4, SLO(ttft=5.0, tpot=0.5), 1, 2.0, 6.0),
        (30.0, 30.0, 20, SLO(ttft=1.0, tpot=0.05), 2, 5.0, 40.0),
    )
    for name, default in zip(
        ("duration", "drain", "min_requests", "slo", "repeats", "warm_up_s", "settle_s"),
        smoke if args.smoke else gpu,
    ):
        if getattr(args, name) is None:
            setattr(args, name, default)
    if not 1 <= args.repeats < SETTLE_SEED_BLOCK:
        p.error(f"--repeats: must be in 1-{SETTLE_SEED_BLOCK - 1}, got {args.repeats}")
    if args.rounds < 1:
        p.error(f"--rounds: must be >= 1, got {args.rounds}")
    if args.settle_s < 0:
        p.error(f"--settle-s: must be >= 0, got {args.settle_s}")
    if args.refine < 0:
        p.error(f"--refine: must be >= 0 req/s, got {args.refine}")
    if args.batch_duration is not None and args.batch_duration <= 0:
        p.error(f"--batch-duration: must be > 0 s, got {args.batch_duration}")
    if args.batch_concurrency is not None and args.batch_concurrency < 1:
        p.error(f"--batch-concurrency: must be >= 1, got {args.batch_concurrency}")
    if args.warm_up_s < 0:
        p.error(f"--warm-up-s: must be >= 0, got {args.warm_up_s}")
    try:
        args.rates = parse_rates(args.rates)
    except ValueError as exc:
        p.error(f"--rates: {exc}")
    bad = [n for n in args.workloads.split(",") if n not in WORKLOADS]
    if bad:
        p.error(f"--workloads: unknown {bad[0]!r}; choose from {', '.join(WORKLOADS)}")
    for name in args.deployments.split(","):
        try:
            deployment_config(name)
        except ValueError as exc:
            p.error(f"--deployments: {exc}")
    return args
