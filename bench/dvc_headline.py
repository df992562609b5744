"""Issue 20's headline from bench/disagg_vs_colocated.py's per-deployment summaries: on each GPU count, the best
disaggregated deployment against the best colocated one (capacity per GPU at the sweep's SLO and at the
interactive one), their p99 ITL at equal load, and how each mode's best grows from N GPUs to 2N.

"Best" is per SLO set: the deployment of that mode and GPU count with the highest capacity there (fixed splits,
spill and autoscaled ones alike; "-nocache" ablations are not candidates). A capacity at the top of its sweep
is a lower bound ("at least"); 0 means even the lowest rate swept missed ("below" that rate). Ratios built from
such bounds are bounds too, and the tables say so rather than print them as measurements."""

from __future__ import annotations

from bench.dvc_cpu import SATURATED_CORES
from tandem_cli.bench.sweep import equal_load

MODES = ("disagg", "colocated")
ABLATION_SUFFIXES = ("-nocache",)  # the same deployment with a feature off: not a candidate for best
# each SLO set's capacity and its bound in a deployment's summary (dvc_summary.summarize_workload)
SLO_KEYS = {"slo": ("capacity_rps", "capacity_bound"),
            "interactive": ("capacity_rps_interactive", "capacity_bound_interactive")}  # fmt: skip
INTERACTIVE_GOALS = {"prefill-heavy": 2.0, "mixed": 2.0, "decode-heavy": 1.0}  # disagg / colocated per GPU
ITL_GOAL = 2.0  # p99 ITL at equal load: colocated / disaggregated
DOUBLING_GOAL = 1.8  # each mode's best on 2N GPUs over its best on N


def mode_of(dep: str) -> str | None:
    mode = dep.split("-")[0]
    return mode if mode in MODES and not dep.endswith(ABLATION_SUFFIXES) else None


def bound(cap: float | None, rates: list[float]) -> str | None:
    """The bound a capacity is: "at least" when it is the highest rate swept (no miss found), "below" when
    even the lowest missed, None when a miss above a met rate pins it down."""
    if cap is None or not rates:
        return None
    if cap == 0:
        return "below"
    return "at least" if cap >= max(rates) else None


def saturated_at_first_miss(points: list[dict], cap: float) -> bool:
    """Whether the first rate above the capacity ran with the `tandem serve` process (router) or a bench client
    at SATURATED_CORES or more (dvc_cpu): then the miss may be that process's, not the GPUs'."""
    above = [p for p in points if p["settings"]["rate"] > cap]
    if not above:
        return False
    first = min(above, key=lambda p: p["settings"]["rate"])
    return any(v >= SATURATED_CORES for k, v in first.get("cpu", {}).items() if k.endswith("_cores"))


def best_of(
    out: dict, deps: list[str], keys: tuple[str, str], points: dict[str, list[dict]], gpus: int
) -> dict | None:
    """The deployment with the highest capacity under keys[0] (its bound under keys[1], from the summary);
    "value" is what ratios use: the capacity, or for one that missed even its lowest rate, that rate as an upper
    bound."""
    key, bound_key = keys
    known = [d for d in deps if out[d].get(key) is not None]
    if not known:
        return None
    dep = max(known, key=lambda d: (out[d][key], -len(d)))  # ties: the plainer name
    cap, lowest = out[dep][key], min(p["settings"]["rate"] for p in points[dep])
    value = cap or lowest
    return {"deployment": dep, "capacity_rps": cap, "value": value, "per_gpu": value / gpus,
            "bound": out[dep][bound_key], "lowest_rate": lowest,
            "cpu_saturated_at_first_miss": saturated_at_first_miss(points[dep], cap)}  # fmt: skip


SIDE = {None: 0, "at least": 1, "below": -1}  # where the true capacity lies from "value"


def ratio_bound(num: dict, den: dict) -> str | None:
    """What num / den is when either capacity is a bound: None (exact), "at least", "at most" or "unknown"
    (the two bounds pull opposite ways)."""
    sides = {SIDE[num["bound"]], -SIDE[den["bound"]]} - {0}
    if not sides:
        return None
    if len(sides) > 1:
        return "unknown"
    return "at least" if sides == {1} else "at most"


def compare(best: dict, num: str, den: str) -> dict | None:
    a, b = best.get(num), best.get(den)
    if not a or not b:
        return None
    return {"ratio": a["per_gpu"] / b["per_gpu"], "bound": ratio_bound(a, b)}


def headline(out: dict, points: dict[str, list[dict]]) -> dict:
    """Per GPU count (as a string, for JSON): each mode's best per SLO set, disaggregated over colocated per GPU,
    and the two relaxed bests' p99 ITL at equal load."""
    by_gpus: dict[int, dict[str, list[str]]] = {}
    for dep, cap in out.items():
        mode = mode_of(dep)
        if mode and isinstance(cap, dict) and "capacity_rps" in cap:
            by_gpus.setdefault(cap["gpus"], {}).setdefault(mode, []).append(dep)
    result = {}
    for gpus, modes in sorted(by_gpus.items()):
        entry: dict = {}
        for slo, keys in SLO_KEYS.items():
            best = {m: best_of(out, deps, keys, points, gpus) for m, deps in modes.items()}
            best = {m: b for m, b in best.items() if b}
            entry[slo] = {"best": best, "disagg_over_colocated": compare(best, "disagg", "colocated")}
        entry["equal_load"] = itl_at_equal_load(entry["slo"]["best"], points)
        result[str(gpus)] = entry
    return result


