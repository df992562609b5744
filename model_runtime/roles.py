"""WorkerRole: what a worker does with its engine. The one spelling of a role inside Tandem.

It lives here, not in the router or the worker packages, because the router, the workers and deploy all need it
and model_runtime is the one package every one of them may import (docs/architecture.md, pyproject.toml's
import-linter contracts). On the wire a role is admin.proto's `WorkerRole`; `wire` and `from_wire` are the only
translation. model_runtime does not load tandem_api, so the numbers are written out here and
tests/unit/test_roles.py checks them against the generated stubs.

The value is the spelling in deploy configs (the pool keys), metrics labels and logs.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:  # the wire type, for annotations only: model_runtime never loads tandem_api
    from tandem_api.tandem.v1.admin_pb2 import WorkerRole as WireRole


class WorkerRole(enum.StrEnum):
    PREFILL = "prefill"  # computes prompts' KV caches and ships them
    DECODE = "decode"  # receives KV caches and generates tokens
    COLOCATED = "colocated"  # both on one engine, no KV transfer

    @property
    def wire(self) -> WireRole:
        """admin.proto's WorkerRole number for this role."""
        return cast("WireRole", _WIRE[self])

    @classmethod
    def from_wire(cls, number: int) -> WorkerRole:
        """The role for admin.proto's WorkerRole `number`; ValueError for UNSPECIFIED (0) or an unknown number."""
        for role, wire in _WIRE.items():
            if wire == number:
                return role
        raise ValueError(f"must be PREFILL, DECODE or COLOCATED, got WorkerRole number {number}")

    @classmethod
    def parse(cls, text: str, where: str = "role") -> WorkerRole:
        """A role from its config spelling; the error names `where` and the allowed values."""
        try:
            return cls(text)
        except ValueError:
            allowed = ", ".join(r.value for r in cls)
            raise ValueError(f"{where}: must be one of {allowed}, got {text!r}") from None


# admin.proto: WORKER_ROLE_UNSPECIFIED = 0, PREFILL = 1, DECODE = 2, COLOCATED = 3.
_WIRE = {WorkerRole.PREFILL: 1, WorkerRole.DECODE: 2, WorkerRole.COLOCATED: 3}
