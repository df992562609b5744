"""The committed stubs in tandem_api/ must be exactly what protos/generate.py makes from protos/ today."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

pytestmark = pytest.mark.unit

REPO = pathlib.Path(__file__).resolve().parents[2]
COMMITTED = REPO / "tandem_api"


def _load_generator():
    spec = importlib.util.spec_from_file_location("tandem_protos_generate", REPO / "protos" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stub_files(root: pathlib.Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts and p.suffix in (".py", ".pyi")
    }


def test_committed_stubs_match_the_protos(tmp_path: pathlib.Path) -> None:
    _load_generator().generate(tmp_path)
    fresh, committed = _stub_files(tmp_path), _stub_files(COMMITTED)
    assert fresh, "protos/generate.py produced no stubs"
    missing = sorted(set(fresh) - set(committed))
    extra = sorted(set(committed) - set(fresh))
    differ = sorted(name for name in set(fresh) & set(committed) if fresh[name] != committed[name])
    assert not (missing or extra or differ), (
        f"tandem_api/ is stale: run `make protos` and commit the result "
        f"(missing: {missing}, without a .proto: {extra}, different: {differ})"
    )


def test_public_services_are_in_the_stubs() -> None:
    from tandem_api.tandem.v1 import admin_pb2, generate_pb2

    services = generate_pb2.DESCRIPTOR.services_by_name
    assert set(services["Generation"].methods_by_name) == {"Generate", "ListModels"}
    assert services["Generation"].methods_by_name["Generate"].server_streaming
    assert set(admin_pb2.DESCRIPTOR.services_by_name["Admin"].methods_by_name) == {"Status", "Scale"}
