"""Validation of the chart's custom resources against the KubeRay CRDs' openAPIV3Schema (what kubeconform does).

The schemas are vendored, compacted and gzipped, under kuberay/ (from KubeRay's helm-chart/kuberay-operator/crds,
Apache-2.0; kuberay/SOURCE says which commit), so the check runs offline from a clean clone. Refresh them with
`python -m deploy.chartcheck --import-crd path/to/ray.io_rayclusters.yaml`.

Kubernetes prunes unknown fields instead of rejecting them, so a typo such as `workerGroupSpec` would silently
vanish in a cluster. `strict_schema` closes every object that lists its properties (the same idea as kubeconform
-strict), so such a typo fails here.
"""

from __future__ import annotations

import gzip
import json
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

SCHEMA_DIR = Path(__file__).parent / "kuberay"
# kind -> vendored file; only the served storage version v1 is kept.
RAY_KINDS = {"RayCluster": "rayclusters.v1.json.gz", "RayJob": "rayjobs.v1.json.gz"}
OPEN_KEYS = ("additionalProperties", "x-kubernetes-preserve-unknown-fields")


def extract_v1_schema(crd: dict[str, Any]) -> dict[str, Any]:
    """The openAPIV3Schema of a CRD's v1 version; raises ValueError naming what is missing."""
    kind = crd.get("spec", {}).get("names", {}).get("kind", "?")
    for version in crd.get("spec", {}).get("versions", []):
        if version.get("name") == "v1":
            schema = version.get("schema", {}).get("openAPIV3Schema")
            if isinstance(schema, dict):
                return schema
    raise ValueError(f"CRD {kind}: no v1 version with an openAPIV3Schema")


def load_yaml(path: Path) -> Any:
    """Parse a (large: a CRD is about 1 MB) YAML file, with libyaml's C parser when PyYAML has it."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return yaml.load(path.read_text(), Loader=loader)


def import_crd(crd_path: Path, out_dir: Path = SCHEMA_DIR) -> Path:
    """Write the v1 schema of a CRD YAML file as the vendored gzip file for its kind; returns its path."""
    crd = load_yaml(crd_path)
    kind = crd["spec"]["names"]["kind"]
    if kind not in RAY_KINDS:
        raise ValueError(f"{crd_path}: kind {kind} is not one the chart renders ({', '.join(RAY_KINDS)})")
    out = out_dir / RAY_KINDS[kind]
    text = json.dumps(extract_v1_schema(crd), sort_keys=True, separators=(",", ":"))
    # mtime=0: the same CRD always gives the same bytes, so a refresh shows no spurious diff.
    out.write_bytes(gzip.compress(text.encode(), mtime=0))
    return out


def load_schema(kind: str, schema_dir: Path = SCHEMA_DIR) -> dict[str, Any]:
    schema: dict[str, Any] = json.loads(gzip.decompress((schema_dir / RAY_KINDS[kind]).read_bytes()))
    return schema


def strict_schema(schema: Any) -> Any:
    """A copy where every object with `properties` and no explicit openness rejects unknown keys."""
    if isinstance(schema, list):
        return [strict_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: strict_schema(value) for key, value in schema.items()}
    if "properties" in out and not any(key in out for key in OPEN_KEYS):
        out["additionalProperties"] = False
    return out


@cache
def _validator(kind: str) -> jsonschema.protocols.Validator:
    schema = strict_schema(load_schema(kind))
    # OpenAPI v3 schemas are JSON Schema draft 4/7 in all the keywords the CRDs use.
    return jsonschema.Draft7Validator(schema)


def validate_custom_resource(doc: dict[str, Any]) -> list[str]:
    """Errors of one ray.io/v1 object against its CRD schema, each naming the JSON path."""
    kind = doc.get("kind", "")
    if doc.get("apiVersion") != "ray.io/v1" or kind not in RAY_KINDS:
        return [f"{kind or '?'}: not a ray.io/v1 kind the chart may render ({', '.join(RAY_KINDS)})"]
    errors = sorted(_validator(kind).iter_errors(doc), key=lambda e: list(e.absolute_path))
    return [f"{kind} at /{'/'.join(str(p) for p in e.absolute_path)}: {e.message}" for e in errors]
