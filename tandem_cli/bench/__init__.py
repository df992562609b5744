"""`tandem bench`, the load generator: workload (what to send and when), loadgen (sending and timing), stats
(per-request metrics, percentiles, goodput), report (the JSON), plots (PNG, optional matplotlib), runner (one
run end to end), cli (the subcommand).

Imports only the SDK (grpc, protobuf); tqdm and matplotlib are imported where used.
"""

from tandem_cli.bench.report import BenchReport, BenchSettings
from tandem_cli.bench.runner import run_benchmark
from tandem_cli.bench.stats import SLO, Goodput, Summary, parse_slo, percentile
from tandem_cli.bench.workload import BenchConfigError, LengthDist, parse_dist

__all__ = [
    "SLO",
    "BenchConfigError",
    "BenchReport",
    "BenchSettings",
    "Goodput",
    "LengthDist",
    "Summary",
    "parse_dist",
    "parse_slo",
    "percentile",
    "run_benchmark",
]
