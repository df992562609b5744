"""bench/disagg_vs_colocated.py's results files, read back for a summary: one per deployment and workload in
each directory given, and one sweep split over several device calls put back together."""

from __future__ import annotations

import json
from pathlib import Path


def load_runs(name: str, dirs: list[Path]) -> dict[str, dict]:
    """Every deployment's results file for workload `name` in `dirs` (the first is --out, the rest --include).
    A deployment found in two of them is one sweep split over device calls when both files ran the same
    commit, card, workload, SLO and config (apart from the router's ports and paths) at different rates: its
    points are merged, in rate order. Anything else is refused rather than one file silently chosen."""
    runs: dict[str, dict] = {}
    seen: dict[str, Path] = {}
    for d in dirs:
        for path in sorted(d.glob(f"*_{name}.json")):
            dep = path.name.split("_")[0]
            run = json.loads(path.read_text())
            if dep in seen:
                why = _unmergeable(runs[dep], run)
                if why:
                    raise ValueError(
                        f"{dep} {name} is in both {seen[dep]} and {path} ({why}); include one of them"
                    )
                runs[dep] = {
                    **runs[dep],
                    "points": sorted([*runs[dep]["points"], *run["points"]], key=_point_key),
                }
                continue
            seen[dep], runs[dep] = path, run
    return runs


# A sweep's identity: what must agree for two files' points to be one sweep's.
_SWEEP_KEYS = ("commit", "card", "gpus", "workload_spec", "slo", "repeats")
# Router settings each call picks afresh (free ports, a temporary file_sd path).
_ROUTER_ADDRESSES = ("port", "http_port", "metrics_port", "metrics_file_sd")


def _unmergeable(a: dict, b: dict) -> str:
    """Why two results files of one deployment and workload are not parts of one sweep ("" when they are)."""
    for key in _SWEEP_KEYS:
        if a.get(key) != b.get(key):
            return f"different {key}"
    if _config_sans_addresses(a) != _config_sans_addresses(b):
        return "different config"
    rates_a, rates_b = ({p["settings"].get("rate") for p in r["points"]} for r in (a, b))
    if rates_a & rates_b:
        return f"both ran {sorted(rates_a & rates_b)} req/s"
    return ""


def _config_sans_addresses(run: dict) -> dict:
    config = dict(run.get("config") or {})
    router = {k: v for k, v in (config.get("router") or {}).items() if k not in _ROUTER_ADDRESSES}
    return {**config, "router": router}


def _point_key(point: dict) -> tuple[float, int, int]:
    return (point["settings"].get("rate") or 0.0, point.get("round") or 0, point.get("repeat") or 0)
