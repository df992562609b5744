"""bench/disagg_vs_colocated.py's deployments: the deploy config of each name (the two bench configs and their
sized variants, colocated-N and disagg-PpDd), the same config shrunk onto a CPU box for --smoke, and `Server`,
which runs one with `tandem serve` on free loopback ports and reads its prefill workers' KV transfer totals."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from bench.dvc_cpu import child_pids
from deploy.config import HANDOFF_TP_SIZES
from tandem_client import Client

ROOT = Path(__file__).resolve().parents[1]
READY_LINE = "Tandem is serving"

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
# Any name + IPC: the same deployment with transfer.kind cuda_ipc instead of the config's (nccl).
IPC = "-ipc"
# Any name + BOTH: the workers hold cuda_ipc and nccl and the router picks per pair (cuda_ipc on one node, issue 21).
BOTH = "-both"
# Any name + NO_STREAM: the KV leaves after the first token instead of layer group by layer group during the
# prompt's last step (transfer.layer_groups 0).
NO_STREAM = "-nostream"
# Any name + ONE_LANE: nccl transfers to one decode worker take turns (transfer.nccl_lanes 1, as before lanes).
ONE_LANE = "-1lane"
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
# Any name + "-siN": the router gathers N decode tokens per client message (router.stream_interval), for points
# where the `tandem serve` process (router) ran saturated.
STREAM_INTERVAL = re.compile(r"(?P<base>.+)-si(?P<tokens>[0-9]+)")
# A colocated name + AHEAD: its workers schedule each step before the last one's tokens return
# (engine.scheduler.async_scheduling; model_runtime.step_ahead).
AHEAD = "-ahead"
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
# Histograms with a "phase" label that kv_transfer_totals sums: the KV handoff's, then the first token's.
PHASE_FAMILIES = ("tandem_kv_transfer_phase_seconds_", "tandem_first_token_phase_seconds_")
# How late the workers' probe threads woke up (worker_host.gil_probe): "decode.gil_wait", "prefill.gil_wait".
GIL_FAMILY = "tandem_worker_gil_wait_seconds_"
# How late the router's event-loop probe woke up (router.loop_lag): "router.loop_lag".
LOOP_LAG_FAMILY = "tandem_router_event_loop_lag_seconds_"


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


def deployment_config(name: str, slo: tuple[float, float] = (1.0, 0.05)) -> dict:
    """The deploy config of a deployment name (see DEPLOYMENTS, SIZED, NO_CACHE, AUTOSCALE, AHEAD, IPC, BOTH,
    NO_STREAM, ONE_LANE, SPILL, PREFILL_BUDGET, STREAM_INTERVAL, ROUTERS and TENSOR_PARALLEL); `slo` is the (TTFT, TPOT) the autoscaler aims at. Raises
    ValueError naming the deployment when the name is unknown or its KV could not move between its pools."""
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
    if name.endswith(ONE_LANE):
        config = _named_config(name.removesuffix(ONE_LANE), slo)
        return dict(config, transfer=dict(config.get("transfer", {}), nccl_lanes=1))
    interval = STREAM_INTERVAL.fullmatch(name)
    if interval is not None:
        config = _named_config(interval["base"], slo)
        return dict(config, router=dict(config.get("router", {}), stream_interval=int(interval["tokens"])))
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
    if name.endswith(AHEAD):
        config = _named_config(name.removesuffix(AHEAD), slo)
        if "colocated" not in config:
            raise ValueError(f"{name}: {AHEAD} is for colocated deployments (workers refuse it elsewhere)")
        engine = config["colocated"].setdefault("engine", {})
        engine["scheduler"] = dict(engine.get("scheduler", {}), async_scheduling=True)
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
        sized = f"colocated-N, disagg-PpDd (N, P, D in 1-8), each optionally + {NO_CACHE}, {AUTOSCALE}, {AHEAD} (colocated), {IPC}, {BOTH}, {NO_STREAM}, {ONE_LANE}, {SPILL}, -tpN (workers of N GPUs), -ptpN / -dtpN (disagg: prefill / decode workers of N GPUs), -pbN (prefill step budget, tokens), -siN (router stream interval), -rN (router processes)"
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
    prefill, decode = _ranks(config["prefill"]), _ranks(config["decode"])
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
    return round(sum(p.get("replicas", 1) * p.get("num_gpus", 0) * _ranks(p) for p in pools))


def _ranks(pool: dict) -> int:
    return int(pool.get("engine", {}).get("parallel", {}).get("tensor_parallel_size", 1))


def free_port(count: int = 1) -> int:
    """A free loopback port; with count > 1 the first of that many consecutive free ones."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = int(s.getsockname()[1])
        if count == 1:
            return first
        if first + count <= 65536 and all(_free(port) for port in range(first + 1, first + count)):
            return first
    raise RuntimeError(f"no {count} consecutive free ports found")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


SMOLLM2_KV_HEADS = 3  # the embedded model's


