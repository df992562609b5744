"""The latency window of standalone routers (Kubernetes: every pod behind the routers' headless Service).

Each evaluation asks every router, over Admin.Status with latency_window_seconds, for its window's bucket counts
(router.recent_latency) and adds them up: the p90 is then that of all the requests the routers served, as if one
router had served them. A router that does not answer is left out of that window (and logged); with none
answering, the window is empty, which the policy takes as no evidence.

The same answers carry the workers as each router last polled them: `workers()` returns them, one entry per
worker id (the most recent heartbeat wins), for the load readings (deploy.autoscaler.load).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import grpc

from deploy.publish import RouterDialer, resolve_all
from router.recent_latency import LatencyCounts, WindowStats
from tandem_api.tandem.v1 import admin_pb2, admin_pb2_grpc
from tandem_client.tls import TLSFiles

log = logging.getLogger("tandem.autoscaler")


class RouterLatency:
    """A LatencySource over the routers `targets` ("host:port"; a name may resolve to several pods)."""

    def __init__(self, targets: Sequence[str], timeout_s: float = 2.0, tls: TLSFiles | None = None) -> None:
        self.targets = tuple(targets)
        self.timeout_s = timeout_s
        self._dialer = RouterDialer(tls)  # TLS to the routers' public port (deploy config tls.router)
        self._workers: list[admin_pb2.WorkerInfo] = []

    def __call__(self, window_s: float) -> WindowStats:
        total = LatencyCounts(window_s)
        workers: dict[str, admin_pb2.WorkerInfo] = {}
        for target in self.targets:
            for address in resolve_all(target):
                status = self._ask(address, target, window_s)
                if status is None:
                    continue
                total = total.merged(
                    LatencyCounts.from_proto(status.router.recent_latency, f"router {address}")
                )
                for info in status.workers:
                    seen = workers.get(info.worker_id)
                    if seen is None or info.last_heartbeat_age_seconds < seen.last_heartbeat_age_seconds:
                        workers[info.worker_id] = info
        self._workers = list(workers.values())
        return total.stats()

    def workers(self) -> list[admin_pb2.WorkerInfo]:
        """The workers from the last call's answers (empty before the first)."""
        return self._workers

    def _ask(self, address: str, target: str, window_s: float) -> admin_pb2.ClusterStatus | None:
        request = admin_pb2.StatusRequest(latency_window_seconds=window_s)
        try:
            with self._dialer.channel(address, target) as channel:
                return admin_pb2_grpc.AdminStub(channel).Status(request, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            log.info("router %s gave no latency window: %s", address, exc.code())
            return None
