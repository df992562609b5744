"""Where a worker runs and what its KV cache can travel over: what it advertises in WorkerInfo so that a pair's
transport can be chosen (router.transport_choice).

    node_id        the Ray node id (set by deploy.actors); outside Ray, "host:<hostname>/<boot id>": equal for
                   two processes of one kernel and one hostname (one host, one container), different otherwise,
                   so two workers never look like one node when CUDA IPC could not join them
    kv_transports  the KV transports the worker holds (its KVSender's or KVReceiver's: the transfer.kinds its
                   device can use); a worker without either (colocated) names what its cache's device can use
    kv_gpu_uuid    the cache's GPU ("" on CPU)
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

import torch

from kv_transfer.pairing import TRANSPORT_TO_PROTO
from kv_transfer.transport import device_transports, device_uuid
from tandem_api.tandem.v1 import kv_pb2

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@dataclass(frozen=True)
class WorkerNode:
    node_id: str
    kv_transports: tuple[str, ...]
    kv_gpu_uuid: str
    kv_sender_id: bytes = b""  # a prefill worker's KVSender instance id (WorkerInfo.kv_sender_id)

    @property
    def kv_transport_values(self) -> list[kv_pb2.KVTransport]:
        """kv_transports as kv.proto's KVTransport values (WorkerInfo.kv_transports)."""
        return [TRANSPORT_TO_PROTO[kind] for kind in self.kv_transports]


def host_identity() -> str:
    """A worker outside Ray names its node by hostname and boot id (the hostname alone when there is none)."""
    try:
        boot = BOOT_ID.read_text().strip()
    except OSError:
        boot = ""
    host = socket.gethostname()
    return f"host:{host}/{boot}" if boot else f"host:{host}"


def describe_node(
    node_id: str, cache: torch.Tensor, held: tuple[str, ...] | None = None, sender_id: bytes = b""
) -> WorkerNode:
    """`node_id`: the spec's (Ray's) when set, else this host's identity. `held`: the transports the worker's
    KVSender or KVReceiver holds; None for a worker without one. `sender_id`: a prefill worker's KVSender's
    instance id."""
    transports = device_transports(cache) if held is None else held
    return WorkerNode(node_id or host_identity(), transports, device_uuid(cache), sender_id)
