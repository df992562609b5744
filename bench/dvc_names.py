"""bench/disagg_vs_colocated.py's deployment names: the deploy config of each (the two bench configs, their sized
variants colocated-N and disagg-PpDd, and the suffixes that change one setting), the checks that its KV can move
between its pools, and the GPUs it asks for."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from deploy.config import HANDOFF_TP_SIZES

ROOT = Path(__file__).resolve().parents[1]

DEPLOYMENTS = {
    "disagg": ROOT / "deploy" / "configs" / "bench-disagg.yaml",
    "colocated": ROOT / "deploy" / "configs" / "bench-colocated.yaml",
}
# Sized variants of the two configs, one GPU a worker: "colocated-4" (4 replicas), "disagg-3p1d" (3 prefill +
# 1 decode). The plain names are the configs as written (2 replicas; 1 prefill + 1 decode).
SIZED = re.compile(r"(?:colocated-(?P<replicas>[1-8])|disagg-(?P<prefill>[1-8])p(?P<decode>[1-8])d)")
# Any name + NO_CACHE: the same deployment with every engine's prefix cache off (the shared-prefix baseline).
NO_CACHE = "-nocache"
# Any name + AUTOSCALE: the same deployment as its starting point, with the SLO autoscaler on (see autoscaled).
AUTOSCALE = "-autoscale"
# Any name + FP8: every pool's projections in FP8 (device.quantization fp8, a scale per output channel) and its KV
# cache in FP8 (cache.dtype fp8_e4m3), as the offline fp8 variant: a handoff moves half the bytes.
FP8 = "-fp8"
# Any name + IPC: the same deployment with transfer.kind cuda_ipc instead of the config's (nccl).
IPC = "-ipc"
# Any name + BOTH: the workers hold cuda_ipc and nccl and the router picks per pair (cuda_ipc on one node, issue 21).
BOTH = "-both"
# Any name + NO_STREAM: the KV leaves after the first token instead of layer group by layer group during the
# prompt's last step (transfer.layer_groups 0).
NO_STREAM = "-nostream"
# Any name + ONE_LANE: nccl transfers to one decode worker take turns (transfer.nccl_lanes 1, as before lanes).
ONE_LANE = "-1lane"
# Any name + NO_ARM: no cuda_ipc lease is armed behind a doorbell (transfer.doorbell_slots 0, as before them).
NO_ARM = "-noarm"
# Any name + SPILL: prompts spill onto their decode worker while the prefill workers' queues are long
# (router.local_prefill_spill_tokens SPILL_TOKENS: about three 2-4k-token prompts waiting).
SPILL = "-spill"
SPILL_TOKENS = 8192
# Any name + SPILL_SMALL_CHUNKS: spill as above, with the decode workers' step budget at SPILL_CHUNK_TOKENS, so a
# spilled 2-4k-token prompt runs in small chunks beside the decodes instead of stalling them for a 2k-token
# step (steps of up to 1024 tokens replay the piecewise prefill graphs, so small chunks cost little).
SPILL_SMALL_CHUNKS = "-spill512"
SPILL_CHUNK_TOKENS = 512
# Any name + "-pbN": the prefill side's step budget is N tokens (max_num_batched_tokens of the prefill workers, or
# of the colocated replicas, whose chunked prefill it sizes). The disaggregated config batches up to 8192 tokens
# a step, so every prompt of a step gets its first token when the whole step ends; "-pb4096" runs about one
# 2-4k-token prompt a step, trading a little prefill throughput for a shorter wait per prompt (issue 20's
# interactive SLO is lost on TTFT).
PREFILL_BUDGET = re.compile(r"(?P<base>.+)-pb(?P<tokens>[0-9]+)")
PREFILL_BUDGET_RANGE = (256, 16384)
# Any name + "-pgN": the colocated replicas' (or else the prefill workers') steps of up to N tokens replay the
# piecewise prefill graphs (device.prefill_graph_tokens N, default 1024; 0: every prompt step eager). With the
# colocated budget of 2048 tokens "-pg2048" puts every chunked-prefill step on graphs: an eager step of that size
# costs the host several hundred kernel launches (a mixed eager step at 320 tokens launched 716 kernels at
# 20-50 us each: docs/performance.md, "piecewise prefill graphs").
PREFILL_GRAPHS = re.compile(r"(?P<base>.+)-pg(?P<tokens>[0-9]+)")
PREFILL_GRAPHS_MAX = 8192
# Any name + "-dgN": every pool's device.decode_gather_tokens N: in a step with prompt chunks, decode rows whose
# contexts total at most N tokens are attended with the chunks over gathered contexts (default 8192); "-dg0"
# leaves them to the paged decode kernel, as before (the A/B of docs/performance.md, "Mixed steps are host-bound").
DECODE_GATHER = re.compile(r"(?P<base>.+)-dg(?P<value>[0-9]+)")
# Any name + "-ckN": every pool's device.chunk_attention_tokens N: a step's cached group of at most N query rows is
# read from the pages by the split-KV chunk kernel (default 1024); "-ck0" gathers it for FlashAttention-2, as
# before (the A/B of docs/performance.md, "A chunk over a cached prefix, split along its context").
CHUNK_ATTENTION = re.compile(r"(?P<base>.+)-ck(?P<value>[0-9]+)")
# Any name + "-gks1" / "-gks0": every pool's piecewise prefill graphs store each layer's K/V inside the captured
# pieces, or leave the store to an eager launch between them (device.prefill_graph_kv_store), for the A/B of the
# store's host time in steps with prompt chunks (docs/performance.md, "Mixed steps are host-bound").
GRAPH_KV_STORE = re.compile(r"(?P<base>.+)-gks(?P<value>[01])")
# The suffixes above that set one engine.device key in every pool: (pattern, key, the value from its digits).
DEVICE_SUFFIXES = (
    (DECODE_GATHER, "decode_gather_tokens", int),
    (CHUNK_ATTENTION, "chunk_attention_tokens", int),
    (GRAPH_KV_STORE, "prefill_graph_kv_store", lambda digit: digit == "1"),
)
# Any name + "-siN": the router gathers N decode tokens per client message (router.stream_interval), for points
# where the `tandem serve` process (router) ran saturated.
STREAM_INTERVAL = re.compile(r"(?P<base>.+)-si(?P<tokens>[0-9]+)")
# A colocated name + AHEAD: its workers schedule each step before the last one's tokens return
# (engine.scheduler.async_scheduling; model_runtime.step_ahead), which colocated workers on one GPU do by
# default since the deploy config turned it on for them; + SYNC: they wait for each step's tokens first (the
# engine before that default, for A/B runs). A disaggregated name + AHEAD or SYNC: the same for its decode
# workers (ahead by default since 7ddf4ee; their freed blocks are fenced from the KV receiver while a step may
# run), so "disagg-3p1d-sync" is the decode side as it was before that.
AHEAD = "-ahead"
SYNC = "-sync"
# A name whose colocated or decode workers schedule ahead + EARLY: each next step is scheduled as soon as the one
# before it starts, the step-ahead engine before scheduler.late_launch (model_runtime.launch_clock), for A/B runs.
EARLY = "-early"
# Each suffix's setting of the colocated (or else the decode) workers' engine.scheduler.
SCHEDULER_SUFFIXES = (
    (AHEAD, "async_scheduling", True),
    (SYNC, "async_scheduling", False),
    (EARLY, "late_launch", False),
)
# A name whose colocated or decode workers launch late + "-lmN": the launch clock's margin is N microseconds
# (scheduler.late_launch_margin_s; default 1500, 0 on decode workers since runs 87-89), for the A/B of a smaller
# lead on the decode worker.
LAUNCH_MARGIN = re.compile(r"(?P<base>.+)-lm(?P<us>[0-9]+)")
# Any name + "-rN" (N in 2-8): tandem serve runs N router processes (router.processes), and the bench's clients
# take them in turn (with --client-processes, each process its own): one router relays about 10k tokens/s.
ROUTERS = re.compile(r"(?P<base>.+)-r(?P<routers>[2-8])")
# Any name + "-tpN": every worker spans N GPUs (engine.parallel.tensor_parallel_size N), e.g. "colocated-2-tp2"
# (2 workers of 2 GPUs) or "disagg-1p1d-tp2" (a prefill and a decode worker of 2 GPUs each). A disaggregated name
# + "-ptpN" or "-dtpN": only the prefill or only the decode workers span N GPUs, e.g. "disagg-1p2d-ptp4-dtp2" (a
# prefill worker of 4 GPUs handing its KV to 2 decode workers of 2; a later suffix wins for its pool). Prefill
# and decode workers span 1, 2, 4 or 8 GPUs, each rank handing over its own KV heads; between workers of
# different sizes the router never picks cuda_ipc (it copies whole caches), so "-both" moves their KV over nccl.
TENSOR_PARALLEL = re.compile(r"(?P<base>.+)-(?P<pools>[pd]?)tp(?P<size>[1-8])")
TENSOR_PARALLEL_POOLS = {"": ("prefill", "decode", "colocated"), "p": ("prefill",), "d": ("decode",)}
POOLS = ("prefill", "decode", "colocated")


def autoscaled(config: dict, ttft_s: float, tpot_s: float) -> dict:
    """The SLO autoscaler on, aiming at the bench's SLO as p90 targets, within the deployment's own worker count
    (so its GPUs: its workers all span as many, see _check_handoff): each disaggregated pool between 1 and all
    but one worker, colocated between 1 and all. A shorter interval, window and cool-down than the defaults (5 s,
    30 s, 60 s) so that it can follow a sweep whose points last seconds: a miss that starts is acted on about
    10 s later, and the new worker counts one window after it is ready (the sweep's --settle-s gives it that
    time before each point)."""
    total = sum(config[p].get("replicas", 1) for p in POOLS if p in config)
    bounds = {"colocated": {"min": 1, "max": total}} if "colocated" in config else {
        "prefill": {"min": 1, "max": max(1, total - 1)}, "decode": {"min": 1, "max": max(1, total - 1)}}  # fmt: skip
    config["autoscaler"] = {"enabled": True, "interval_s": 2, "window_s": 10, "min_requests": 10,
                            "ttft_s": ttft_s, "tpot_s": tpot_s, "cooldown_s": 10, "max_total_workers": total,
                            **bounds}  # fmt: skip
    return config


def _prefill_budget(name: str, config: dict, tokens: int) -> dict:
    """The prefill pool's (or the colocated replicas') step budget at `tokens` (PREFILL_BUDGET_RANGE); a prompt
    longer than the budget runs in chunks of it."""
    low, high = PREFILL_BUDGET_RANGE
    if not low <= tokens <= high:
        raise ValueError(f"{name}: -pbN takes a step budget of {low}-{high} tokens, got {tokens}")
    pool = "prefill" if "prefill" in config else "colocated"
    engine = config[pool].setdefault("engine", {})
    engine["scheduler"] = dict(engine.get("scheduler", {}), max_num_batched_tokens=tokens)
    return config


def _prefill_graphs(name: str, config: dict, tokens: int) -> dict:
    """The colocated replicas' (or else the prefill pool's) device.prefill_graph_tokens at `tokens` (0 to
    PREFILL_GRAPHS_MAX; the engine caps it at the step budget)."""
    if not 0 <= tokens <= PREFILL_GRAPHS_MAX:
        raise ValueError(
            f"{name}: -pgN takes 0-{PREFILL_GRAPHS_MAX} tokens of piecewise prefill graphs, got {tokens}"
        )
    pool = "colocated" if "colocated" in config else "prefill"
    engine = config[pool].setdefault("engine", {})
    engine["device"] = dict(engine.get("device", {}), prefill_graph_tokens=tokens)
    return config


def deployment_config(name: str, slo: tuple[float, float] = (1.0, 0.05)) -> dict:
    """The deploy config of a deployment name (see DEPLOYMENTS, SIZED, NO_CACHE, AUTOSCALE, AHEAD, EARLY, FP8,
    IPC, BOTH, NO_STREAM, ONE_LANE, NO_ARM, SPILL, PREFILL_BUDGET, PREFILL_GRAPHS, DEVICE_SUFFIXES (DECODE_GATHER,
    CHUNK_ATTENTION, GRAPH_KV_STORE), LAUNCH_MARGIN, STREAM_INTERVAL, ROUTERS and TENSOR_PARALLEL); `slo` is the (TTFT, TPOT) the autoscaler aims at. Raises ValueError naming the
    deployment when the name is unknown or its KV could not move between its pools."""
    config = _named_config(name, slo)
    _check_handoff(name, config)
    return config


def _named_config(name: str, slo: tuple[float, float]) -> dict:
    """deployment_config before its checks: each suffix peels off, and applies to, the config of the rest."""
    routers = ROUTERS.fullmatch(name)
    if routers is not None:
        config = _named_config(routers["base"], slo)
        return dict(config, router=dict(config.get("router", {}), processes=int(routers["routers"])))
    if name.endswith(IPC):
        config = _named_config(name.removesuffix(IPC), slo)
        return dict(config, transfer=dict(config.get("transfer", {}), kind="cuda_ipc"))
    if name.endswith(BOTH):
        config = _named_config(name.removesuffix(BOTH), slo)
        transfer = {k: v for k, v in config.get("transfer", {}).items() if k != "kind"}
        return dict(config, transfer=dict(transfer, kinds=["cuda_ipc", "nccl"]))
    if name.endswith(FP8):
        config = _named_config(name.removesuffix(FP8), slo)
        for role in (p for p in POOLS if p in config):
            engine = config[role].setdefault("engine", {})
            engine["device"] = dict(engine.get("device", {}), quantization="fp8")
            engine["cache"] = dict(engine.get("cache", {}), dtype="fp8_e4m3")
        return config
    if name.endswith(ONE_LANE):
        config = _named_config(name.removesuffix(ONE_LANE), slo)
        return dict(config, transfer=dict(config.get("transfer", {}), nccl_lanes=1))
    if name.endswith(NO_ARM):
        config = _named_config(name.removesuffix(NO_ARM), slo)
        return dict(config, transfer=dict(config.get("transfer", {}), doorbell_slots=0))
    interval = STREAM_INTERVAL.fullmatch(name)
    if interval is not None:
        config = _named_config(interval["base"], slo)
        return dict(config, router=dict(config.get("router", {}), stream_interval=int(interval["tokens"])))
    margin = LAUNCH_MARGIN.fullmatch(name)
    if margin is not None:
        config = _named_config(margin["base"], slo)
        pool = next((p for p in ("colocated", "decode") if p in config), None)
        if pool is None:
            raise ValueError(f"{name}: -lmN is for deployments with colocated or decode workers")
        engine = config[pool].setdefault("engine", {})
        engine["scheduler"] = dict(engine.get("scheduler", {}), late_launch_margin_s=int(margin["us"]) / 1e6)
        return config
    for pattern, key, parse in DEVICE_SUFFIXES:  # every pool's engine.device[key]
        match = pattern.fullmatch(name)
        if match is not None:
            config = _named_config(match["base"], slo)
            for pool in (p for p in POOLS if p in config):
                engine = config[pool].setdefault("engine", {})
                engine["device"] = dict(engine.get("device", {}), **{key: parse(match["value"])})
            return config
    graphs = PREFILL_GRAPHS.fullmatch(name)
    if graphs is not None:
        return _prefill_graphs(name, _named_config(graphs["base"], slo), int(graphs["tokens"]))
    budget = PREFILL_BUDGET.fullmatch(name)
    if budget is not None:
        return _prefill_budget(name, _named_config(budget["base"], slo), int(budget["tokens"]))
    if name.endswith(SPILL_SMALL_CHUNKS):
        config = _named_config(name.removesuffix(SPILL_SMALL_CHUNKS) + SPILL, slo)
        engine = config["decode"].setdefault("engine", {})
        engine["scheduler"] = dict(engine.get("scheduler", {}), max_num_batched_tokens=SPILL_CHUNK_TOKENS)
        return config
    if name.endswith(SPILL):
        config = _named_config(name.removesuffix(SPILL), slo)
        return dict(config, router=dict(config.get("router", {}), local_prefill_spill_tokens=SPILL_TOKENS))
    if name.endswith(NO_STREAM):
        config = _named_config(name.removesuffix(NO_STREAM), slo)
        return dict(config, transfer=dict(config.get("transfer", {}), layer_groups=0))
    if name.endswith(AUTOSCALE):
        return autoscaled(_named_config(name.removesuffix(AUTOSCALE), slo), *slo)
    for suffix, key, value in SCHEDULER_SUFFIXES:
        if name.endswith(suffix):
            config = _named_config(name.removesuffix(suffix), slo)
            pool = next((p for p in ("colocated", "decode") if p in config), None)
            if pool is None:
                raise ValueError(f"{name}: {suffix} is for deployments with colocated or decode workers")
            engine = config[pool].setdefault("engine", {})
            engine["scheduler"] = dict(engine.get("scheduler", {}), **{key: value})
            return config
    if name.endswith(NO_CACHE):
        config = _named_config(name.removesuffix(NO_CACHE), slo)
        for pool in (p for p in POOLS if p in config):
            engine = config[pool].setdefault("engine", {})
            engine["cache"] = dict(engine.get("cache", {}), enable_prefix_caching=False)
        return config
    tensor_parallel = TENSOR_PARALLEL.fullmatch(name)
    if tensor_parallel is not None:
        config = _named_config(tensor_parallel["base"], slo)
        pools = [p for p in TENSOR_PARALLEL_POOLS[tensor_parallel["pools"]] if p in config]
        if not pools:
            raise ValueError(
                f"{name}: -{tensor_parallel['pools']}tpN sizes the prefill or decode workers of a disaggregated "
                "deployment; a colocated one's workers span GPUs with -tpN"
            )
        for pool in pools:
            engine = config[pool].setdefault("engine", {})
            engine["parallel"] = {"tensor_parallel_size": int(tensor_parallel["size"])}
        return config
    if name in DEPLOYMENTS:
        return yaml.safe_load(DEPLOYMENTS[name].read_text())
    match = SIZED.fullmatch(name)
    if match is None:
        sized = f"colocated-N, disagg-PpDd (N, P, D in 1-8), each optionally + {NO_CACHE}, {AUTOSCALE}, {AHEAD} / {SYNC} / {EARLY} (colocated or decode workers), {IPC}, {BOTH}, {NO_STREAM}, {ONE_LANE}, {NO_ARM}, {SPILL}, {FP8}, -tpN (workers of N GPUs), -ptpN / -dtpN (disagg: prefill / decode workers of N GPUs), -pbN (prefill step budget, tokens), -pgN (piecewise prefill graphs up to N tokens), -dgN (decode rows gathered with prompt chunks up to N context tokens), -ckN (cached groups of up to N rows read by the chunk kernel), -gks1 / -gks0 (K/V stored inside the prefill graphs or not), -lmN (late-launch margin, us), -siN (router stream interval), -rN (router processes)"
        raise ValueError(f"unknown deployment {name!r}; choose from {', '.join(DEPLOYMENTS)}, {sized}")
    if match["replicas"]:
        config = yaml.safe_load(DEPLOYMENTS["colocated"].read_text())
        config["colocated"]["replicas"] = int(match["replicas"])
        return config
    config = yaml.safe_load(DEPLOYMENTS["disagg"].read_text())
    config["prefill"]["replicas"], config["decode"]["replicas"] = int(match["prefill"]), int(match["decode"])
    return config


def _check_handoff(name: str, config: dict) -> None:
    """A disaggregated deployment's KV must be able to move: prefill and decode workers span one of
    HANDOFF_TP_SIZES GPUs, and cuda_ipc alone cannot join workers of different sizes. Nor may the SLO autoscaler
    move workers between pools of different sizes: its budget counts workers, so each move would change the GPUs
    the deployment holds (and the summary compares it with fixed splits on as many GPUs)."""
    if "colocated" in config:
        return
    prefill, decode = pool_ranks(config["prefill"]), pool_ranks(config["decode"])
    for pool, size in (("prefill", prefill), ("decode", decode)):
        if size not in HANDOFF_TP_SIZES:
            raise ValueError(
                f"{name}: {pool} workers span one of {', '.join(map(str, HANDOFF_TP_SIZES))} GPUs (each rank "
                f"hands over its own KV heads), got {size}"
            )
    if prefill == decode:
        return
    transfer = config.get("transfer", {})
    if (transfer.get("kinds") or [transfer.get("kind")]) == ["cuda_ipc"]:
        raise ValueError(
            f"{name}: cuda_ipc copies whole caches, so it cannot move KV from a prefill worker of {prefill} GPUs "
            f"to a decode worker of {decode}; use {BOTH} (the router then picks nccl for such pairs)"
        )
    if config.get("autoscaler", {}).get("enabled"):
        raise ValueError(
            f"{name}: the SLO autoscaler's budget counts workers, but a prefill worker spans {prefill} GPUs and a "
            f"decode worker {decode}, so a move between the pools would change the GPUs; give both one size (-tpN)"
        )


def config_gpus(config: dict) -> int:
    """GPUs a deployment config asks for (every pool's replicas x num_gpus x tensor-parallel ranks)."""
    pools = [config[p] for p in POOLS if p in config]
    return round(sum(p.get("replicas", 1) * p.get("num_gpus", 0) * pool_ranks(p) for p in pools))


def pool_ranks(pool: dict) -> int:
    return int(pool.get("engine", {}).get("parallel", {}).get("tensor_parallel_size", 1))
