"""Waiting on GPU work without ever blocking on it: the GPU transports' shared helpers.

A transfer thread never calls stream.synchronize() on communication work: a send whose peer died would block
it forever. It polls an event instead, checking its deadline and the control connection between polls.
Only purely local work (a gather or scatter kernel, a local copy) is ever waited on without a deadline.

Polling costs either latency (a long sleep overshoots the end) or the engine's time (each wake-up takes the
interpreter lock). So a wait that knows when its work should end (a CopyClock's prediction) sleeps until just
before then and polls finely from there; the thread's timer slack is cut to 1 us (Linux), so a 20 us sleep
lasts about 20 us instead of the default 70.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time
from typing import Any

import torch

from kv_transfer.contracts import FailureReason, TransferFailed
from kv_transfer.frames import FrameConnection, Watch, frame_failure

SPIN_S = 50e-6  # poll without sleeping this long first: a spinning thread holds the GIL the engine needs
MIN_SLEEP_S = 20e-6  # then sleep (GIL released) from this long, doubling up to MAX_SLEEP_S between polls
MAX_SLEEP_S = 250e-6  # the overshoot of a wait whose end was not predicted
EARLY_S = 30e-6  # a predicted wait wakes this long before the predicted end
MAX_PREDICTED_SLEEP_S = 2e-3  # one sleep towards a prediction: the watch and the peer are checked between
TIMER_SLACK_NS = 1000
PR_SET_TIMERSLACK = 29  # prctl(2)
MIN_TIMED_BYTES = 8 * 2**20  # copies below this do not teach a CopyClock (launch-bound, timer-bound)


_bound = threading.local()


def bind_device(device: torch.device) -> None:
    """Make `device` current on this thread for torch and, when loaded, CuPy (CUDA's current device is per
    thread, and transfer threads are not the thread that created the cache). Once per thread and device: the
    calls release the interpreter lock, and a transfer thread pays for each release behind a busy engine loop."""
    if getattr(_bound, "device", None) == device:
        return
    torch.cuda.set_device(device)
    try:
        import cupy  # type: ignore[import-not-found]
    except ImportError:
        _bound.device = device
        return
    cupy.cuda.Device(device.index).use()
    _bound.device = device


def wait_event(
    event: Any,
    watch: Watch,
    conn: FrameConnection | None,
    peer_stop: FailureReason,
    expect_at: float = 0.0,
) -> None:
    """Return once `event` completed. Raise on our deadline or cancellation (watch), or when the peer speaks on
    `conn` (it only does to abort or refuse: reported as its reason, `peer_stop` by default). expect_at: when
    the work should end (time.monotonic(), a CopyClock's prediction; 0: unknown)."""
    if event.query():
        return
    fine_timer()
    while (early := expect_at - EARLY_S - time.monotonic()) > 0:
        _check(watch, conn, peer_stop)
        time.sleep(min(early, MAX_PREDICTED_SLEEP_S))
    start = time.monotonic()
    sleep = MIN_SLEEP_S
    while not event.query():
        if time.monotonic() - start < SPIN_S:
            continue
        _check(watch, conn, peer_stop)
        time.sleep(sleep)
        sleep = min(sleep * 2, MAX_SLEEP_S)


def _check(watch: Watch, conn: FrameConnection | None, peer_stop: FailureReason) -> None:
    watch.check()
    if conn is not None and conn.frame_waiting():
        frame = conn.read_frame(watch)
        raise frame_failure(frame, peer_stop) or TransferFailed(
            FailureReason.PROTOCOL_ERROR,
            f"unexpected {frame.WhichOneof('body')} frame during a GPU transfer",
        )


def fine_timer() -> None:
    """Cut this thread's timer slack to TIMER_SLACK_NS (once per thread; a no-op off Linux): its short
    sleeps then end when asked instead of up to 50 us later."""
    if getattr(_bound, "fine_timer", False):
        return
    _bound.fine_timer = True
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(PR_SET_TIMERSLACK, TIMER_SLACK_NS, 0, 0, 0)


class CopyClock:
    """When the copies queued on one stream should end. Each copy is timed on the GPU (two timed events), and
    the fastest rate any copy of at least MIN_TIMED_BYTES reached predicts the next: a copy starts when it is
    queued or when the copy before it should end, whichever is later, and lasts its bytes at that rate.
    Predictions therefore err early (a busy link, a stream waiting on other work), never late by more than a
    rate's noise, so a wait that sleeps until one loses nothing. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rate = 0.0  # bytes per second; 0 until a copy taught it
        self._free_at = 0.0  # when the last predicted copy should end

    @property
    def rate(self) -> float:
        return self._rate

    def expect(self, num_bytes: int) -> float:
        """The predicted end (time.monotonic()) of a copy of num_bytes queued now; 0.0 before any lesson."""
        with self._lock:
            if self._rate <= 0:
                return 0.0
            end = max(time.monotonic(), self._free_at) + num_bytes / self._rate
            self._free_at = end
            return end

    def learn(self, num_bytes: int, seconds: float) -> None:
        """A copy of num_bytes took `seconds` on the GPU."""
        if num_bytes >= MIN_TIMED_BYTES and seconds > 0:
            with self._lock:
                self._rate = max(self._rate, num_bytes / seconds)


def require_cuda(cache: torch.Tensor, kind: str) -> torch.device:
    if cache.device.type != "cuda":
        raise ValueError(f"transfer.kind={kind} needs the KV cache on a CUDA device, got {cache.device}")
    return cache.device