def itl_at_equal_load(best: dict, points: dict[str, list[dict]]) -> dict | None:
    if set(best) != set(MODES):
        return None
    dis, col = points[best["disagg"]["deployment"]], points[best["colocated"]["deployment"]]
    shares = [[(p["settings"]["rate"], p["goodput"]["share"] if p["goodput"] else 0.0) for p in ps]
              for ps in (dis, col)]  # fmt: skip
    rate = equal_load(shares[0], shares[1])
    if rate is None:
        return None
    itl = {m: next(p["itl"]["p99"] for p in ps if p["settings"]["rate"] == rate)
           for m, ps in (("disagg", dis), ("colocated", col))}  # fmt: skip
    ratio = itl["colocated"] / itl["disagg"] if itl["disagg"] and itl["colocated"] else None
    return {"rate": rate, "itl_p99": itl, "colocated_over_disagg": ratio}


def doubling(head: dict) -> dict:
    """Each mode's best on 2N GPUs over its best on N, per SLO set: {"mode/N->2N/slo": {ratio, bound}}."""
    result = {}
    for gpus, entry in head.items():
        twice = head.get(str(2 * int(gpus)))
        if twice is None:
            continue
        for slo in SLO_KEYS:
            for mode in MODES:
                small, big = entry[slo]["best"].get(mode), twice[slo]["best"].get(mode)
                if small and big:
                    result[f"{mode}/{gpus}->{2 * int(gpus)}/{slo}"] = {
                        "ratio": big["value"] / small["value"], "bound": ratio_bound(big, small),
                        "from": small["deployment"], "to": big["deployment"],
                    }  # fmt: skip
    return result


def goals(rows: list[dict]) -> dict:
    """Issue 20's goals on the largest GPU count each workload ran: interactive goodput per GPU (>= 2x on
    prefill-heavy and mixed, >= 1x on decode-heavy), p99 ITL at equal load (>= 2x lower), and each mode
    growing >= 1.8x from N to 2N GPUs at both SLO sets. A goal judged on a bound says "unknown" when the bound
    points the wrong way."""
    checks: dict = {}
    for row in rows:
        head = row.get("headline") or {}
        if not head:
            continue
        top = head[max(head, key=int)]
        name = row["workload"]
        inter = top["interactive"]["disagg_over_colocated"]
        if name in INTERACTIVE_GOALS and inter:
            checks[f"{name}/interactive_goodput"] = judge(inter, INTERACTIVE_GOALS[name])
        eq = top["equal_load"]
        if eq and eq["colocated_over_disagg"] is not None:
            checks[f"{name}/itl_p99"] = judge({"ratio": eq["colocated_over_disagg"], "bound": None}, ITL_GOAL)
        for key, grow in row.get("mode_doubling", {}).items():
            checks[f"{name}/{key}"] = judge(grow, DOUBLING_GOAL)
    return checks


def judge(ratio: dict, goal: float) -> bool | str:
    """True / False when the ratio settles it; "unknown" when it is a bound on the wrong side of the goal."""
    met = ratio["ratio"] >= goal
    if ratio["bound"] is None:
        return met
    if ratio["bound"] == "at least":
        return True if met else "unknown"
    if ratio["bound"] == "at most":
        return False if not met else "unknown"
    return "unknown"


def _cap(b: dict | None) -> str:
    if not b:
        return "-"
    if b["bound"] == "below":
        return f"< {b['lowest_rate']:g} ({b['deployment']})"
    mark = ">= " if b["bound"] == "at least" else ""
    cpu = ", router or client saturated at the next rate" if b.get("cpu_saturated_at_first_miss") else ""
    return f"{mark}{b['per_gpu']:.2f} ({b['deployment']}, {b['capacity_rps']:g} req/s{cpu})"


def _ratio(r: dict | None) -> str:
    if not r:
        return "-"
    mark = {None: "", "at least": ">= ", "at most": "<= ", "unknown": "~ "}[r["bound"]]
    return f"{mark}{r['ratio']:.2f}x"


def headline_table(rows: list[dict]) -> str:
    lines = ["| workload | GPUs | SLO | best disaggregated (req/s per GPU) | best colocated (req/s per GPU) | "
             "disagg / coloc | p99 ITL at equal load, disagg / coloc |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in rows:
        for gpus, entry in (row.get("headline") or {}).items():
            eq = entry["equal_load"]
            itl = (f"{eq['itl_p99']['disagg'] * 1e3:.0f} / {eq['itl_p99']['colocated'] * 1e3:.0f} ms at "
                   f"{eq['rate']:g} req/s" if eq else "-")  # fmt: skip
            for slo in SLO_KEYS:
                best = entry[slo]["best"]
                lines.append(
                    f"| {row['workload']} | {gpus} | {slo} | {_cap(best.get('disagg'))} | "
                    f"{_cap(best.get('colocated'))} | {_ratio(entry[slo]['disagg_over_colocated'])} | "
                    f"{itl if slo == 'slo' else ''} |"
                )
    return "\n".join(lines) if len(lines) > 2 else ""


def doubling_table(rows: list[dict]) -> str:
    lines = ["| workload | mode | GPUs | SLO | from | to | ratio |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        for key, grow in row.get("mode_doubling", {}).items():
            mode, gpus, slo = key.split("/")
            lines.append(f"| {row['workload']} | {mode} | {gpus} | {slo} | {grow['from']} | {grow['to']} | "
                         f"{_ratio(grow)} |")  # fmt: skip
    return "\n".join(lines) if len(lines) > 2 else ""
