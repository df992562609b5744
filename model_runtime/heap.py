"""Keeping Python's garbage collector off an engine's long-lived objects.

A full (generation 2) collection walks every tracked object in the process. An engine's process holds a great
many that live as long as it does (the model's modules and parameters, CUDA graphs, compiled kernels, the
imported libraries), and the collector ran on whatever thread allocated at that moment, usually the engine's:
on one H200 (docs/performance.md, "Step-ahead scheduling", runs 29-30) full collections stalled an offline
engine's decode step for 137-163 ms, ten times the step, twice in a few seconds of a 1000-prompt run. With those
objects frozen (gc.freeze: moved to a permanent generation the collector skips) the same collections took
3.6-4.3 ms. Objects made afterwards (requests, outputs) are collected as before.

    freeze_startup_objects()        a worker, a router, `tandem serve`, once started: collect, then freeze;
                                    thaw() at stop
    with frozen_while_running():    an offline run: what exists before it is frozen for its length

A router process holds fewer such objects but relays every stream on one event loop: on this repository's
2-core CI box a full collection of a started router (64,000 tracked objects) took 26-35 ms (56-78 ms while the
box ran the test suite), every stream waiting, and under 0.1 ms with its start-up frozen.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


def freeze_startup_objects() -> None:
    """Collect once (start-up's garbage should not be kept), then freeze every object alive."""
    gc.collect()
    gc.freeze()


def thaw() -> None:
    """Give the frozen objects back to the collector (the oldest generation)."""
    gc.unfreeze()


@contextmanager
def frozen_while_running() -> Iterator[None]:
    """Freeze what exists for the block's length, then thaw it, unless something froze it already (a worker's
    start-up): then leave it as it is. Both are O(1) list moves inside the collector; no collection runs here."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
