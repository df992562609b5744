"""Schema validation of every rendered object: built-in kinds with kubernetes-validate (the Kubernetes OpenAPI
schemas, strict: unknown fields are errors), Ray kinds against the KubeRay CRDs. Prometheus Operator kinds have no
schema here; deploy.chartcheck.invariants checks what matters about them (selectors and ports), and
deploy.chartcheck.tls_checks what matters about cert-manager's Certificates (their Secrets, names and issuer)."""

from __future__ import annotations

import kubernetes_validate

from deploy.chartcheck.crds import validate_custom_resource
from deploy.chartcheck.render import Manifest, Rendering, object_name

# The chart's kubeVersion floor (gRPC probes are GA from 1.27) and the newest schemas kubernetes-validate ships.
KUBE_VERSIONS = ("1.27.0", kubernetes_validate.latest_version())
UNCHECKED_GROUPS = ("monitoring.coreos.com/", "cert-manager.io/")


def validate_object(doc: Manifest) -> list[str]:
    api = str(doc.get("apiVersion", ""))
    if api.startswith("ray.io/"):
        return [f"{object_name(doc)}: {e}" for e in validate_custom_resource(doc)]
    if api.startswith(UNCHECKED_GROUPS):
        return []
    errors = []
    for version in KUBE_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = "/".join(str(p) for p in exc.path)
            errors.append(f"{object_name(doc)} (Kubernetes {version}) at /{path}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError:
            errors.append(f"{object_name(doc)}: {api} is not a Kubernetes {version} built-in kind")
    return errors


def validate_rendering(rendering: Rendering) -> list[str]:
    return [e for doc in rendering.manifests + rendering.hooks for e in validate_object(doc)]
