"""No module reachable from a socket deserializes with pickle (peers' remote-code CVEs came through pickled
messages on internal sockets). What crosses Tandem's network is protobuf, JSON and raw KV bytes.

The check walks the import graph (grimp, the library behind import-linter) from every module that opens or
serves a socket, and reads each reachable module of this repository for:
    an import of pickle, _pickle, cPickle, cloudpickle, dill, marshal, shelve or jsonpickle
    torch.load(...) without weights_only=True, numpy.load(..., allow_pickle=True)
    yaml.load with a loader other than a Safe one, yaml.unsafe_load / full_load / load_all with one
Ray pickles actor arguments on its own channel (cluster-internal, behind Ray's token auth: docs/operations.md,
Security); that is Ray's code, not a module here, and deploy never unpickles anything it receives itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

import grimp
import pytest

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]
PACKAGES = (
    "model_runtime", "kv_transfer", "worker_host", "prefill_worker", "decode_worker", "router", "deploy",
    "tandem_api", "tandem_client", "tandem_cli",
)  # fmt: skip
PICKLERS = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve", "jsonpickle"}
# Modules that import one of these talk to the network (listen, dial or read a socket).
NETWORK = {"socket", "grpc", "aiohttp", "http", "urllib", "ssl", "asyncio", "ray", "prometheus_client"}
SAFE_YAML_LOADERS = {"SafeLoader", "CSafeLoader", "BaseLoader", "CBaseLoader"}


def _graph() -> grimp.ImportGraph:
    return grimp.build_graph(*PACKAGES, include_external_packages=True)


def _ours(module: str) -> bool:
    return module.split(".")[0] in PACKAGES


def network_modules(graph: grimp.ImportGraph) -> set[str]:
    """This repository's modules that import a networking library directly."""
    return {
        m
        for m in graph.modules
        if _ours(m) and {d.split(".")[0] for d in graph.find_modules_directly_imported_by(m)} & NETWORK
    }


def reachable(graph: grimp.ImportGraph, roots: set[str]) -> set[str]:
    """`roots` and every module of this repository they import, directly or not."""
    found = set(roots)
    for root in roots:
        found |= {m for m in graph.find_upstream_modules(root) if _ours(m)}
    return found


def _source(module: str) -> Path:
    base = REPO.joinpath(*module.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_true(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def unsafe_deserialization(source: str) -> list[str]:
    """What in `source` could turn received bytes into objects by running code: one line per finding."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"line {node.lineno}: imports {n}" for n in names if n.split(".")[0] in PICKLERS]
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        where = f"line {node.lineno}: {name}"
        if name == "torch.load" and not _is_true(_keyword(node, "weights_only")):
            found.append(f"{where} without weights_only=True")
        if name in ("np.load", "numpy.load") and _is_true(_keyword(node, "allow_pickle")):
            found.append(f"{where} with allow_pickle=True")
        if name in ("yaml.unsafe_load", "yaml.full_load", "yaml.unsafe_load_all", "yaml.full_load_all"):
            found.append(where)
        if name in ("yaml.load", "yaml.load_all"):
            loader = _keyword(node, "Loader") or (node.args[1] if len(node.args) > 1 else None)
            if _dotted(loader).split(".")[-1] not in SAFE_YAML_LOADERS if loader is not None else True:
                found.append(f"{where} without a Safe loader")
    return found


def test_no_module_reachable_from_a_socket_deserializes_with_pickle() -> None:
    graph = _graph()
    roots = network_modules(graph)
    # the doors this must cover: if one stops importing a network library, the walk must still start there
    for door in ("router.server", "router.openai_api.server", "worker_host.host", "deploy.publish",
                 "tandem_client.client", "tandem_client.aio"):  # fmt: skip
        assert door in roots, f"{door} no longer imports a network library: update NETWORK or this list"
    assert any(m.startswith("kv_transfer.") for m in roots), "the KV transfer's sockets are not covered"
    modules = reachable(graph, roots)
    assert {"model_runtime.engine", "prefill_worker.worker", "decode_worker.worker"} <= modules
    findings = {m: f for m in sorted(modules) if (f := unsafe_deserialization(_source(m).read_text()))}
    assert not findings, f"unsafe deserialization in modules reachable from a socket: {findings}"


@pytest.mark.parametrize(
    "snippet",
    [
        "import pickle\npickle.loads(data)",
        "from cloudpickle import loads",
        "import marshal",
        "torch.load(path)",
        "torch.load(path, weights_only=False)",
        "np.load(f, allow_pickle=True)",
        "yaml.load(text)",
        "yaml.load(text, Loader=yaml.Loader)",
        "yaml.unsafe_load(text)",
    ],
)
def test_the_check_finds_unsafe_deserialization(snippet: str) -> None:
    assert unsafe_deserialization(snippet), snippet


def test_the_check_passes_safe_loaders() -> None:
    safe = "torch.load(p, weights_only=True)\nnp.load(f)\nyaml.safe_load(t)\nyaml.load(t, Loader=yaml.CSafeLoader)"
    assert unsafe_deserialization(safe) == []
