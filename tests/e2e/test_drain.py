"""Graceful drain: SIGTERM to `tandem serve` while requests stream.

Admission stops at once (new requests get UNAVAILABLE "draining", health turns NOT_SERVING), the requests in
flight finish whole within the drain timeout, the process exits 0, and nothing of its Ray cluster is left
running: not one of the processes that descended from it, nor any process naming its Ray session.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, field

import psutil
import pytest
from grpc_health.v1 import health_pb2

from tandem_client import Client, GenerationResult
from tandem_client.errors import TandemError, Unavailable
from tests.e2e.cluster import ServeProcess
from tests.loopback import health

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

DRAIN_TIMEOUT_S = 30.0
IN_FLIGHT = 4
MAX_TOKENS = 48
RAY_NAMES = ("raylet", "gcs_server", "ray::", "ray/", "default_worker", "dashboard")


@dataclass
class Streams:
    """Requests started before SIGTERM: their results (or errors), and an event per first token."""

    results: list[GenerationResult | Exception] = field(default_factory=list)
    first_tokens: list[threading.Event] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)


def start_streams(address: str, n: int) -> Streams:
    streams = Streams()
    lock = threading.Lock()

    def one(i: int, started: threading.Event) -> None:
        try:
            with Client(address) as client:
                stream = client.stream(
                    f"Story number {i}: once upon a time",
                    temperature=0,
                    max_tokens=MAX_TOKENS,
                    ignore_eos=True,
                    timeout=120,
                )
                for _ in stream:
                    started.set()
                outcome: GenerationResult | Exception = stream.result or RuntimeError("no result")
        except Exception as exc:  # recorded and asserted on: every in-flight request must succeed
            outcome = exc
        started.set()
        with lock:
            streams.results.append(outcome)

    for i in range(n):
        event = threading.Event()
        thread = threading.Thread(target=one, args=(i, event), daemon=True)
        streams.first_tokens.append(event)
        streams.threads.append(thread)
        thread.start()
    return streams


def cluster_processes(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def ray_session_name(processes: list[psutil.Process]) -> str:
    """The Ray session this cluster runs in, from its processes' command lines ("session_..._<pid>")."""
    for proc in processes:
        try:
            for part in proc.cmdline():
                if "session_" in part:
                    start = part.index("session_")
                    return part[start:].split("/")[0].split(" ")[0]
        except psutil.Error:
            continue
    raise AssertionError("no Ray process names a session directory")


def alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def processes_naming(needle: str) -> list[str]:
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(proc.info.get("cmdline") or [])
        if needle in cmdline and alive(proc):
            found.append(f"{proc.info['pid']}: {cmdline[:160]}")
    return found


def refused_while_draining(address: str, limit_s: float = 10.0) -> Unavailable:
    """Send new requests until one is refused (the signal is handled asynchronously); none may hang."""
    deadline = time.monotonic() + limit_s
    with Client(address, retries=0) as client:
        while time.monotonic() < deadline:
            try:
                client.generate("New work after SIGTERM", max_tokens=1, temperature=0, timeout=10)
            except Unavailable as exc:
                return exc
            except TandemError:
                raise
            time.sleep(0.05)
    raise AssertionError(f"new requests were still admitted {limit_s}s after SIGTERM")


def test_sigterm_drains_in_flight_work_and_leaves_nothing_behind(tmp_path):
    extra = {"controller": {"health_interval_s": 0.5, "drain_timeout_s": DRAIN_TIMEOUT_S}}
    with ServeProcess(tmp_path, prefill=1, decode=1, num_blocks=128, extra=extra) as serve:
        assert serve.proc is not None
        ours = cluster_processes(serve.proc.pid)
        names = " ".join(p.name() for p in ours)
        assert "raylet" in names and "gcs_server" in names, names
        session = ray_session_name(ours)

        streams = start_streams(serve.address, IN_FLIGHT)
        for event in streams.first_tokens:
            assert event.wait(60), "a request did not start streaming"
        signalled = time.monotonic()
        serve.proc.send_signal(signal.SIGTERM)

        refused = refused_while_draining(serve.address)
        assert "draining" in refused.details, refused.details
        assert health(serve.address) == health_pb2.HealthCheckResponse.NOT_SERVING

        for thread in streams.threads:
            thread.join(DRAIN_TIMEOUT_S)
        drained = time.monotonic() - signalled
        serve.exit_code = serve.proc.wait(DRAIN_TIMEOUT_S + 30)
        exited = time.monotonic() - signalled

    failures = [r for r in streams.results if not isinstance(r, GenerationResult)]
    assert not failures, f"in-flight requests failed during the drain: {failures}"
    assert len(streams.results) == IN_FLIGHT
    assert all(len(r.token_ids) == MAX_TOKENS for r in streams.results if isinstance(r, GenerationResult))
    assert drained < DRAIN_TIMEOUT_S, f"in-flight requests took {drained:.1f}s to drain"
    assert serve.exit_code == 0, "".join(serve.lines[-30:])
    time.sleep(1.0)  # Ray's last workers exit right after their raylet
    left = [f"{p.pid} {p.name()}" for p in ours if alive(p)]
    assert not left, f"processes of the cluster still running after exit: {left}"
    assert not processes_naming(session), processes_naming(session)
    print(f"drained in {drained:.1f}s, exited {exited:.1f}s after SIGTERM; {len(ours)} processes gone")
