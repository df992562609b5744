"""bench/pack_kit.py: wheels unpacked as pip --target would lay them down, executables kept executable, and the
archive holding them under site/."""

from __future__ import annotations

import stat
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from bench.pack_kit import unpack

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]


def _wheel(path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        binary = zipfile.ZipInfo("pkg/core/raylet")
        binary.external_attr = (stat.S_IFREG | 0o755) << 16
        z.writestr(binary, b"\x7fELF")
        z.writestr("pkg/__init__.py", "VERSION = 1\n")
        z.writestr("pkg-1.0.dist-info/METADATA", "Name: pkg\n")
    return path


def test_unpacked_files_keep_their_modes(tmp_path: Path) -> None:
    unpack([_wheel(tmp_path / "pkg-1.0-py3-none-any.whl")], tmp_path / "site")
    assert (tmp_path / "site/pkg/__init__.py").read_text() == "VERSION = 1\n"
    assert (tmp_path / "site/pkg/core/raylet").stat().st_mode & 0o111, "a binary must stay executable"
    assert (tmp_path / "site/pkg-1.0.dist-info/METADATA").exists()


def test_the_archive_holds_the_site_folder(tmp_path: Path) -> None:
    kit = tmp_path / "kit"
    kit.mkdir()
    _wheel(kit / "pkg-1.0-py3-none-any.whl")
    subprocess.run([sys.executable, str(REPO / "bench/pack_kit.py"), "--kit", str(kit)], check=True)
    with tarfile.open(kit / "site.tar.xz") as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert "site/pkg/__init__.py" in members
    assert members["site/pkg/core/raylet"].mode & 0o111


def test_no_wheels_is_an_error_that_says_what_to_run(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "bench/pack_kit.py"), "--kit", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert done.returncode != 0 and "make-kit.sh" in done.stderr
