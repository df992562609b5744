"""Offline checks of the Helm chart (helm/tandem) that `make check-deploy` and tests/deploy run.

    render(values) -> Rendering          the real Helm engine (helm-python-sdk), like `helm template`
    lint(values) -> [finding]            `helm lint --strict`
    validate_rendering(r) -> [finding]   Kubernetes schemas for built-in kinds, KubeRay CRD schemas for Ray kinds
    check_all(r) -> [finding]            labels, selectors, ports, GPUs, Ray resources, the Tandem config

`python -m deploy.chartcheck [-f my-values.yaml]` runs all of it on your own values files.
"""

from __future__ import annotations

from deploy.chartcheck.connections import CONNECTION_CHECKS
from deploy.chartcheck.invariants import CHECKS
from deploy.chartcheck.render import CHART_DIR, Rendering, lint, load_values_file, render
from deploy.chartcheck.validate import validate_rendering


def check_all(rendering: Rendering) -> list[str]:
    """Every invariant finding for one rendering, prefixed with its label."""
    return [
        f"{rendering.label}: {finding}"
        for check in CHECKS + CONNECTION_CHECKS
        for finding in check(rendering)
    ]


__all__ = ["CHART_DIR", "Rendering", "check_all", "lint", "load_values_file", "render", "validate_rendering"]
