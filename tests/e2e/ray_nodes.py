"""A Ray cluster of several nodes on one machine, for the multi-node e2e test (test_multinode.py): a head
(tests/e2e/ray_head.RayHead on 127.0.0.2) and nodes that join it with `ray start --address`, each on its own
loopback address (127.0.0.3, ...) with its own ports, temp dir and custom resources, so that pools can be
pinned to chosen nodes. A node is lost by killing its raylet, as when its machine goes away.

Like RayHead, nothing here runs `ray stop` (it would stop every Ray on the machine): each node is stopped
through its own `ray start --block` process, and its leftovers are found by its process session.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import psutil

from tests.e2e.ray_head import RAY_PORT_FLAGS, RayHead, ray_cli
from tests.loopback import free_ports

# The flags a joining node takes: the head's, less the GCS, dashboard and client server ports only a head has.
NODE_PORT_FLAGS = tuple(
    f for f in RAY_PORT_FLAGS if f not in ("--port", "--dashboard-port", "--ray-client-server-port")
)
# Ray's defaults mark a node dead after 5 missed GCS health checks 3 s apart; a test waits for about 2 s.
FAST_NODE_DEATH = {"health_check_period_ms": 500, "health_check_failure_threshold": 4}
OBJECT_STORE_BYTES = 100 * 2**20  # the tests pass no objects through Ray; the default takes 30% of RAM each


class RayNode(RayHead):
    """A node that joins `head`'s cluster (its environment: token auth, multi-node switch)."""

    def __init__(
        self, head: RayHead, root: Path, node_ip: str, resources: dict[str, float], num_cpus: int = 1
    ):
        super().__init__(root, node_ip=node_ip, num_cpus=num_cpus)
        self.head = head
        self.env = head.env
        self.extra += ["--resources", json.dumps(resources)]
        ports = free_ports(len(NODE_PORT_FLAGS))
        self.flags = [item for flag, port in zip(NODE_PORT_FLAGS, ports) for item in (flag, str(port))]

    def command(self) -> list[str]:
        return (
            [
                ray_cli(),
                "start",
                "--block",
                "--address",
                self.head.gcs_address,
                "--node-ip-address",
                self.node_ip,
            ]
            + [*self.extra, "--object-store-memory", str(OBJECT_STORE_BYTES), "--disable-usage-stats"]
            + ["--temp-dir", str(self.root / "ray"), *self.flags]
        )

    def kill_raylet(self) -> int:
        """SIGKILL this node's raylet (its node manager): the node is lost. Returns the raylet's pid."""
        raylets = [p for p in self.processes() if _name(p) == "raylet"]
        if len(raylets) != 1:
            raise AssertionError(f"node {self.node_ip}: raylet processes {raylets}")
        raylets[0].send_signal(signal.SIGKILL)
        return raylets[0].pid


def multinode_head(root: Path, resources: dict[str, float], labels: dict[str, str] | None = None) -> RayHead:
    head = RayHead(
        root / "head", node_ip="127.0.0.2", resources=resources, system_config=FAST_NODE_DEATH, labels=labels
    )
    head.extra += ["--object-store-memory", str(OBJECT_STORE_BYTES)]
    return head


def _name(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.Error:
        return ""