def smoke_config(config: dict, work: Path) -> dict:
    """The GPU deployment config, shrunk onto a CPU box: the embedded model, no GPUs, tcp, small caches (the
    prefix cache, step-ahead scheduling and the ranks per worker stay as the deployment set them). SmolLM2's 3 KV heads split 3 ways
    but not 2, 4 or 8: such a deployment gets a tiny random Llama with 8 KV heads instead, written under
    `work`."""
    model = "smollm2-135m-instruct"
    if any(SMOLLM2_KV_HEADS % _ranks(config[pool]) for pool in POOLS if pool in config):
        from tests.model.tiny_models import write_tiny_hf

        model = str(
            write_tiny_hf(
                work, "llama", hidden_size=128, num_attention_heads=8, num_key_value_heads=8,
                max_position_embeddings=4096,
            )
        )  # fmt: skip
    out = dict(config, model=model, transfer={"kinds": ["tcp"]})
    for pool in (p for p in POOLS if p in out):
        prefix = out[pool].get("engine", {}).get("cache", {}).get("enable_prefix_caching", True)
        ahead = out[pool].get("engine", {}).get("scheduler", {}).get("async_scheduling", False)
        engine = {
            "device": {"device": "cpu", "dtype": "float32"},
            "cache": {"block_size": 16, "num_blocks": 256, "enable_prefix_caching": prefix},
            "scheduler": {
                "max_num_seqs": 16, "max_num_batched_tokens": 512, "max_model_len": 2048,
                "async_scheduling": ahead,
            },
        }  # fmt: skip
        if _ranks(out[pool]) > 1:
            engine["parallel"] = {"tensor_parallel_size": _ranks(out[pool])}
        out[pool] = dict(out[pool], num_gpus=0, engine=engine)
    return out


class Server:
    """`tandem serve` for one deployment config, on free loopback ports, logging under `log_dir`."""

    def __init__(
        self, name: str, start_timeout_s: float, log_dir: Path, smoke: bool = False,
        slo: tuple[float, float] = (1.0, 0.05), model: str | None = None,
    ) -> None:  # fmt: skip
        self.name, self.start_timeout_s = name, start_timeout_s
        self.work = Path(tempfile.mkdtemp(prefix=f"tandem-bench-{name}-"))
        config = deployment_config(name, slo)
        if model is not None:  # e.g. dummy:llama-3-70b for a deployment whose workers span GPUs
            config["model"] = model
        self.gpus = config_gpus(config)
        if smoke:
            config = smoke_config(config, self.work)
        self.routers = int(config["router"].get("processes", 1))
        self.port = free_port(self.routers)
        self.file_sd = self.work / "targets.json"
        config["router"].update(
            port=self.port, http_port=free_port(self.routers), metrics_port=free_port(self.routers),
            metrics_file_sd=str(self.file_sd),
        )  # fmt: skip
        self.config = config
        self.autoscaled = bool(config.get("autoscaler", {}).get("enabled"))
        self.config_path = self.work / "tandem.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"disagg_vs_colocated_{name}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        """The first router's (status, scaling)."""
        return f"127.0.0.1:{self.port}"

    @property
    def bench_server(self) -> str:
        """What the bench's clients send to: every router process, comma-separated."""
        return ",".join(f"127.0.0.1:{self.port + i}" for i in range(self.routers))

    @property
    def pid(self) -> int | None:
        """The `tandem serve` process (router and controller), while it runs."""
        return None if self.proc is None or self.proc.poll() is not None else self.proc.pid

    @property
    def router_pids(self) -> tuple[int, ...]:
        """Its other router processes (router.processes > 1), while it runs."""
        pid = self.pid
        return () if pid is None or self.routers == 1 else child_pids(pid, "deploy.router")

    def __enter__(self) -> Server:
        cmd = [sys.executable, "-m", "tandem_cli.cli", "serve", "--config", str(self.config_path)]
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + self.start_timeout_s
        while READY_LINE not in self.log_path.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self.log_path.read_text(errors="replace")[-4000:]
                raise RuntimeError(f"tandem serve ({self.name}) did not become ready; log tail:\n{tail}")
            time.sleep(1.0)
        return self

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_quiet(self, timeout_s: float = 120.0) -> None:
        """Between points: the router has nothing in flight, so one point's tail never loads the next."""
        deadline = time.monotonic() + timeout_s
        with Client(self.address, timeout=10) as client:
            while client.status().router.in_flight_requests and time.monotonic() < deadline:
                time.sleep(0.5)

    def pools(self) -> dict[str, int]:
        """Ready workers per pool now, and the autoscaler's last decision line if any: recorded with every
        point, so a sweep of an autoscaled deployment shows the pools following the load."""
        with Client(self.address, timeout=10) as client:
            status = client.status()
        sizes: dict = {pool.role.value: pool.ready for pool in status.pools}
        if status.autoscaler:
            sizes["autoscaler"] = status.autoscaler
        return sizes

    def settled(self) -> bool:
        """Every pool at its target with nothing starting or draining (an autoscaler is not mid-move)."""
        with Client(self.address, timeout=10) as client:
            status = client.status()
        return all(p.ready == p.target and not p.starting and not p.draining for p in status.pools)

    def wait_settled(self, timeout_s: float) -> float:
        """Wait up to timeout_s for settled(); returns the seconds waited."""
        start = time.monotonic()
        while not self.settled() and time.monotonic() - start < timeout_s:
            time.sleep(1.0)
        return time.monotonic() - start

    def kv_transfer_totals(self) -> dict[str, dict[str, float]] | None:
        """Running sums from each worker's /metrics, by target ("host:port"): the prefill workers' transfer
        seconds, count and bytes, both sides' handoff phase sums and counts ("prefill.stream", "decode.admit",
        ...), every worker's first-token phases ("colocated.first_token_waiting", ...) and the router's
        event-loop lag ("router.loop_lag"); None when no worker is listed. Kept per worker so that a point's
        difference survives a worker that left or joined in between (an autoscaler's move): see kv_delta."""
        if not self._targets(("prefill", "decode", "colocated")):
            return None
        names = {"tandem_kv_transfer_seconds_sum": "seconds", "tandem_kv_transfer_seconds_count": "transfers",
                 "tandem_kv_transfer_bytes_total": "bytes"}  # fmt: skip
        totals: dict[str, dict[str, float]] = {}
        for component, target, sample in self._samples(("prefill", "decode", "colocated", "router")):
            total = totals.setdefault(target, {})
            key = None
            if sample.name.startswith(LOOP_LAG_FAMILY) and sample.name.endswith(("_sum", "_count")):
                key = f"router.loop_lag.{sample.name.rsplit('_', 1)[-1]}"
            elif component == "prefill" and sample.name in names:
                key = names[sample.name]
            elif sample.name.startswith(GIL_FAMILY) and sample.name.endswith(("_sum", "_count")):
                key = f"{component}.gil_wait.{sample.name.rsplit('_', 1)[-1]}"
            elif sample.name.startswith(PHASE_FAMILIES) and "phase" in sample.labels:
                suffix = sample.name.rsplit("_", 1)[-1]
                first = "first_token_" if sample.name.startswith(PHASE_FAMILIES[1]) else ""
                if suffix in ("sum", "count"):
                    key = f"{component}.{first}{sample.labels['phase']}.{suffix}"
            if key is not None:
                total[key] = total.get(key, 0.0) + sample.value
        return totals

    def pair_totals(self) -> dict[str, float]:
        """The router's disaggregated attempts so far by their pair's KV transport and nodes, e.g.
        {"cuda_ipc:same": 40.0} (tandem_kv_pairs_total); {} when no router is listed or none ran."""
        totals: dict[str, float] = {}
        for _, _, sample in self._samples(("router",)):
            if sample.name == "tandem_kv_pairs_total":
                key = f"{sample.labels['transport']}:{sample.labels['nodes']}"
                totals[key] = totals.get(key, 0.0) + sample.value
        return totals

    def _targets(self, components: tuple[str, ...]) -> list[tuple[str, str]]:
        """(component, host:port) of every /metrics target the file_sd list gives these components."""
        groups = json.loads(self.file_sd.read_text()) if self.file_sd.exists() else []
        return [(g["labels"].get("component"), t) for g in groups for t in g["targets"]
                if g["labels"].get("component") in components]  # fmt: skip

    def _samples(self, components: tuple[str, ...]) -> Iterator[tuple[str, str, Any]]:
        """(component, target, sample) of every metric sample those components' /metrics serve now."""
        from prometheus_client.parser import text_string_to_metric_families

        for component, target in self._targets(components):
            with urllib.request.urlopen(f"http://{target}/metrics", timeout=10) as reply:
                text = reply.read().decode()
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    yield component, target, sample


