"""Render and lint the chart with the real Helm engine (helm-python-sdk: Helm's Go SDK behind a C ABI, no binary).

A `Rendering` is what `helm template` would print for one values set, parsed: the manifests as Kubernetes
objects (plain mappings, as every Kubernetes tool sees them), the NOTES text and the values Helm used after
merging the chart's defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python
import yaml

CHART_DIR = Path(__file__).resolve().parents[2] / "helm" / "tandem"
RELEASE = "demo"
NAMESPACE = "llm"

Manifest = dict[str, Any]  # one Kubernetes object as parsed YAML


def object_name(doc: Manifest) -> str:
    """Kind/name, the way kubectl names an object in messages."""
    return f"{doc.get('kind', '?')}/{(doc.get('metadata') or {}).get('name', '?')}"


@dataclass(frozen=True)
class Rendering:
    label: str  # which values set, for messages
    release: str
    namespace: str
    values: dict[str, Any]  # the chart defaults merged with the user's values, as Helm saw them
    manifests: tuple[Manifest, ...]  # regular objects
    hooks: tuple[Manifest, ...]  # objects with a helm.sh/hook annotation (the test Pod)
    notes: str

    def objects(self, kind: str) -> list[Manifest]:
        return [m for m in self.manifests if m.get("kind") == kind]

    def one(self, kind: str) -> Manifest:
        found = self.objects(kind)
        if len(found) != 1:
            raise LookupError(f"{self.label}: expected one {kind}, found {len(found)}")
        return found[0]


def load_values_file(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a values file must be a mapping, got {type(data).__name__}")
    return data


def render(
    values: dict[str, Any] | None = None,
    *,
    label: str = "defaults",
    chart_dir: Path = CHART_DIR,
    release: str = RELEASE,
    namespace: str = NAMESPACE,
) -> Rendering:
    """Render like `helm template`; raises helm_python.HelmValuesError (schema) or HelmRenderError (template)."""
    with helm_python.Chart.load(chart_dir) as chart:
        merged = chart.merge_values(values or {})
        files = chart.render(values or {}, name=release, namespace=namespace, is_install=True)
    manifests: list[Manifest] = []
    hooks: list[Manifest] = []
    notes = ""
    for path, text in sorted(files.items()):
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        for doc in yaml.safe_load_all(text):
            if doc is None:
                continue
            if not isinstance(doc, dict) or "kind" not in doc:
                raise ValueError(f"{label}: {path} rendered something that is not a Kubernetes object")
            is_hook = "helm.sh/hook" in (doc.get("metadata", {}).get("annotations") or {})
            (hooks if is_hook else manifests).append(doc)
    return Rendering(label, release, namespace, merged, tuple(manifests), tuple(hooks), notes)


def lint(values: dict[str, Any] | None = None, chart_dir: Path = CHART_DIR) -> list[str]:
    """`helm lint --strict` findings at warning level or worse (info, such as 'icon is recommended', is kept out)."""
    report = helm_python.lint(chart_dir, values or {}, strict=True, namespace=NAMESPACE)
    found = [
        f"{m['path']}: {m['error'].strip()}" for m in report.get("messages", []) if m.get("severity", 0) >= 2
    ]
    found += [e.strip() for e in report.get("errors", []) if e.strip() not in " ".join(found)]
    return found
