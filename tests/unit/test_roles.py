"""WorkerRole: the one role enum inside Tandem, and its one translation to and from admin.proto's WorkerRole."""

from __future__ import annotations

import pytest

from model_runtime.config import EngineConfig
from model_runtime.roles import WorkerRole
from tandem_api.tandem.v1 import admin_pb2
from worker_host.spec import WorkerSpec

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("role", list(WorkerRole))
def test_wire_numbers_are_admin_protos(role: WorkerRole) -> None:
    number = admin_pb2.WorkerRole.Value(f"WORKER_ROLE_{role.name}")
    assert role.wire == number
    assert WorkerRole.from_wire(number) is role


def test_every_proto_role_but_unspecified_has_one() -> None:
    numbers = {v.number for v in admin_pb2.WorkerRole.DESCRIPTOR.values} - {admin_pb2.WORKER_ROLE_UNSPECIFIED}
    assert {r.wire for r in WorkerRole} == numbers


@pytest.mark.parametrize("number", [admin_pb2.WORKER_ROLE_UNSPECIFIED, 99])
def test_from_wire_rejects_unspecified_and_unknown(number: int) -> None:
    with pytest.raises(ValueError, match="must be PREFILL, DECODE or COLOCATED"):
        WorkerRole.from_wire(number)


def test_the_config_spelling_is_the_value() -> None:
    assert [str(r) for r in WorkerRole] == ["prefill", "decode", "colocated"]
    assert f"{WorkerRole.DECODE}.metrics_port" == "decode.metrics_port"
    with pytest.raises(ValueError, match=r"^pools\.x: must be one of prefill, decode, colocated, got 'x'$"):
        WorkerRole.parse("x", "pools.x")


def test_worker_spec_takes_the_config_spelling() -> None:
    assert WorkerSpec(worker_id="d", role="decode", engine=EngineConfig()).role is WorkerRole.DECODE  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^role: must be one of"):
        WorkerSpec(worker_id="d", role="router", engine=EngineConfig())  # type: ignore[arg-type]
