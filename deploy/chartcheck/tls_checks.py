"""TLS in the rendered chart: every certificate file the Tandem config names is mounted from a Secret, with that
file in it, in every pod that reads it (routers and the Ray head: all of them, since loading the config checks
each; Ray workers: the cluster ones); the routers' probes and the helm test speak TLS when the routers do; and
cert-manager's Certificates fill the Secrets the pods mount, for the names the clients check."""

from __future__ import annotations

import posixpath
import shlex
from typing import Any

from deploy.chartcheck.render import Manifest, Rendering
from deploy.config import DeployConfig
from deploy.tls import TLSSettings

TLS_ENV = ("TANDEM_TLS_CA", "TANDEM_TLS_CERT", "TANDEM_TLS_KEY")


def tls_files(tls: TLSSettings, *, router: bool) -> list[tuple[str, str]]:
    """(config field, path) of every file a pod must see: the router's (when `router`) and the cluster's."""
    found = []
    if router and tls.router is not None:
        found += [("tls.router.cert", tls.router.cert), ("tls.router.key", tls.router.key)]
        if tls.router.client_ca:
            found.append(("tls.router.client_ca", tls.router.client_ca))
    if tls.cluster is not None:
        c = tls.cluster
        found += [("tls.cluster.ca", c.ca), ("tls.cluster.cert", c.cert), ("tls.cluster.key", c.key)]
    return found


def secret_files(template: Manifest, container: dict[str, Any]) -> dict[str, str]:
    """path -> Secret name, for every file the container sees from a Secret volume (items listed, or none)."""
    volumes = {v["name"]: v["secret"] for v in template["spec"].get("volumes") or [] if "secret" in v}
    found = {}
    for mount in container.get("volumeMounts") or []:
        secret = volumes.get(mount["name"])
        if secret is None or mount.get("subPath"):
            continue
        for item in secret.get("items") or []:
            found[posixpath.join(mount["mountPath"], item["path"])] = secret["secretName"]
    return found


def _pods(r: Rendering) -> list[tuple[str, Manifest, bool]]:
    """(description, pod template, reads the whole config) of the pods that use TLS files."""
    router = next(d for d in r.objects("Deployment") if d["metadata"]["name"].endswith("-router"))
    cluster = r.one("RayCluster")["spec"]
    pods = [
        ("router", router["spec"]["template"], True),
        ("Ray head", cluster["headGroupSpec"]["template"], True),
    ]
    pods += [
        (f"worker group {g['groupName']}", g["template"], False) for g in cluster.get("workerGroupSpecs", [])
    ]
    return pods


def check_tls_mounts(r: Rendering, config: DeployConfig) -> list[str]:
    found = []
    for what, template, reads_config in _pods(r):
        seen = secret_files(template, template["spec"]["containers"][0])
        for field, path in tls_files(config.tls, router=reads_config):
            if path not in seen:
                found.append(f"{what} does not see {field} {path} (no Secret volume mounted with that file)")
    return found


def _probe_env(command: list[str]) -> dict[str, str]:
    """The VAR=value words of an `env VAR=value ... python -c ...` command."""
    if not command or command[0] != "env":
        return {}
    return dict(word.split("=", 1) for word in command[1:] if "=" in word and not word.startswith("-"))


def check_tls_probes(r: Rendering, config: DeployConfig) -> list[str]:
    """With TLS routers: startup/readiness run the health check over TLS against the router's port with the
    cluster certificate (the kubelet's gRPC probe has no TLS), and the helm test Pod does the same."""
    if config.tls.router is None or config.tls.cluster is None:
        return []
    router = next(d for d in r.objects("Deployment") if d["metadata"]["name"].endswith("-router"))
    container = router["spec"]["template"]["spec"]["containers"][0]
    want = {"TANDEM_TLS_CA": config.tls.cluster.ca, "TANDEM_TLS_CERT": config.tls.cluster.cert}
    want["TANDEM_TLS_KEY"] = config.tls.cluster.key
    found = []
    for probe in ("startupProbe", "readinessProbe"):
        command = (container.get(probe) or {}).get("exec", {}).get("command") or []
        env = _probe_env(command)
        if env.get("TANDEM_ROUTER") != f"127.0.0.1:{config.router.port}" or "python" not in command:
            found.append(f"router {probe} must run the health check against 127.0.0.1:{config.router.port}")
        if any(env.get(k) != v for k, v in want.items()):
            found.append(f"router {probe} must use the cluster certificate: {shlex.join(command[:6])}")
    hook = next(h for h in r.hooks if h["metadata"]["annotations"].get("helm.sh/hook") == "test")
    hook_container = hook["spec"]["containers"][0]
    hook_env = {e["name"]: e.get("value") for e in hook_container.get("env", [])}
    if any(hook_env.get(k) != v for k, v in want.items()):
        found.append("helm test Pod must dial the routers with the cluster certificate (TANDEM_TLS_*)")
    seen = secret_files(hook, hook_container)
    found += [f"helm test Pod does not see {path}" for path in want.values() if path not in seen]
    return found


def check_certificates(r: Rendering, config: DeployConfig) -> list[str]:
    """cert-manager Certificates: their Secrets are the ones pods mount; the router's names cover the router
    Service and the host the controller dials; the cluster one is for servers and clients, for server_name."""
    certificates = r.objects("Certificate")
    if not certificates:
        return []
    mounted = {s for _, t, _ in _pods(r) for s in secret_files(t, t["spec"]["containers"][0]).values()}
    found = []
    for cert in certificates:
        spec, name = cert["spec"], cert["metadata"]["name"]
        if spec.get("secretName") not in mounted:
            found.append(f"Certificate {name} fills Secret {spec.get('secretName')}, which no pod mounts")
        if not spec.get("issuerRef", {}).get("name"):
            found.append(f"Certificate {name} has no issuerRef.name")
        names, usages = set(spec.get("dnsNames") or []), set(spec.get("usages") or [])
        if name.endswith("-router"):
            service = next(s for s in r.objects("Service") if s["metadata"]["name"].endswith("-router"))
            dialled = {t.rpartition(":")[0] for t in config.controller.routers}
            missing = ({service["metadata"]["name"]} | dialled) - names
            if missing or "server auth" not in usages:
                found.append(f"Certificate {name} must be a server certificate for {sorted(missing)} too")
        elif config.tls.cluster is None or config.tls.cluster.server_name not in names:
            found.append(f"Certificate {name} must carry the workers' name tls.cluster.server_name")
        elif not {"server auth", "client auth"} <= usages:
            found.append(
                f"Certificate {name} must be usable by servers and clients (server auth, client auth)"
            )
    return found
