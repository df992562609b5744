"""Waiting on a condition in a test: one copy, shared by every tier."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    check: Callable[[], T],
    timeout_s: float = 5.0,
    what: str = "condition",
    detail: Callable[[], str] | None = None,
    *,
    every_s: float = 0.05,
) -> T:
    """Call `check` every `every_s` until it returns something truthy, and return that. After `timeout_s`
    without one, fail naming `what`, followed by `detail()` (the state that explains the wait) when given."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            message = f"timed out after {timeout_s:g}s waiting for {what}"
            raise AssertionError(f"{message}:\n{detail()}" if detail is not None else message)
        time.sleep(every_s)
