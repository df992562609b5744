"""PNG plots of benchmark results. matplotlib is optional: it is imported only here, inside the functions, and
when it is missing the plot is skipped with a warning (the JSON holds every number the plots show)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType

from tandem_client.bench.report import BenchReport

CDF_METRICS = (("ttft", "TTFT (ms)"), ("tpot", "TPOT (ms)"), ("e2e", "end-to-end latency (ms)"))


def _pyplot() -> ModuleType | None:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; never open a window
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn("matplotlib is not installed: skipping plots (pip install matplotlib)", stacklevel=3)
        return None
    return plt


def plot_latency_cdfs(reports: Mapping[str, BenchReport], path: str | Path, title: str = "") -> Path | None:
    """One panel per metric (TTFT, TPOT, e2e) with the empirical CDF over succeeded requests, one line per
    labelled report (e.g. disaggregated vs colocated at the same rate). Returns the file, or None if skipped."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, len(CDF_METRICS), figsize=(5 * len(CDF_METRICS), 4))
    for ax, (metric, label) in zip(axes, CDF_METRICS, strict=True):
        for name, report in reports.items():
            values = sorted(
                getattr(row, metric) * 1e3
                for row in report.requests
                if row.outcome == "succeeded" and getattr(row, metric) is not None
            )
            if values:
                ys = [(i + 1) / len(values) for i in range(len(values))]
                ax.step(values, ys, where="post", label=name)
        slo = getattr(reports[next(iter(reports))].settings.slo, metric, None) if reports else None
        if slo is not None:
            ax.axvline(slo * 1e3, color="grey", linestyle="--", label="SLO")
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    if title:
        fig.suptitle(title)
    return _save(plt, fig, path)


def plot_goodput_vs_rate(
    series: Mapping[str, Sequence[tuple[float, float]]],
    path: str | Path,
    *,
    ylabel: str = "requests meeting the SLOs (%)",
    threshold: float | None = 90.0,
    title: str = "",
) -> Path | None:
    """One line per configuration through its (request rate, value) points, e.g. the share of requests that
    meet the SLOs at each swept rate; `threshold` draws the target line. Returns the file, or None if skipped."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, points in series.items():
        ordered = sorted(points)
        ax.plot([x for x, _ in ordered], [y for _, y in ordered], marker="o", label=name)
    if threshold is not None:
        ax.axhline(threshold, color="grey", linestyle="--", label=f"target {threshold:g}")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title)
    return _save(plt, fig, path)


def _save(plt: ModuleType, fig: object, path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()  # type: ignore[attr-defined]
    fig.savefig(out, dpi=120)  # type: ignore[attr-defined]
    plt.close(fig)
    return out
