"""The per-pool defaults deploy.config adds to a pool that does not set them: `tandem serve` with no config file
gets the same ones as a config that leaves the pools empty."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.config import load_config, parse_config
from model_runtime.config import DECODE_LATE_LAUNCH_MARGIN_S, LATE_LAUNCH_MARGIN_S

pytestmark = pytest.mark.unit


def test_no_config_file_gets_the_pool_defaults_of_an_empty_one(tmp_path: Path) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("{}\n")
    none, from_file = load_config(None), load_config(empty)
    assert none == from_file == parse_config({})
    assert none.decode.engine.scheduler.async_scheduling  # decode workers schedule ahead
    assert none.colocated.engine.scheduler.async_scheduling
    assert not none.prefill.engine.scheduler.async_scheduling
    assert none.decode.engine.scheduler.late_launch_margin_s == DECODE_LATE_LAUNCH_MARGIN_S
    assert none.prefill.engine.scheduler.late_launch_margin_s == LATE_LAUNCH_MARGIN_S
    assert none.colocated.engine.scheduler.late_launch_margin_s == LATE_LAUNCH_MARGIN_S


def test_a_pool_that_sets_its_own_scheduler_values_keeps_them() -> None:
    config = parse_config(
        {"decode": {"engine": {"scheduler": {"async_scheduling": False, "late_launch_margin_s": 0.002}}}}
    )
    assert not config.decode.engine.scheduler.async_scheduling
    assert config.decode.engine.scheduler.late_launch_margin_s == pytest.approx(0.002)
