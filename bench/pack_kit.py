"""The wheel kit (`.whl/*.whl`, from ../shared/gpu/make-kit.sh) unpacked into one xz archive,
`.whl/site.tar.xz`, for device calls whose tree and kit together pass the device tool's 64 MiB carry limit.

A wheel is a zip of what `pip install --target` would lay down (the kit's wheels have no .data directories and
nothing here needs their console scripts), so unpacking it with its files' modes (Ray's gcs_server and raylet
must stay executable) installs it; xz then packs Ray's binaries tighter than the wheels' deflate (48 MB of
wheels, 34 MB archived; about 90 s of one core here, 5 s to unpack there).

    python3 bench/pack_kit.py              # here, after make-kit.sh
    carry [".whl/site.tar.xz"], and start the device command with:
    tar -xJf .whl/site.tar.xz -C /tmp && export PYTHONPATH=/tmp/site:$PWD TANDEM_COMMIT=<the commit sent> ...

The device's copy of the tree may carry an older `.git`; TANDEM_COMMIT is what the results' `commit` then records
(tandem_cli.bench.report.git_commit).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def unpack(wheels: list[Path], site: Path) -> None:
    """Each wheel's files under `site`, with the modes the wheel recorded."""
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            for info in z.infolist():
                path = z.extract(info, site)
                mode = (info.external_attr >> 16) & 0o777
                if mode:
                    os.chmod(path, mode)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kit", type=Path, default=ROOT / ".whl", help="the wheels' folder (default .whl)")
    p.add_argument("--out", type=Path, help="the archive (default <kit>/site.tar.xz)")
    args = p.parse_args()
    wheels = sorted(args.kit.glob("*.whl"))
    if not wheels:
        sys.exit(f"pack_kit: no wheels in {args.kit}: run ../shared/gpu/make-kit.sh first")
    out = args.out or args.kit / "site.tar.xz"
    with tempfile.TemporaryDirectory() as tmp:
        unpack(wheels, Path(tmp) / "site")
        print(
            f"pack_kit: {len(wheels)} wheels unpacked; packing {out} (about a minute and a half)", flush=True
        )
        partial = out.with_suffix(".partial")
        subprocess.run(["tar", "-cJf", str(partial), "-C", tmp, "site"], check=True)
        shutil.move(partial, out)
    print(f"pack_kit: {out} ({out.stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