def worker_deltas(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
) -> dict[str, float]:
    """Each running sum's increase over a point, added over the workers: a worker that joined counts from zero,
    one that left (or restarted: a sum that went down) counts nothing, since what it did in the point is gone."""
    out: dict[str, float] = {}
    for target, sums in after.items():
        old = before.get(target, {})
        if any(value < old.get(key, 0.0) for key, value in sums.items()):
            continue
        for key, value in sums.items():
            out[key] = out.get(key, 0.0) + value - old.get(key, 0.0)
    return out


def kv_delta(before: dict | None, after: dict | None) -> dict | None:
    """Means over one point (from Server.kv_transfer_totals before and after it): seconds and bytes per transfer
    (None without transfers), and the mean of each phase (seconds): the handoff's and the first token's."""
    if before is None or after is None:
        return None
    delta = worker_deltas(before, after)
    n = delta.get("transfers", 0.0)
    phases = {}
    for key, count in delta.items():
        if key.endswith(".count") and count > 0:
            name = key.removesuffix(".count")
            phases[name] = delta.get(f"{name}.sum", 0.0) / count
    if not n and not phases:
        return None
    return {"transfers": n, "mean_s": delta["seconds"] / n if n else None,
            "mean_bytes": delta["bytes"] / n if n else None, "phases_mean_s": phases}  # fmt: skip


def pair_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """The point's disaggregated attempts by pair transport and nodes ({"cuda_ipc:same": 23}; router.pairs)."""
    delta = {key: round(after[key] - before.get(key, 0.0)) for key in after}
    return {key: n for key, n in sorted(delta.items()) if n > 0}
