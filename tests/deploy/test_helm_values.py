"""The Helm chart's values contract, checked by the real Helm engine: the values schema refuses bad input naming
the value, the templates refuse values that disagree with each other, the schema's engine keys are the engine
config's fields, and every value is documented. CPU only, offline. (What a rendering contains:
test_helm_chart.py.)"""

from __future__ import annotations

import json
import re
from dataclasses import fields

import helm_python
import pytest

from deploy.chartcheck import CHART_DIR, lint, render
from deploy.chartcheck.connections import rendered_config
from deploy.config import HANDOFF_TP_SIZES
from model_runtime.config import CacheConfig, DeviceConfig, ParallelConfig, SchedulerConfig

pytestmark = pytest.mark.unit


BAD_VALUES = [
    ({"prefill": {"replicas": "two"}}, "/prefill/replicas"),
    ({"decode": {"replicas": -1}}, "/decode/replicas"),
    ({"prefill": {"gpus": 2}}, "'gpus'"),
    ({"routr": {"replicas": 1}}, "'routr'"),
    ({"mode": "split"}, "/mode"),
    ({"router": {"grpcPort": 70000}}, "/router/grpcPort"),
    ({"transfer": {"kind": "rdma"}}, "/transfer/kind"),
    ({"decode": {"resources": {"limits": {"nvidia.com/gpu": 1}}}}, "'nvidia.com/gpu'"),
    ({"prefill": {"engine": {"cache": {"blockSize": 12}}}}, "/prefill/engine/cache/blockSize"),
    ({"prefill": {"engine": {"cache": {"block_size": 16}}}}, "'block_size'"),
    ({"metrics": {"podMonitor": {"enabled": "yes"}}}, "/metrics/podMonitor/enabled"),
    ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    ({"workers": {"metricsPort": 443}}, "/workers/metricsPort"),  # privileged: the pods run as uid 1000
    ({"workers": {"metricsPort": 40000}}, "/workers/metricsPort"),  # Linux's ephemeral range
    ({"workers": {"metricsPorts": 9465}}, "'metricsPorts'"),
    ({"prefill": {"maxReplicas": 0}}, "/prefill/maxReplicas"),
    ({"ray": {"autoscaling": {"enabled": 1}}}, "/ray/autoscaling/enabled"),
    ({"autoscaler": {"ttftSeconds": 0}}, "/autoscaler/ttftSeconds"),
    ({"autoscaler": {"scaleDownMargin": 1}}, "/autoscaler/scaleDownMargin"),
    ({"autoscaler": {"windowSeconds": 900}}, "/autoscaler/windowSeconds"),
    ({"autoscaler": {"targetTtft": 1}}, "'targetTtft'"),
    ({"router": {"apiKeys": {"secretKey": "../keys"}}}, "/router/apiKeys/secretKey"),
    ({"router": {"apiKeys": {"reloadIntervalSeconds": 0}}}, "/router/apiKeys/reloadIntervalSeconds"),
    ({"colocated": {"engine": {"parallel": {"tensorParallelSize": 0}}}}, "/colocated/engine/parallel"),
    ({"colocated": {"engine": {"parallel": {"tensorParallelSize": 32}}}}, "/colocated/engine/parallel"),
    ({"colocated": {"engine": {"parallel": {"tensor_parallel_size": 2}}}}, "'tensor_parallel_size'"),
]


