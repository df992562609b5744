"""Pool sizes at run time, as the router's Admin service sees them: `Scaler` is what a controller beside the
router offers (deploy.controller.Controller implements it; the router never imports deploy), and the proto
conversion of its answers. A standalone router (Kubernetes) has no Scaler: Admin.Scale answers
FAILED_PRECONDITION there, and ClusterStatus.pools stays empty.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from model_runtime.roles import WorkerRole
from router.errors import invalid
from tandem_api.tandem.v1 import admin_pb2


@dataclass(frozen=True)
class PoolSize:
    """One pool: the size asked for, and where its workers are (ready + starting + draining)."""

    role: WorkerRole
    target: int
    ready: int = 0
    starting: int = 0
    draining: int = 0
    waiting: str = ""  # why starting workers are not placed yet ("" when none waits)

    def to_proto(self) -> admin_pb2.PoolSize:
        return admin_pb2.PoolSize(
            role=self.role.wire,
            target=self.target,
            ready=self.ready,
            starting=self.starting,
            draining=self.draining,
            waiting=self.waiting,
        )


class Scaler(Protocol):
    def scale(self, targets: Mapping[WorkerRole, int]) -> list[PoolSize]:
        """Set these pools' targets (others keep theirs) and return every pool. Raises ValueError with a
        message that names the pool when a target cannot be taken (a pool this deployment does not run)."""
        ...

    def pool_sizes(self) -> list[PoolSize]: ...

    def autoscaler_status(self) -> str:
        """The autoscaler's last decision, for `tandem status` ("" when none runs or none was made)."""
        ...


def targets_from_proto(targets: Sequence[admin_pb2.PoolTarget]) -> dict[WorkerRole, int]:
    """Checked targets; a bad entry raises INVALID_ARGUMENT naming it ("targets[1].role: ...")."""
    result: dict[WorkerRole, int] = {}
    for i, target in enumerate(targets):
        try:
            role = WorkerRole.from_wire(target.role)
        except ValueError as exc:
            raise invalid(f"targets[{i}].role", str(exc)) from None
        if role in result:
            raise invalid(f"targets[{i}].role", f"{role.value} appears twice")
        result[role] = target.replicas
    if not result:
        raise invalid("targets", "name at least one pool to resize")
    return result
