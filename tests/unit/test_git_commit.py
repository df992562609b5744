"""Benchmark results name the commit they ran: from the checkout, or for a `git archive` export (how GPU runs
carry the code) from the file that git fills in on export."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tandem_cli.bench.report import git_commit

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def test_a_checkout_reports_its_head() -> None:
    head = _git("rev-parse", "HEAD")
    assert git_commit() in (head, f"{head}-dirty")


def test_an_archive_export_inside_another_checkout_reports_the_commit_it_was_made_from(
    tmp_path: Path,
) -> None:
    head = _git("rev-parse", "HEAD")
    host = tmp_path / "host"
    host.mkdir()
    _git("init", "-q", cwd=host)
    export = host / ".snap"
    export.mkdir()
    archive = subprocess.run(["git", "archive", "HEAD"], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(export)], input=archive, check=True)
    code = "from tandem_cli.bench.report import git_commit; print(git_commit())"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=export, capture_output=True, text=True, check=True,
        env={"PYTHONPATH": str(export), "PATH": "/usr/bin:/bin"},
    ).stdout.strip()  # fmt: skip
    assert out == head


def test_a_stamped_commit_wins_over_the_copys_own_git(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU machine's copy of the tree may carry a stale `.git`: the caller's stamp names what really ran."""
    stamp = "0123456789abcdef0123456789abcdef01234567"
    monkeypatch.setenv("TANDEM_COMMIT", stamp)
    assert git_commit() == stamp
    monkeypatch.setenv("TANDEM_COMMIT", "")
    assert git_commit() != stamp
