"""The `tandem serve` driver (the CLI, deploy.serve, the controller) and the router read configs and start Ray
actors; they never run an engine, so they must not import torch (2.5-4 s of CPU at every cluster start, which a
2-core host pays before Ray even starts). The workers import it inside their Ray actors."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

DRIVER = ["tandem_cli.cli", "deploy.serve", "deploy.controller", "deploy.config", "router.server"]


def test_the_driver_and_router_start_without_torch() -> None:
    code = (
        "import importlib, sys\n"
        f"for name in {DRIVER!r}: importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout[:500]


def test_kv_transfer_loads_its_torch_parts_on_first_use() -> None:
    code = (
        "import sys, kv_transfer\n"
        "assert 'torch' not in sys.modules, 'kv_transfer imported torch'\n"
        "from kv_transfer import KVReceiver, KVSender, SendHandle\n"
        "import kv_transfer.receiver, kv_transfer.sender\n"
        "assert KVReceiver is kv_transfer.receiver.KVReceiver and KVSender is kv_transfer.sender.KVSender\n"
        "try:\n"
        "    kv_transfer.NoSuchThing\n"
        "except AttributeError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "module 'kv_transfer' has no attribute 'NoSuchThing'"
