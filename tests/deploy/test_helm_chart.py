"""The Helm chart rendered by the real Helm engine: lint, schemas, invariants, and the Tandem config it carries.
CPU only, offline. (Values it refuses, and the values' documentation: test_helm_values.py.)"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import helm_python
import pytest
import yaml

from deploy.chartcheck import CHART_DIR, check_all, lint, load_values_file, render, validate_rendering
from deploy.chartcheck.connections import config_map, rendered_config
from deploy.chartcheck.objects import group_custom_resources
from deploy.chartcheck.render import Rendering
from model_runtime.roles import WorkerRole

pytestmark = pytest.mark.unit

CI_VALUES = sorted((CHART_DIR / "ci").glob("*.yaml"))
VALUE_SETS = ["defaults", *(p.name for p in CI_VALUES)]


def values_for(name: str) -> dict:
    return {} if name == "defaults" else load_values_file(CHART_DIR / "ci" / name)


@cache
def rendered(name: str) -> Rendering:
    return render(values_for(name), label=name)


def test_chart_metadata_and_layout() -> None:
    meta = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    semver = re.compile(r"^\d+\.\d+\.\d+(-[0-9A-Za-z.-]+)?(\+[0-9A-Za-z.-]+)?$")
    assert meta["apiVersion"] == "v2" and meta["type"] == "application"
    assert semver.match(meta["version"]) and semver.match(meta["appVersion"])
    assert meta["name"] == CHART_DIR.name
    # The KubeRay operator is a prerequisite, never vendored: no CRDs and no subcharts in the chart.
    assert not (CHART_DIR / "crds").exists() and not meta.get("dependencies")
    assert (CHART_DIR / "templates" / "NOTES.txt").is_file()


@pytest.mark.parametrize("name", VALUE_SETS)
def test_helm_lint_strict(name: str) -> None:
    assert lint(values_for(name)) == []


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_object_validates_against_its_schema(name: str) -> None:
    assert validate_rendering(rendered(name)) == []


@pytest.mark.parametrize("name", VALUE_SETS)
def test_invariants_hold(name: str) -> None:
    assert check_all(rendered(name)) == []


def test_default_rendering_has_every_part() -> None:
    r = rendered("defaults")
    kinds = sorted(m["kind"] for m in r.manifests)
    assert kinds == ["ConfigMap", "Deployment", "RayCluster", "RayJob", "Service", "Service"]
    assert [h["kind"] for h in r.hooks] == ["Pod"]
    assert "helm test demo" in r.notes and "WARNING" not in r.notes


def test_the_openai_http_port_is_served_exposed_and_can_be_turned_off() -> None:
    r = rendered("defaults")
    service = next(s for s in r.objects("Service") if s["metadata"]["name"].endswith("-router"))
    http = {p["name"]: p for p in service["spec"]["ports"]}["http"]
    assert (http["port"], http["targetPort"], http["appProtocol"]) == (8000, "http", "http")
    assert rendered_config(r).router.http_port == 8000
    assert "/v1/completions" in r.notes
    off = render({"router": {"httpPort": 0}}, label="http off")
    assert rendered_config(off).router.http_port == 0
    assert check_all(off) == []
    for service in off.objects("Service"):
        assert "http" not in {p["name"] for p in service["spec"]["ports"]}
    assert "/v1/completions" not in off.notes


def test_api_keys_come_from_a_secret_mounted_as_a_directory_on_the_routers() -> None:
    assert rendered_config(rendered("defaults")).router.auth.api_keys_file == ""  # off by default
    keys = {
        "secretName": "tandem-keys",
        "reloadIntervalSeconds": 5,
        "controllerKeySecretName": "tandem-admin",
    }
    r = render({"router": {"apiKeys": keys}}, label="keys")
    assert check_all(r) == [] and validate_rendering(r) == []
    auth = rendered_config(r).router.auth
    assert (auth.api_keys_file, auth.reload_interval_s) == ("/etc/tandem-keys/api_keys.yaml", 5)
    spec = next(d for d in r.objects("Deployment") if d["metadata"]["name"].endswith("-router"))["spec"]
    pod = spec["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "api-keys")
    assert volume["secret"]["secretName"] == "tandem-keys"
    assert volume["secret"]["items"] == [{"key": "api_keys.yaml", "path": "api_keys.yaml"}]
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "api-keys")
    # a subPath mount would never see an edited Secret, and the reload would never happen
    assert mount == {"name": "api-keys", "mountPath": "/etc/tandem-keys", "readOnly": True}


def test_the_controller_pushes_with_an_admin_key_mounted_on_the_ray_head() -> None:
    keys = {"secretName": "tandem-keys", "controllerKeySecretName": "tandem-admin"}
    r = render({"router": {"apiKeys": keys}}, label="controller key")
    assert check_all(r) == [] and validate_rendering(r) == []
    assert rendered_config(r).controller.admin_key_file == "/etc/tandem-controller-key/admin.key"
    head = r.objects("RayCluster")[0]["spec"]["headGroupSpec"]["template"]["spec"]
    volume = next(v for v in head["volumes"] if v["name"] == "controller-key")
    assert volume["secret"]["secretName"] == "tandem-admin"
    assert volume["secret"]["items"] == [{"key": "admin.key", "path": "admin.key"}]
    mount = next(m for m in head["containers"][0]["volumeMounts"] if m["name"] == "controller-key")
    assert mount == {"name": "controller-key", "mountPath": "/etc/tandem-controller-key", "readOnly": True}
    assert rendered_config(rendered("defaults")).controller.admin_key_file == ""


def test_monitoring_values_add_monitors_and_dashboard() -> None:
    r = rendered("monitoring-values.yaml")
    assert len(r.objects("ServiceMonitor")) == 1
    # Ray's metrics agent on every Ray pod, and each pool's workers on their own ports.
    assert sorted(m["metadata"]["name"] for m in r.objects("PodMonitor")) == [
        "demo-tandem-decode",
        "demo-tandem-prefill",
        "demo-tandem-ray",
    ]
    for monitor in r.objects("ServiceMonitor") + r.objects("PodMonitor"):
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert monitor["metadata"]["labels"]["release"] == "prometheus"
    dashboards = [c for c in r.objects("ConfigMap") if "grafana_dashboard" in c["metadata"]["labels"]]
    assert len(dashboards) == 1 and dashboards[0]["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboards[0]["data"]["tandem.json"] == (CHART_DIR / "dashboards" / "tandem.json").read_text()
    assert "TLS" not in r.notes  # plaintext: no TLS note


def test_tandem_targets_carry_the_job_and_component_the_alert_rules_select() -> None:
    """deploy/prometheus/alerts.yml selects up{job="tandem"} and names the component: the router's and the
    workers' monitors must give their targets those labels, as the local scrape config does."""
    alerts = (Path(__file__).parents[2] / "deploy" / "prometheus" / "alerts.yml").read_text()
    assert 'job="tandem"' in alerts
    r = rendered("monitoring-values.yaml")
    tandem_monitors = r.objects("ServiceMonitor") + [
        m for m in r.objects("PodMonitor") if not m["metadata"]["name"].endswith("-ray")
    ]
    for monitor in tandem_monitors:
        endpoints = monitor["spec"].get("endpoints") or monitor["spec"]["podMetricsEndpoints"]
        for endpoint in endpoints:
            targets = {rule["targetLabel"]: rule for rule in endpoint["relabelings"]}
            assert targets["job"].get("replacement") == "tandem", monitor["metadata"]["name"]
            assert "component" in targets, monitor["metadata"]["name"]


