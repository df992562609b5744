"""Generate the Python stubs for protos/tandem/v1/*.proto into OUT_DIR (default: tandem_api).

protoc writes `from tandem.v1 import x_pb2` for imports between our files; the stubs live in the package
`tandem_api.tandem.v1`, so those imports are rewritten. Used by `make protos` and by the staleness test.
"""

from __future__ import annotations

import pathlib
import re
import sys

from grpc_tools import protoc  # type: ignore[import-untyped]

ROOT = pathlib.Path(__file__).resolve().parent


def generate(out_dir: pathlib.Path) -> None:
    pkg = out_dir / "tandem" / "v1"
    pkg.mkdir(parents=True, exist_ok=True)
    protos = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tandem" / "v1").glob("*.proto"))
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    for path in pkg.glob("*.py*"):
        text = re.sub(
            r"^from tandem\.v1 import", "from tandem_api.tandem.v1 import", path.read_text(), flags=re.M
        )
        path.write_text(text)
    for d in (out_dir, out_dir / "tandem", pkg):
        (d / "__init__.py").touch()


if __name__ == "__main__":
    generate(pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "tandem_api"))
