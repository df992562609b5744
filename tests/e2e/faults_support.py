"""What the e2e tests on real clusters share (test_faults.py first, also test_service, test_multinode and
test_tensor_parallel_serve): cluster introspection through `tandem status`, the worker processes found by their
listening port, signals, a generation on a background thread, the stall cluster's shape and deadlines, and the
offline engine whose greedy tokens the clusters must equal."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2

from model_runtime.config import EngineConfig
from model_runtime.llm import LLM
from model_runtime.request import PromptInput, SamplingParams
from tandem_api.tandem.v1 import worker_pb2, worker_pb2_grpc
from tandem_client import Client
from tandem_client.types import WorkerInfo
from tests.e2e.cluster import ServeProcess, engine_section
from tests.polling import wait_until

# Short deadlines where a stall is the fault under test. Elsewhere (the standard cluster's defaults, 30 s and
# 60 s) the lease must outlast a retried prefill of a long prompt on a loaded 2-core CI box (a claimed lease is no
# longer renewed: the transfer must land within it).
# layer_groups 0: the KV leaves after the first token (the overlap with the prompt's last step is off), so that a
# prefill worker killed once its first token is out dies mid-handoff; with the overlap the KV may already be in
# flight whole (the stopped receiver's socket buffers grow to tens of MiB on a warm connection).
STALL_TRANSFER = {"transfer_timeout_s": 3, "lease_ttl_s": 5, "layer_groups": 0}
WORDS = [
    "the",
    "river",
    "carried",
    "seven",
    "quiet",
    "lanterns",
    "past",
    "the",
    "copper",
    "harbor",
    "at",
    "dawn",
]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def long_prompt(words: int, shift: int = 0) -> str:
    """A prompt long enough that its prefill takes seconds on a CPU worker (a window to inject the fault).
    Each `shift` seeds its own word order, so two prompts share no leading block and the prefix cache cannot
    shorten a prefill that a test races (a rotation of one word list did: shifts equal modulo its length
    gave one prompt the other's first 500 words, and a handoff finished before the fault could be injected)."""
    pick = random.Random(shift)
    return " ".join(pick.choice(WORDS) for _ in range(words))


# --- cluster introspection ---------------------------------------------------------------------------------
def workers(address: str) -> dict[str, WorkerInfo]:
    with Client(address) as client:
        return {w.worker_id: w for w in client.status().workers}


def wait_all_ready(address: str, count: int, timeout_s: float = 120.0) -> dict[str, WorkerInfo]:
    seen: list[str] = []

    def ready() -> dict[str, WorkerInfo] | None:
        found = workers(address)
        seen[:] = [f"{w.worker_id}@{w.address}:{w.state.name}" for w in found.values()]
        ok = len(found) == count and all(w.state.name == "READY" for w in found.values())
        return found if ok else None

    try:
        return wait_until(ready, timeout_s, f"{count} READY workers", every_s=0.2)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last seen: {seen}") from None


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def computing(pids: dict[str, int], window_s: float = 0.2) -> str | None:
    """The worker (of `pids`) that burns CPU now: the one computing a prompt. Read from /proc because the
    router's view lags by a poll and a worker's Status waits for the engine step that is running."""
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    time.sleep(window_s)
    used = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    name = max(used, key=lambda n: used[n])
    return name if used[name] > window_s / 3 else None


def assert_all_idle(address: str, timeout_s: float = 20.0, role: str | None = None) -> None:
    """Every worker (of `role`, if given) reports zero used KV blocks and zero leases."""

    def found() -> list[WorkerInfo]:
        return [w for w in workers(address).values() if role is None or w.role.name == role]

    def idle() -> bool:
        now = found()
        return bool(now) and not any(w.kv_blocks_used or w.active_leases for w in now)

    try:
        wait_until(idle, timeout_s, "idle workers", every_s=0.3)
    except AssertionError:
        busy = [(w.worker_id, w.kv_blocks_used, w.active_leases) for w in found()]
        raise AssertionError(f"workers still hold KV blocks or leases after {timeout_s}s: {busy}") from None


def pid_of(worker: WorkerInfo) -> int:
    """The process listening on the worker's gRPC port: /proc/net/tcp gives the socket's inode, and the process
    holding that inode is the worker."""
    port = int(worker.address.rpartition(":")[2])
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if int(fields[1].rpartition(":")[2], 16) == port and fields[3] == "0A":  # 0A: LISTEN
                    inodes.add(f"socket:[{fields[9]}]")
    holders = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in fds):
                with open(f"/proc/{pid}/stat") as f:
                    holders[int(pid)] = int(f.read().rpartition(")")[2].split()[1])  # its parent's pid
        except OSError:  # gone, or not ours to read
            continue
    # A forked child inherits the listening socket: the worker is the holder whose parent holds none.
    roots = [pid for pid, parent in holders.items() if parent not in holders]
    if len(roots) != 1:
        raise AssertionError(f"{worker.worker_id} on {worker.address}: listening processes {holders}")
    return roots[0]


