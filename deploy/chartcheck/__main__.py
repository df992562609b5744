"""python -m deploy.chartcheck [-f VALUES ...] [--import-crd CRD.yaml ...]

Renders helm/tandem with each values file (default: the chart defaults and every helm/tandem/ci/*.yaml), lints
it strictly, validates every object and checks the invariants. Prints one line per problem; exits 1 on any.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import helm_python

from deploy.chartcheck import CHART_DIR, check_all, lint, load_values_file, render, validate_rendering
from deploy.chartcheck.crds import import_crd


def check_values(label: str, values: dict) -> list[str]:
    problems = [f"{label}: helm lint: {finding}" for finding in lint(values)]
    try:
        rendering = render(values, label=label)
    except helm_python.HelmError as exc:
        return [*problems, f"{label}: helm template: {exc}"]
    return problems + validate_rendering(rendering) + check_all(rendering)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.chartcheck", description=__doc__.split("\n\n")[1])
    parser.add_argument(
        "-f", "--values", action="append", type=Path, default=[], help="values file (repeatable)"
    )
    parser.add_argument(
        "--import-crd", action="append", type=Path, default=[], help="refresh a vendored CRD schema"
    )
    args = parser.parse_args(argv)
    for crd in args.import_crd:
        print(f"wrote {import_crd(crd)}")
    if args.import_crd and not args.values:
        return 0
    sets = [(str(p), load_values_file(p)) for p in args.values]
    if not sets:
        sets = [("defaults", {})] + [
            (str(p.relative_to(CHART_DIR)), load_values_file(p))
            for p in sorted((CHART_DIR / "ci").glob("*.yaml"))
        ]
    problems = [problem for label, values in sets for problem in check_values(label, values)]
    for problem in problems:
        print(problem)
    print(f"chart {CHART_DIR.name}: {len(sets)} values set(s), {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
