"""bench/disagg_vs_colocated.py's deployments at run time: a name's config (bench/dvc_names.py) shrunk onto a CPU
box for --smoke, and `Server`, which runs one with `tandem serve` on free loopback ports and reads its workers'
KV transfer totals."""

from __future__ import annotations

import json
import os
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
from bench.dvc_names import POOLS, config_gpus, deployment_config, pool_ranks
from tandem_client import Client

ROOT = Path(__file__).resolve().parents[1]
READY_LINE = "Tandem is serving"

# Histograms with a "phase" label that kv_transfer_totals sums: the KV handoff's, then the first token's.
PHASE_FAMILIES = ("tandem_kv_transfer_phase_seconds_", "tandem_first_token_phase_seconds_")
# How late the workers' probe threads woke up (worker_host.gil_probe): "decode.gil_wait", "prefill.gil_wait".
GIL_FAMILY = "tandem_worker_gil_wait_seconds_"
# Steps held back for arrivals (scheduler.late_launch) and the time held: "decode.launch_wait" (mean per step).
LAUNCH_WAIT = {"tandem_engine_launch_wait_seconds_total": "sum", "tandem_engine_launch_waits_total": "count"}
# Each worker's engine steps: "colocated.step" (mean wall time of a step, s), and the sums behind a point's steps
# per second, sequences per step, prompt tokens computed and held launches that found the GPU idle all the same
# ("colocated.steps", ".batch_seqs", ".prefill_tokens", ".launch_misses").
STEP_SUMS = {"tandem_step_duration_seconds_sum": "step.sum", "tandem_step_duration_seconds_count": "step.count",
             "tandem_batch_size_sum": "batch_seqs", "tandem_batch_size_count": "steps",
             "tandem_prefill_tokens_total": "prefill_tokens",
             "tandem_engine_launch_misses_total": "launch_misses"}  # fmt: skip
