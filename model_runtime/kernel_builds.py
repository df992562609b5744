"""Triton kernels built while a process serves, counted and named.

Triton builds a kernel variant (compiles it, or loads it from its on-disk cache, then loads it onto the GPU)
the first time a launch meets a new specialization: each integer argument is specialized on being 1 or a
multiple of 16, each pointer on its 16-byte alignment. An engine's start-up warm-up and CUDA-graph capture
build what they run; a variant that first appears mid-run holds up the step that needs it and every sequence
in it. On one H200 (docs/performance.md, "Step-ahead scheduling") an offline FP8 run compiled two kernels
mid-run, 0.4-1.0 s each: the eager decode path's block table grew to a multiple of 16 columns, and the lm_head's
matmul met a single sampled row. Arguments that vary from step to step are kept out of specialization where
they are declared (`do_not_specialize`); this module is how a deployment sees one that is not.

    watch()                  install Triton's compile hooks once per process (chained with any already set)
    mark_started()           builds from here on are after start-up: each logs a warning naming the kernel
    counts()                 KernelBuilds(startup, after_start, recent): recent names the last builds

A worker watches from its construction and marks itself started when its start() is done; its /metrics
exports the counts as tandem_kernel_builds_total{when="startup"|"after_start"}.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

MAX_NAMES = 32  # the last builds named in counts().recent; the counts go on past it


@dataclass(frozen=True)
class KernelBuilds:
    startup: int  # builds before mark_started()
    after_start: int
    # The last MAX_NAMES builds, oldest first: "<kernel> (<ms> ms[, after start]) <Triton's specialization>"
    recent: tuple[str, ...]


class _Watch:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.installed = False
        self.started = False
        self.startup = 0
        self.after_start = 0
        self.names: deque[str] = deque(maxlen=MAX_NAMES)
        self.began = threading.local()  # the build this thread is in: its start time

    def before(self) -> None:
        self.began.at = time.perf_counter()

    def after(self, fn: Any, detail: str) -> None:
        began = getattr(self.began, "at", None)
        ms = (time.perf_counter() - began) * 1e3 if began is not None else float("nan")
        name = getattr(fn, "name", None) or str(fn)
        with self.lock:
            started = self.started
            if started:
                self.after_start += 1
            else:
                self.startup += 1
            self.names.append(f"{name} ({ms:.0f} ms{', after start' if started else ''}) {detail}")
        if not started:
            return
        log.warning(
            "Triton built kernel %s after start-up in %.0f ms; the step that launched it waited as long. "
            "Specialization: %s",
            name,
            ms,
            detail,
        )


_WATCH = _Watch()


def watch() -> bool:
    """Install the hooks (once per process). False where this Triton has no compile hooks (before 3.4) or no
    Triton is installed: counts() then stays at zero."""
    with _WATCH.lock:
        if _WATCH.installed:
            return True
        try:
            from triton import knobs
        except ImportError:
            return False
        runtime = getattr(knobs, "runtime", None)
        if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
            return False
        runtime.jit_cache_hook = _chain_before(runtime.jit_cache_hook)
        runtime.jit_post_compile_hook = _chain_after(runtime.jit_post_compile_hook)
        _WATCH.installed = True
        return True


def _chain_before(previous: Any) -> Any:
    def hook(**kwargs: Any) -> Any:
        _WATCH.before()
        # The pre-build hook's truthy result tells Triton to skip the build: only the previous hook decides.
        return previous(**kwargs) if previous is not None else None

    return hook


def _chain_after(previous: Any) -> Any:
    def hook(**kwargs: Any) -> Any:
        _WATCH.after(kwargs.get("fn"), str(kwargs.get("repr", "")))
        return previous(**kwargs) if previous is not None else None

    return hook


def mark_started() -> None:
    with _WATCH.lock:
        _WATCH.started = True


def counts() -> KernelBuilds:
    with _WATCH.lock:
        return KernelBuilds(_WATCH.startup, _WATCH.after_start, tuple(_WATCH.names))
