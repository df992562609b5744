"""Which KV transport a prefill/decode pair would use: the first allowed one that both ends can use.

One pure function over plain values, so that every combination is a unit test. The rules, per transport:

    cuda_ipc : both ends can use it (a CUDA GPU each), both are on one node (equal, known node ids), and both
               span as many devices (ranks of tensor-parallel workers of different sizes hold different heads,
               and cuda_ipc copies whole caches)
    nccl     : both ends can use it (a CUDA GPU each, NCCL built in) and the caches are on two different GPUs
               (NCCL refuses two ranks on one GPU; unknown GPU ids count as different)
    tcp      : both ends can use it (every worker can: any device, the bytes go over the control socket)

It lives beside placement because the router is where both ends of a pair are known before any prompt is
computed: a pair with no transport in common is never placed (docs/architecture.md, "Transport per pair", says
what is built and what is not). The names are the config's (`transfer.kinds`) and come from kv.proto's
KVTransport (KV_TRANSPORT_CUDA_IPC -> "cuda_ipc"), the one list both the workers and the router read.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tandem_api.tandem.v1 import admin_pb2, kv_pb2

_PREFIX = "KV_TRANSPORT_"
TRANSPORT_NAMES = {
    number: name.removeprefix(_PREFIX).lower()
    for name, number in kv_pb2.KVTransport.items()
    if number != kv_pb2.KV_TRANSPORT_UNSPECIFIED
}
_NUMBERS = {  # the other way, typed as the enum (DecodeRequest.kv_transport)
    "tcp": kv_pb2.KV_TRANSPORT_TCP,
    "nccl": kv_pb2.KV_TRANSPORT_NCCL,
    "cuda_ipc": kv_pb2.KV_TRANSPORT_CUDA_IPC,
}


def transport_number(name: str) -> kv_pb2.KVTransport:
    """A config name -> its KVTransport value ("tcp" -> KV_TRANSPORT_TCP); UNSPECIFIED for "" or an unknown name."""
    return _NUMBERS.get(name, kv_pb2.KV_TRANSPORT_UNSPECIFIED)


def transport_names(numbers: Iterable[int]) -> frozenset[str]:
    """KVTransport values (as WorkerInfo.kv_transports carries them) -> config names; unknown values dropped
    (a newer worker's transport that this router does not know cannot be chosen)."""
    return frozenset(TRANSPORT_NAMES[n] for n in numbers if n in TRANSPORT_NAMES)


@dataclass(frozen=True)
class PairEnd:
    """One end of a pair as its worker advertises itself (WorkerInfo.node_id, gpu_uuid, kv_transports).

    node_id: the Ray node id, or a host identity outside Ray; "" when unknown (never taken as "one node").
    gpu_uuid: the GPU that holds the worker's KV cache; "" on CPU or when unknown.
    transports: what the worker can use, whatever the config allows.
    devices: the devices (tensor-parallel ranks) the worker spans.
    """

    node_id: str = ""
    gpu_uuid: str = ""
    transports: frozenset[str] = frozenset({"tcp"})
    devices: int = 1


def pair_end(info: admin_pb2.WorkerInfo) -> PairEnd:
    """A worker's end of a pair from its polled status."""
    return PairEnd(info.node_id, info.kv_gpu_uuid, transport_names(info.kv_transports), max(1, info.devices))


class NoCommonTransport(ValueError):
    """No allowed transport suits the pair; the message names each allowed one and why it does not fit."""


def pair_transport(allowed: Sequence[str], prefill: PairEnd, decode: PairEnd) -> str:
    """The first transport of `allowed` (the config's order of preference) that the pair can use.

    Raises NoCommonTransport when there is none: the pair must not be placed (its KV would have no way to
    travel), and the message says, per allowed transport, why."""
    reasons = []
    for kind in allowed:
        reason = why_not(kind, prefill, decode)
        if reason is None:
            return kind
        reasons.append(f"{kind}: {reason}")
    detail = "; ".join(reasons) if reasons else "transfer.kinds allows none"
    raise NoCommonTransport(f"no transport in transfer.kinds {list(allowed)} suits this pair ({detail})")


def why_not(kind: str, prefill: PairEnd, decode: PairEnd) -> str | None:
    """None when the pair can use `kind`, else the reason it cannot."""
    if kind not in TRANSPORT_NAMES.values():
        return f"unknown transport (known: {', '.join(sorted(TRANSPORT_NAMES.values()))})"
    lacking = [role for role, end in (("prefill", prefill), ("decode", decode)) if kind not in end.transports]
    if lacking:
        return f"the {' and the '.join(lacking)} worker cannot use it"
    if kind == "cuda_ipc" and not (prefill.node_id and prefill.node_id == decode.node_id):
        return f"the workers are not on one node (prefill {_node(prefill)}, decode {_node(decode)})"
    if kind == "cuda_ipc" and prefill.devices != decode.devices:
        return (
            f"it copies whole caches, and the workers span {prefill.devices} and {decode.devices} devices "
            "(their ranks hold different KV heads)"
        )
    if kind == "nccl" and prefill.gpu_uuid and prefill.gpu_uuid == decode.gpu_uuid:
        return "both KV caches are on one GPU (nccl needs two)"
    return None


def _node(end: PairEnd) -> str:
    return end.node_id or "unknown"
