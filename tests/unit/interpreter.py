"""Triton kernels on the CPU for the unit tests, through Triton's interpreter.

TRITON_INTERPRET must be set before triton is imported, and a pytest process may already hold compiled
(non-interpreted) kernels from other tests, so the kernels run in a child process that prints its results as one
JSON line, last. Two kinds of child: a test file run as a script whose cases each return (ok, detail)
(`run_cases`, the child side of `interpreted_cases`), or a code string (`run_child`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
HAVE_TRITON = importlib.util.find_spec("triton") is not None

Case = Callable[[], tuple[bool, str]]


def _breaks_on_numpy() -> bool:
    """triton < 3.7's interpreter fails on numpy >= 2.4 (triton-lang/triton#9171)."""
    from importlib.metadata import version

    import numpy

    def major_minor(text: str) -> tuple[int, int]:
        major, minor = text.split(".")[:2]
        return int(major), int(minor)

    return major_minor(version("triton")) < (3, 7) and major_minor(numpy.__version__) >= (2, 4)


def skip_unless_interpretable() -> None:
    """Skips the calling test where the interpreter cannot run here, saying what to install."""
    if not HAVE_TRITON:
        pytest.skip(
            "triton is not installed (the CPU torch wheel does not ship it): pip install 'triton>=3.7'"
        )
    if _breaks_on_numpy():
        pytest.skip(
            "triton < 3.7's interpreter fails on numpy >= 2.4 (triton-lang/triton#9171): pip install 'triton>=3.7'"
        )


def run_child(args: list[str], timeout_s: float) -> Any:
    """`python *args` under the interpreter, from the repository root; the JSON of its last line (the test fails
    with the child's stderr when it exits non-zero)."""
    skip_unless_interpretable()
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout_s
    )
    if proc.returncode != 0:
        pytest.fail(f"interpreter child failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_cases(cases: dict[str, Case]) -> None:
    """The child's side of a test file of cases: every case in turn (one that raises is reported as failed, so
    one broken kernel does not hide the others), then one JSON line {case: {"ok", "detail"}}."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1")
    torch.set_num_threads(1)
    results = {}
    for name, case in cases.items():
        try:
            ok, detail = case()
        except Exception as exc:
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        results[name] = {"ok": ok, "detail": detail}
    print(json.dumps(results))


def interpreted_cases(test_file: str, timeout_s: float = 240) -> dict[str, dict[str, object]]:
    """The pytest side: `test_file` run as the child (its `__main__` calls run_cases)."""
    return run_child([test_file], timeout_s)