@contextmanager
def stopped(pid: int) -> Iterator[None]:
    """SIGSTOP the process for the block; SIGCONT after it, however the block ends."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


class Background:
    """One streamed generation on a thread: its token batches as they arrive, its result or error."""

    def __init__(self, address: str, prompt: str, **sampling: object) -> None:
        self.batches: list[list[int]] = []
        self.result = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(address, prompt, sampling), daemon=True)
        self._thread.start()

    def _run(self, address: str, prompt: str, sampling: dict) -> None:
        try:
            with Client(address) as client:
                stream = client.stream(prompt, **sampling)
                for event in stream:
                    if event is not stream.result:
                        self.batches.append(list(event.token_ids))  # type: ignore[union-attr]
                self.result = stream.result
        except BaseException as exc:  # the test thread reads and asserts it
            self.error = exc

    @property
    def num_tokens(self) -> int:
        return sum(len(b) for b in list(self.batches))

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise AssertionError(f"the request did not end within {timeout_s}s")


def busy_worker(address: str, role: str, before: dict[str, WorkerInfo]) -> WorkerInfo:
    """The worker of `role` that took the new request (its requests_total grew, or it holds work now)."""

    def find() -> WorkerInfo | None:
        for w in workers(address).values():
            if w.role.name != role or w.worker_id not in before:
                continue
            took = w.requests_total > before[w.worker_id].requests_total
            if took or w.active_leases or w.running_requests or w.queued_prefill_tokens:
                return w
        return None

    return wait_until(find, 15, f"the {role} worker that took the request", every_s=0.1)


def open_leases(worker: WorkerInfo) -> int:
    """The worker's own count of open KV handoff leases, asked directly (no router poll in between): a decode
    worker's reservations not yet landed, a prefill worker's transfers not yet acknowledged."""
    stub = (
        worker_pb2_grpc.PrefillWorkerStub
        if worker.role.name == "PREFILL"
        else worker_pb2_grpc.DecodeWorkerStub
    )
    with grpc.insecure_channel(worker.address) as channel:
        return stub(channel).Status(worker_pb2.WorkerStatusRequest(), timeout=5).active_leases


def reserving_worker(before: dict[str, WorkerInfo]) -> WorkerInfo:
    """The decode worker (of `before`, all idle) that reserved room for a new request's KV: the one whose own
    status shows an open lease. A reservation precedes the prefill, so this finds the receiver before its KV
    can land."""

    def find() -> WorkerInfo | None:
        for w in before.values():
            if w.role.name == "DECODE" and open_leases(w) > 0:
                return w
        return None

    return wait_until(find, 15, "the decode worker reserving the request's KV", every_s=0.01)


# --- clusters ----------------------------------------------------------------------------------------------
@contextmanager
def serve(tmp: Path, prefill: int, decode: int, transfer: dict, controller: dict) -> Iterator[ServeProcess]:
    extra = {"transfer": transfer, "controller": {"drain_timeout_s": 10, **controller}}
    with ServeProcess(tmp, prefill=prefill, decode=decode, num_blocks=192, extra=extra) as cluster:
        try:
            yield cluster
        finally:  # shown with a failing test: what the controller, router and workers said
            print("".join(cluster.lines[-80:]))


@contextmanager
def offline_engine(
    num_blocks: int, model: str | None = None, cache_dtype: str | None = None
) -> Iterator[LLM]:
    """The engine offline, set up as the clusters' CPU workers are (`engine_section`, one torch intra-op thread: the
    same reduction order), the reference their greedy output must equal. The caller's thread count comes back
    after. `cache_dtype`: the workers' engine.cache.dtype, when the cluster sets one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    section = engine_section(num_blocks)
    if cache_dtype is not None:
        section["cache"]["dtype"] = cache_dtype
    try:
        yield LLM(config=EngineConfig.from_dict(section if model is None else {**section, "model": model}))
    finally:
        torch.set_num_threads(threads)


def greedy(offline: LLM, prompt: str, max_tokens: int) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return offline.generate([PromptInput(text=prompt)], params)[0].token_ids


def assert_prompt_scores(got, want, label: str) -> None:
    """The service's prompt_logprobs (prompt tokens 1..n-1) against the offline engine's (index 0 None)."""
    assert want[0] is None and len(got) == len(want) - 1, label
    for i, (entry, (logprob, top)) in enumerate(zip(got, want[1:]), start=1):
        assert entry.logprob == pytest.approx(logprob, abs=1e-3), f"{label}: prompt token {i}"
        assert [t.token_id for t in entry.top][:1] == [t for t, _ in top][:1], f"{label}: token {i}'s best"
        assert [t.logprob for t in entry.top] == pytest.approx([v for _, v in top], abs=1e-3), label
