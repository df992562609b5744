"""PNG plots of benchmark results. matplotlib is optional: it is imported only here, inside the functions, and
when it is missing the plot is skipped with a warning (the JSON holds every number the plots show)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from tandem_cli.bench.report import BenchReport
from tandem_cli.bench.stats import SLO

CDF_METRICS = (("ttft", "TTFT (ms)"), ("tpot", "TPOT (ms)"), ("e2e", "end-to-end latency (ms)"))


@dataclass(frozen=True)
class LatencySamples:
    """Per-request latencies (seconds) of the succeeded requests of one run: what a CDF plot needs, small
    enough to store next to sweep results and re-plot later."""

    ttft: tuple[float, ...]
    tpot: tuple[float, ...]
    e2e: tuple[float, ...]
    first_itl: tuple[float, ...] = ()  # first token -> second token

    @classmethod
    def from_report(cls, report: BenchReport) -> LatencySamples:
        ok = [row for row in report.requests if row.outcome == "succeeded"]
        return cls(
            ttft=tuple(r.ttft for r in ok if r.ttft is not None),
            tpot=tuple(r.tpot for r in ok if r.tpot is not None),
            e2e=tuple(r.e2e for r in ok),
            first_itl=tuple(r.first_itl for r in ok if r.first_itl is not None),
        )


def _pyplot() -> ModuleType | None:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; never open a window
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn("matplotlib is not installed: skipping plots (pip install matplotlib)", stacklevel=3)
        return None
    return plt


def plot_latency_cdfs(
    series: Mapping[str, LatencySamples], path: str | Path, *, slo: SLO | None = None, title: str = ""
) -> Path | None:
    """One panel per metric (TTFT, TPOT, e2e) with the empirical CDF, one line per labelled run (e.g.
    disaggregated vs colocated at the same rate); dashed lines at the SLO targets. Returns the file, or None
    when matplotlib is missing."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, len(CDF_METRICS), figsize=(5 * len(CDF_METRICS), 4))
    for ax, (metric, label) in zip(axes, CDF_METRICS, strict=True):
        for name, samples in series.items():
            values = sorted(v * 1e3 for v in getattr(samples, metric))
            if values:
                ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=name)
        target = getattr(slo, metric, None) if slo is not None else None
        if target is not None:
            ax.axvline(target * 1e3, color="grey", linestyle="--", label="SLO")
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
    if threshold is not None and threshold <= 100:
        ax.set_ylim(0, 102)  # shares in percent: show the whole range so the distance to the target reads
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
