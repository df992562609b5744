"""The committed stubs in tandem_api/ must be exactly what protos/generate.py makes from protos/ today, and the
runtime versions pyproject.toml declares must be the ones those stubs accept."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import tomllib

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


# The stubs check the runtime at import: *_pb2_grpc.py refuses a grpcio older than GRPC_GENERATED_VERSION, and
# *_pb2.py (ValidateProtobufRuntimeVersion) a protobuf older than the gencode version in its header.
GRPC_GENERATED = re.compile(r"^GRPC_GENERATED_VERSION = '([0-9.]+)'$", re.M)
PROTOBUF_GENCODE = re.compile(r"^# Protobuf Python Version: ([0-9.]+)$", re.M)
GRPC_PACKAGES = ("grpcio", "grpcio-health-checking", "grpcio-reflection")


def _stub_version(pattern: re.Pattern[str], glob: str) -> str:
    """The one version every stub matching `glob` states (regenerated together, they agree)."""
    found = {p.name: pattern.findall(p.read_text()) for p in (COMMITTED / "tandem" / "v1").glob(glob)}
    versions = {v for vs in found.values() for v in vs}
    assert found and all(len(v) == 1 for v in found.values()) and len(versions) == 1, f"{glob}: {found}"
    return versions.pop()


def _declared_floor(package: str) -> str:
    """The X of `package>=X` in pyproject's [project] dependencies."""
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    specs = [d[len(package) :] for d in dependencies if re.match(rf"{re.escape(package)}\s*[<>=!~,]", d)]
    assert len(specs) == 1, f"pyproject.toml: expected one requirement on {package}, got {specs}"
    floors = re.findall(r">=\s*([0-9.]+)", specs[0])
    assert len(floors) == 1, f"pyproject.toml: {package}{specs[0]} has no single >= bound"
    return str(floors[0])


def test_declared_grpcio_and_protobuf_floors_are_the_stubs_versions() -> None:
    grpc_version = _stub_version(GRPC_GENERATED, "*_pb2_grpc.py")
    gencode_version = _stub_version(PROTOBUF_GENCODE, "*_pb2.py")
    declared = {p: _declared_floor(p) for p in (*GRPC_PACKAGES, "protobuf")}
    expected = {**dict.fromkeys(GRPC_PACKAGES, grpc_version), "protobuf": gencode_version}
    assert declared == expected, (
        "pyproject.toml's floors must be the versions the committed stubs require at import "
        f"(stubs: grpcio {grpc_version}, protobuf {gencode_version}); declared: {declared}"
    )