def test_fp8_device_values_reach_the_config_the_pods_load() -> None:
    """FP8 projections with the promoted accumulation on the decode pool only: camelCase values become the
    engine's device keys, per pool, and the other pool keeps the defaults."""
    device = {"quantization": "fp8", "fp8FastAccum": False}
    config = rendered_config(render({"decode": {"engine": {"device": device}}}, label="fp8"))
    assert (config.decode.engine.device.quantization, config.decode.engine.device.fp8_fast_accum) == (
        "fp8",
        False,
    )
    assert (config.prefill.engine.device.quantization, config.prefill.engine.device.fp8_fast_accum) == (
        "none",
        True,
    )


def test_the_decode_gather_limit_reaches_the_config_the_pods_load() -> None:
    config = rendered_config(
        render({"decode": {"engine": {"device": {"decodeGatherTokens": 0}}}}, label="dg")
    )
    assert config.decode.engine.device.decode_gather_tokens == 0
    assert config.prefill.engine.device.decode_gather_tokens == 8192, "the other pool keeps the default"
    with pytest.raises(helm_python.HelmValuesError, match="decodeGatherTokens"):  # the schema: >= 0
        render({"colocated": {"engine": {"device": {"decodeGatherTokens": -1}}}}, label="dg-bad")


def test_multi_gpu_values_map_onto_groups_and_pools() -> None:
    r = rendered("multi-gpu-values.yaml")
    groups = {g["groupName"]: g for g in r.one("RayCluster")["spec"]["workerGroupSpecs"]}
    prefill = groups["prefill"]["template"]["spec"]["containers"][0]
    assert prefill["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert groups["prefill"]["rayStartParams"] == {"num-gpus": "4", "resources": '"{\\"tandem_prefill\\":4}"'}
    assert groups["decode"]["rayStartParams"]["num-gpus"] == "8"
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in prefill["volumeMounts"]
    config = rendered_config(r)
    # One engine per GPU: 2 pods x 4 GPUs of prefill, 1 pod x 8 GPUs of decode.
    assert (config.prefill.replicas, config.prefill.num_gpus) == (8, 1)
    assert (config.decode.replicas, config.decode.num_gpus) == (8, 1)
    assert config.prefill.ray_resources == {"tandem_prefill": 1}
    assert (
        config.decode.engine.cache.block_size == 32
        and config.decode.engine.cache.enable_prefix_caching is False
    )
    assert config.prefill.engine.scheduler.max_model_len == 8192
    assert config.prefill.engine.device.attention_backend == "triton"
    assert config.model == "/models/Meta-Llama-3.1-8B-Instruct"
    assert (config.router.port, config.router.metrics_port, config.router.request_timeout_s) == (
        8443,
        9000,
        120.5,
    )
    assert config.controller.routers == ("demo-tandem-router-headless.llm.svc:8443",)
    assert config.transfer.kinds == ("cuda_ipc", "nccl") and config.transfer.transfer_timeout_s == 60


def test_cpu_values_have_no_gpus_and_use_tcp() -> None:
    r = rendered("cpu-values.yaml")
    for group in r.one("RayCluster")["spec"]["workerGroupSpecs"]:
        assert "nvidia.com/gpu" not in group["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert group["rayStartParams"]["num-gpus"] == "0"
    config = rendered_config(r)
    assert config.transfer.kind == "tcp"
    assert (config.decode.replicas, config.decode.num_gpus) == (2, 0)
    assert config.decode.engine.cache.cpu_cache_bytes == 268435456  # a large int survives Helm's float values


def test_colocated_values_run_one_pool() -> None:
    r = rendered("colocated-values.yaml")
    groups = [g["groupName"] for g in r.one("RayCluster")["spec"]["workerGroupSpecs"]]
    assert groups == ["colocated"]
    config = rendered_config(r)
    assert config.mode == "colocated" and list(config.pools()) == ["colocated"]
    assert (config.colocated.replicas, config.colocated.ray_resources) == (4, {"tandem_colocated": 1})


def test_default_config_equals_the_gpu_disaggregated_example() -> None:
    """The chart's defaults carry the same engine settings as deploy/configs/gpu-disaggregated.yaml."""
    example = yaml.safe_load(
        (CHART_DIR.parents[1] / "deploy" / "configs" / "gpu-disaggregated.yaml").read_text()
    )
    config = rendered_config(rendered("defaults"))
    for role in ("prefill", "decode"):
        engine = getattr(config, role).engine
        for section, settings in example[role]["engine"].items():
            for key, value in settings.items():
                assert getattr(getattr(engine, section), key) == value, f"{role}.engine.{section}.{key}"
    assert config.transfer.kind == example["transfer"]["kind"]


@pytest.mark.parametrize("name", VALUE_SETS)
def test_worker_pods_expose_and_the_pod_monitor_scrapes_the_config_metrics_ports(name: str) -> None:
    """The number in the config, the pods' named container ports and the PodMonitor endpoints are one range."""
    r = render({**values_for(name), "metrics": {"podMonitor": {"enabled": True}}}, label=name)
    config = rendered_config(r)
    groups = {g["groupName"]: g for g in r.one("RayCluster")["spec"]["workerGroupSpecs"]}
    monitors = {m["metadata"]["name"]: m for m in r.objects("PodMonitor")}
    for role, pool in config.pools().items():
        tp = r.values[role]["engine"].get("parallel", {}).get("tensorParallelSize", 1)
        per_pod = max(1, r.values[role]["gpusPerWorker"]) // tp  # one port per worker: its rank 0 serves
        assert (pool.metrics_port, pool.metrics_port_count) == (9465, per_pod), role
        ports = groups[role]["template"]["spec"]["containers"][0]["ports"]
        want = [{"name": f"w{i}-metrics", "containerPort": 9465 + i} for i in range(per_pod)]
        assert [p for p in ports if p["name"] != "metrics"] == want, role
        monitor = monitors[f"demo-tandem-{role}"]["spec"]
        assert [e["port"] for e in monitor["podMetricsEndpoints"]] == [w["name"] for w in want]
        assert monitor["selector"]["matchLabels"]["app.kubernetes.io/component"] == role
    head_ports = r.one("RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"]
    assert not [p for p in head_ports if re.fullmatch(r"w\d+-metrics", p["name"])]  # no worker on the head
    assert check_all(r) == []


def test_autoscaling_values_let_the_groups_range_and_carry_the_slo_autoscaler() -> None:
    r = rendered("autoscaler-values.yaml")
    spec = r.one("RayCluster")["spec"]
    assert spec["enableInTreeAutoscaling"] is True and spec["autoscalerOptions"] == {
        "idleTimeoutSeconds": 120
    }
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    assert [(g["replicas"], g["minReplicas"], g["maxReplicas"]) for g in groups.values()] == [
        (1, 1, 3),
        (2, 1, 3),
    ]
    config = rendered_config(r)
    a = config.autoscaler
    assert a.enabled and (a.ttft_s, a.tpot_s, a.max_total_workers) == (0.5, 0.025, 8)
    assert (a.prefill.min, a.prefill.max, a.decode.min, a.decode.max) == (
        2,
        6,
        2,
        6,
    )  # workers: pods * 2 GPUs
    assert (config.prefill.replicas, config.decode.replicas) == (2, 4)
    head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"]
    assert {"name": "tandem-metrics", "containerPort": 9464} in head
    monitor = next(m for m in r.objects("PodMonitor") if m["metadata"]["name"] == "demo-tandem-controller")
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["tandem-metrics"]
    assert monitor["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "head"
    defaults = rendered("defaults").one("RayCluster")["spec"]
    assert defaults["enableInTreeAutoscaling"] is False and "autoscalerOptions" not in defaults
    assert rendered_config(rendered("defaults")).autoscaler.enabled is False


def test_tensor_parallel_values_run_workers_of_several_gpus_per_pod() -> None:
    """8 GPUs a pod, 2 per worker: 4 workers a pod, each asking one GPU and one tandem_colocated unit per rank,
    so a pod advertises 8 units (devices), not 4 (workers), and exposes 4 metrics ports (one per rank 0)."""
    r = rendered("tensor-parallel-values.yaml")
    assert r.values["colocated"]["gpusPerWorker"] == 8
    assert r.values["colocated"]["engine"]["parallel"] == {"tensorParallelSize": 2, "allReduce": "nccl"}
    group = r.one("RayCluster")["spec"]["workerGroupSpecs"]
    assert [g["groupName"] for g in group] == ["colocated"]
    pods = group[0]["replicas"]
    container = group[0]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert group[0]["rayStartParams"] == {"num-gpus": "8", "resources": '"{\\"tandem_colocated\\":8}"'}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {
        "metrics": 8080,
        "w0-metrics": 9465,
        "w1-metrics": 9466,
        "w2-metrics": 9467,
        "w3-metrics": 9468,
    }
    config = rendered_config(r)
    pool = config.colocated
    assert pool.engine.parallel.tensor_parallel_size == 2
    assert pool.engine.parallel.all_reduce == "nccl"  # the chart's camelCase key reaches the engine config
    assert (pool.replicas, pool.num_gpus, pool.ray_resources) == (pods * 4, 1, {"tandem_colocated": 1})
    assert (pool.metrics_port, pool.metrics_port_count) == (9465, 4)
    bounds = config.autoscaler.bounds(
        WorkerRole.COLOCATED
    )  # workers of minReplicas (replicas)..maxReplicas pods
    assert (bounds.min, bounds.max) == (pods * 4, 3 * 4)
    monitor = next(m for m in r.objects("PodMonitor") if m["metadata"]["name"] == "demo-tandem-colocated")
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == [f"w{i}-metrics" for i in range(4)]
    assert "(workers of 2 GPUs)" in r.notes


def test_disagg_tensor_parallel_values_give_each_phase_its_own_worker_width() -> None:
    """8-GPU pods in both groups: prefill workers of 4 ranks (2 a pod), decode workers of 2 ranks (4 a pod,
    1..2 pods). Each group advertises one unit per device, the pools count workers, and KV moves over nccl only
    (the router never offers cuda_ipc between workers of different sizes)."""
    r = rendered("disagg-tensor-parallel-values.yaml")
    groups = {g["groupName"]: g for g in r.one("RayCluster")["spec"]["workerGroupSpecs"]}
    assert sorted(groups) == ["decode", "prefill"]
    for role, pods in (("prefill", (1, 1)), ("decode", (1, 2))):
        group = groups[role]
        assert (group["replicas"], group["maxReplicas"]) == pods, role
        assert group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8, role
        assert group["rayStartParams"]["num-gpus"] == "8", role
        assert group_custom_resources(group) == {f"tandem_{role}": 8}, role  # one unit per device
    assert groups["decode"]["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    config = rendered_config(r)
    assert config.model == "/models/Meta-Llama-3.1-70B-Instruct"
    # replicas count the workers of the group's pods at start; num_gpus and ray_resources are per rank
    for pool, tp, per_pod in ((config.prefill, 4, 2), (config.decode, 2, 4)):
        assert pool.engine.parallel.tensor_parallel_size == tp
        assert pool.engine.parallel.all_reduce == "nccl"
        assert (pool.replicas, pool.num_gpus, pool.metrics_port_count) == (per_pod, 1, per_pod)
    assert config.prefill.ray_resources == {"tandem_prefill": 1}
    assert config.decode.ray_resources == {"tandem_decode": 1}
    assert config.transfer.kinds == ("nccl",)
    bounds = [config.autoscaler.bounds(role) for role in (WorkerRole.PREFILL, WorkerRole.DECODE)]
    assert [(b.min, b.max) for b in bounds] == [(2, 2), (4, 8)]  # workers: pods x workers a pod
    assert (
        "1 prefill pod(s) x 8 GPU (workers of 4 GPUs), 1 decode pod(s) x 8 GPU (workers of 2 GPUs)" in r.notes
    )


@pytest.mark.parametrize(("base", "role"), [("defaults", "prefill"), ("colocated-values.yaml", "colocated")])
def test_tensor_parallel_size_1_renders_as_before(base: str, role: str) -> None:
    """Setting the default explicitly changes nothing: the config carries no `parallel` section (its checksum
    rolls the routers and the controller), and pods, resources and ports stay one worker per GPU."""
    values = values_for(base)
    pool = values.get(role, {})
    explicit = {**pool, "engine": {**pool.get("engine", {}), "parallel": {"tensorParallelSize": 1}}}
    assert render({**values, role: explicit}).manifests == rendered(base).manifests
    assert "parallel" not in config_map(rendered(base))["data"]["tandem.yaml"]
    assert getattr(rendered_config(rendered(base)), role).engine.parallel.tensor_parallel_size == 1


def test_workers_metrics_port_moves_the_whole_range() -> None:
    r = render({"workers": {"metricsPort": 20100}, "prefill": {"gpusPerWorker": 2}})
    config = rendered_config(r)
    assert (config.prefill.metrics_port, config.prefill.metrics_port_count) == (20100, 2)
    assert (config.decode.metrics_port, config.decode.metrics_port_count) == (20100, 1)
    prefill = next(g for g in r.one("RayCluster")["spec"]["workerGroupSpecs"] if g["groupName"] == "prefill")
    ports = {p["name"]: p["containerPort"] for p in prefill["template"]["spec"]["containers"][0]["ports"]}
    assert ports == {"metrics": 8080, "w0-metrics": 20100, "w1-metrics": 20101}
    assert check_all(r) == []