STEP_COUNTS = ("steps", "batch_seqs", "prefill_tokens")  # the sums a point reports per role and per worker
# Triton kernels a worker built after its start-up (model_runtime.kernel_builds): each held up the step that
# needed it for 0.4-1 s, so a point that had any measured them too ("colocated.kernel_builds").
KERNEL_BUILDS = "tandem_kernel_builds_total"
# How late the router's event-loop probe woke up (router.loop_lag): "router.loop_lag".
LOOP_LAG_FAMILY = "tandem_router_event_loop_lag_seconds_"


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
    prefix cache, step-ahead scheduling, the ranks per worker and FP8 weights and cache, emulated on a CPU, stay as
    the deployment set them). SmolLM2's 3 KV heads split 3 ways
    but not 2, 4 or 8: such a deployment gets a tiny random Llama with 8 KV heads instead, written under
    `work`."""
    model = "smollm2-135m-instruct"
    if any(SMOLLM2_KV_HEADS % pool_ranks(config[pool]) for pool in POOLS if pool in config):
        from tests.model.tiny_models import write_tiny_hf

        model = str(
            write_tiny_hf(
                work, "llama", hidden_size=128, num_attention_heads=8, num_key_value_heads=8,
                max_position_embeddings=4096,
            )
        )  # fmt: skip
    out = dict(config, model=model, transfer={"kinds": ["tcp"]})
    for pool in (p for p in POOLS if p in out):
        cache = out[pool].get("engine", {}).get("cache", {})
        prefix = cache.get("enable_prefix_caching", True)
        said = out[pool].get("engine", {}).get("scheduler", {})
        device = out[pool].get("engine", {}).get("device", {})
        kept = {"quantization": device["quantization"]} if "quantization" in device else {}
        cache_dtype = {"dtype": cache["dtype"]} if "dtype" in cache else {}
        # step-ahead as the deployment set it; absent, the deploy config's default for the pool
        ahead = {"async_scheduling": said["async_scheduling"]} if "async_scheduling" in said else {}
        engine = {
            "device": {"device": "cpu", "dtype": "float32", **kept},
            "cache": {"block_size": 16, "num_blocks": 256, "enable_prefix_caching": prefix, **cache_dtype},
            "scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": 512, "max_model_len": 2048, **ahead},
        }  # fmt: skip
        if pool_ranks(out[pool]) > 1:
            engine["parallel"] = {"tensor_parallel_size": pool_ranks(out[pool])}
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
        ...), the steps held back for arrivals ("decode.launch_wait"), every worker's first-token phases
        ("colocated.first_token_waiting", ...), every worker's step sums ("colocated.steps", STEP_SUMS) and the
        router's event-loop lag ("router.loop_lag"); None when no
        worker is listed. Kept per worker so that a point's
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
            elif component == "decode" and sample.name == "tandem_kv_transfers_armed_total":
                key = "decode.armed"
            elif sample.name in STEP_SUMS and component != "router":
                key = f"{component}.{STEP_SUMS[sample.name]}"
            elif sample.name == KERNEL_BUILDS and sample.labels.get("when") == "after_start":
                key = f"{component}.kernel_builds"
            elif sample.name in LAUNCH_WAIT:
                key = f"{component}.launch_wait.{LAUNCH_WAIT[sample.name]}"
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


def target_deltas(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
) -> dict[str, dict[str, float]]:
    """Each worker's running sums' increase over a point, by target: a worker that joined counts from zero, one
    that left (or restarted: a sum that went down) is left out, since what it did in the point is gone."""
    out: dict[str, dict[str, float]] = {}
    for target, sums in after.items():
        old = before.get(target, {})
        if any(value < old.get(key, 0.0) for key, value in sums.items()):
            continue
        out[target] = {key: value - old.get(key, 0.0) for key, value in sums.items()}
    return out


def worker_deltas(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
) -> dict[str, float]:
    """target_deltas added over the workers."""
    out: dict[str, float] = {}
    for sums in target_deltas(before, after).values():
        for key, value in sums.items():
            out[key] = out.get(key, 0.0) + value
    return out


def kv_delta(before: dict | None, after: dict | None) -> dict | None:
    """Means over one point (from Server.kv_transfer_totals before and after it): seconds and bytes per transfer
    (None without transfers), the mean of each phase (seconds): the handoff's and the first token's, and per
    worker role the point's engine steps, sequences in them and prompt tokens computed ("steps")."""
    if before is None or after is None:
        return None
    delta = worker_deltas(before, after)
    n = delta.get("transfers", 0.0)
    phases = {}
    for key, count in delta.items():
        if key.endswith(".count") and count > 0:
            name = key.removesuffix(".count")
            phases[name] = delta.get(f"{name}.sum", 0.0) / count
    steps: dict[str, Any] = {
        role: {
            **{name: delta.get(f"{role}.{name}", 0.0) for name in STEP_COUNTS},
            "launch_waits": delta.get(f"{role}.launch_wait.count", 0.0),
            "launch_misses": delta.get(f"{role}.launch_misses", 0.0),
            "kernel_builds": delta.get(f"{role}.kernel_builds", 0.0),
        }
        for role in ("prefill", "decode", "colocated")
        if delta.get(f"{role}.steps")
    }
    if not n and not phases:
        return None
    return {"transfers": n, "armed": delta.get("decode.armed", 0.0), "mean_s": delta["seconds"] / n if n else None,
            "mean_bytes": delta["bytes"] / n if n else None, "phases_mean_s": phases, "steps": steps,
            "steps_by_worker": steps_by_worker(before, after)}  # fmt: skip


def steps_by_worker(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
) -> dict[str, dict]:
    """Each worker's engine steps, sequences in them and prompt tokens over a point ({target: {"role", "steps",
    "batch_seqs", "prefill_tokens"}}), for the workers that stepped (target_deltas): how evenly the router
    spread the work over the replicas or pools."""
    out: dict[str, dict] = {}
    for target, sums in sorted(target_deltas(before, after).items()):
        role = next((k.removesuffix(".steps") for k in sums if k.endswith(".steps")), None)
        if role is not None and sums[f"{role}.steps"] > 0:
            out[target] = {"role": role, **{name: sums.get(f"{role}.{name}", 0.0) for name in STEP_COUNTS}}
    return out


def pair_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """The point's disaggregated attempts by pair transport and nodes ({"cuda_ipc:same": 23}; router.pairs)."""
    delta = {key: round(after[key] - before.get(key, 0.0)) for key in after}
    return {key: n for key, n in sorted(delta.items()) if n > 0}