@pytest.mark.parametrize(("values", "where"), BAD_VALUES)
def test_schema_rejects_bad_values(values: dict, where: str) -> None:
    with pytest.raises(helm_python.HelmValuesError) as err:
        render(values)
    assert where in str(err.value)
    assert any(where in finding for finding in lint(values))


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"mode": "colocated", "colocated": {"replicas": 0}}, "colocated.replicas: mode colocated needs"),
        ({"prefill": {"gpusPerWorker": 0}}, "transfer.kind: nccl needs GPUs"),
        (
            {"prefill": {"gpusPerWorker": 0}, "transfer": {"kinds": ["cuda_ipc", "nccl"]}},
            "transfer.kinds: [cuda_ipc nccl] has no tcp, but prefill.gpusPerWorker is 0",
        ),
        ({"decode": {"engine": {"cache": {"blockSize": 32}}}}, "decode.engine.cache.blockSize: must equal"),
        (
            {"workers": {"metricsPort": 8080}},
            "workers.metricsPort: the prefill pods' worker metrics ports 8080",
        ),
        (
            {"workers": {"metricsPort": 9995}, "decode": {"gpusPerWorker": 8}},
            "workers.metricsPort: the decode pods' worker metrics ports 9995-10002 overlap",
        ),
        (
            {"router": {"apiKeys": {"secretName": "tandem-keys"}}},
            "router.apiKeys.controllerKeySecretName: with API keys on, the routers take the controller's",
        ),
        (
            {"decode": {"maxReplicas": 3}},
            "decode.maxReplicas: 3 pods, above decode.replicas (1), need ray.autoscaling",
        ),
        (
            {
                "prefill": {"replicas": 2, "minReplicas": 3, "maxReplicas": 4},
                "ray": {"autoscaling": {"enabled": True}},
            },
            "prefill.minReplicas / prefill.maxReplicas: must range around prefill.replicas (2), got 3..4",
        ),
        (
            {"prefill": {"gpusPerWorker": 3, "engine": {"parallel": {"tensorParallelSize": 3}}}},
            "prefill.engine.parallel.tensorParallelSize: 3, but a prefill worker hands its KV over rank by rank "
            "only at 1, 2, 4 or 8 devices",
        ),
        (
            {"decode": {"gpusPerWorker": 6, "engine": {"parallel": {"tensorParallelSize": 4}}}},
            "decode.gpusPerWorker: 6 is not a multiple of decode.engine.parallel.tensorParallelSize (4)",
        ),
        (
            {
                "transfer": {"kind": "tcp"},
                "prefill": {"gpusPerWorker": 0, "engine": {"parallel": {"tensorParallelSize": 2}}},
            },
            "prefill.engine.parallel.tensorParallelSize: 2 needs GPUs (one per rank), but prefill.gpusPerWorker is 0",
        ),
        (
            {
                "mode": "colocated",
                "colocated": {"gpusPerWorker": 6, "engine": {"parallel": {"tensorParallelSize": 4}}},
            },
            "colocated.gpusPerWorker: 6 is not a multiple of colocated.engine.parallel.tensorParallelSize (4)",
        ),
        (
            {
                "mode": "colocated",
                "transfer": {"kind": "tcp"},
                "colocated": {"gpusPerWorker": 0, "engine": {"parallel": {"tensorParallelSize": 2}}},
            },
            "colocated.engine.parallel.tensorParallelSize: 2 needs GPUs (one per rank), but "
            "colocated.gpusPerWorker is 0",
        ),
    ],
)
def test_templates_refuse_inconsistent_values(values: dict, message: str) -> None:
    with pytest.raises(helm_python.HelmRenderError, match=re.escape(message)):
        render(values)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_handoff_pools_take_the_tensor_parallel_sizes_the_deploy_config_takes(role: str) -> None:
    """The chart refuses at render time exactly the prefill and decode worker sizes that deploy/config.py refuses
    at parse time (the rank-by-rank KV handoff's sizes), naming the key; colocated pools keep the schema's range."""
    for tp in range(1, 17):
        values = {role: {"gpusPerWorker": tp, "engine": {"parallel": {"tensorParallelSize": tp}}}}
        if tp in HANDOFF_TP_SIZES:
            pool = getattr(rendered_config(render(values, label=f"{role} tp {tp}")), role)
            assert (pool.engine.parallel.tensor_parallel_size, pool.replicas) == (tp, 1)
            continue
        message = f"{role}.engine.parallel.tensorParallelSize: {tp}, but a {role} worker hands its KV over"
        with pytest.raises(helm_python.HelmRenderError, match=re.escape(message)):
            render(values)
    colocated = {"gpusPerWorker": 3, "engine": {"parallel": {"tensorParallelSize": 3}}}
    pool = rendered_config(render({"mode": "colocated", "colocated": colocated})).colocated
    assert pool.engine.parallel.tensor_parallel_size == 3


def test_values_schema_engine_keys_are_the_engine_config_fields() -> None:
    """values.schema.json lists the engine keys in camelCase; each must be a field of the engine dataclasses
    (the template snake_cases them), and every field must be settable."""
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    sections = schema["definitions"]["engine"]["properties"]
    for section, klass in (
        ("cache", CacheConfig),
        ("scheduler", SchedulerConfig),
        ("parallel", ParallelConfig),
        ("device", DeviceConfig),
    ):
        snake = {re.sub(r"(?<!^)([A-Z])", r"_\1", key).lower() for key in sections[section]["properties"]}
        assert snake == {f.name for f in fields(klass)}, section


def test_every_value_is_documented() -> None:
    """Each key in values.yaml has a comment right above it, or sits inside a value documented as a whole
    (`# --` above it, as helm-docs reads it)."""
    undocumented = []
    documented_blocks: list[int] = []  # indents of open `# --` blocks
    previous = ""
    for number, line in enumerate((CHART_DIR / "values.yaml").read_text().splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#") or stripped.startswith("- "):
            previous = stripped or previous
            continue
        indent = len(line) - len(line.lstrip())
        documented_blocks = [i for i in documented_blocks if i < indent]
        if not previous.startswith("#") and not documented_blocks:
            undocumented.append(f"values.yaml:{number}: {stripped}")
        if previous.startswith("# --"):
            documented_blocks.append(indent)
        previous = stripped
    assert undocumented == []
