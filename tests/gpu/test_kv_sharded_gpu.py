"""The handoff between tensor-parallel workers of different sizes over nccl, one process per rank on its own GPU
(bench/kv_sharded.py's driver at small sizes): every rep of every layout checks each decode rank's landed blocks
against its heads of the source blocks by checksum, so the run completing is the assertion that the window
gather and scatter and the multi-claimant leases move exactly the right bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(torch.cuda.device_count() < 3, reason="needs three GPUs (prefill 2 ranks, decode 1)"),
]
REPO = Path(__file__).resolve().parents[2]


def test_pieces_between_workers_of_different_sizes_land_bit_exact(tmp_path: Path) -> None:
    layouts = "1x1,2x1,1x2" + (",2x2" if torch.cuda.device_count() >= 4 else "")
    out = tmp_path / "sharded.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "kv_sharded.py"), "--layouts", layouts, "--tokens", "48,1040",
         "--warmup", "1", "--reps", "3", "--out", str(out)],
        cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["complete"] is True
    rows = {(row["layout"], row["tokens"]): row for row in doc["rows"]}
    assert set(rows) == {(layout, tokens) for layout in layouts.split(",") for tokens in (48, 1040)}
    for (layout, _tokens), row in rows.items():
        assert row["checksum_ok"] is True, (layout, row)
        decode_ranks = int(layout.split("x")[1])
        assert len(row["decode_rank_bytes"]) == decode_ranks and sum(row["decode_rank_bytes"]) == row["bytes"]
