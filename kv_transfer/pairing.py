"""Pairing: what two peers check about each other before any KV byte moves.

The block format comes from KVLayout alone (`format_dict`, `fingerprint`, `mismatch`): a mismatch is refused
with a message naming the differing field. A connection has one transport, which both sides must hold (a worker
may hold several: the sender's hello names the one its channel is for, a target the one its lease is for), and
nccl needs two GPUs.
"""

from __future__ import annotations

from collections.abc import Sequence

from kv_transfer.config import MAX_LANES
from kv_transfer.contracts import FailureReason, TransferFailed
from model_runtime.config import ConfigError
from model_runtime.kv_layout import FORMAT_FIELDS, KVLayout, KVShard
from tandem_api.tandem.v1 import kv_pb2

PROTOCOL_VERSION = 3  # 2: reused connections, no KVBeginOk / KVPartReady; 3: KVHello.lane (nccl lanes)
HANDLE_BYTES = 16

TRANSPORT_TO_PROTO = {
    "tcp": kv_pb2.KV_TRANSPORT_TCP,
    "nccl": kv_pb2.KV_TRANSPORT_NCCL,
    "cuda_ipc": kv_pb2.KV_TRANSPORT_CUDA_IPC,
}
TRANSPORT_FROM_PROTO = {v: k for k, v in TRANSPORT_TO_PROTO.items()}


def format_message(layout: KVLayout) -> kv_pb2.KVFormat:
    message = kv_pb2.KVFormat()
    for name, value in layout.format_dict().items():
        setattr(message, name, value)
    if layout.shard is not None:
        shard = layout.shard
        message.tp_size, message.tp_rank = shard.tp_size, shard.tp_rank
        message.head_start, message.model_kv_heads = shard.head_start, shard.model_kv_heads
    return message


def format_from_message(message: kv_pb2.KVFormat) -> dict[str, int | str]:
    return {name: getattr(message, name) for name in FORMAT_FIELDS}


def layout_from_message(message: kv_pb2.KVFormat) -> KVLayout:
    """The peer's layout as its format message describes it (its cache size is not part of the format)."""
    shard = None
    if message.model_kv_heads:
        shard = KVShard(message.tp_size, message.tp_rank, message.head_start, message.model_kv_heads)
    fields = format_from_message(message)
    return KVLayout(num_blocks=2, shard=shard, **fields)  # type: ignore[arg-type]


def check_format(layout: KVLayout, message: kv_pb2.KVFormat, fingerprint: str) -> None:
    """Refuse a peer whose blocks mean something else; the message names every differing field. Two caches of
    one model sharded differently (tensor-parallel ranks of different sizes) pair when everything but their
    head counts agrees: a transfer between them names the heads it moves (KVBegin's head window)."""
    if layout.shard is None and not message.model_kv_heads:
        diff = layout.mismatch(format_from_message(message))
        expected = layout.fingerprint()
    else:
        try:
            theirs = layout_from_message(message)
        except (ConfigError, TypeError) as exc:
            raise TransferFailed(
                FailureReason.LAYOUT_MISMATCH, f"the peer's KV format is invalid: {exc}"
            ) from None
        diff = layout.whole().mismatch(theirs.whole().format_dict())
        expected = theirs.fingerprint()
    if diff is not None:
        raise TransferFailed(FailureReason.LAYOUT_MISMATCH, f"KV layouts differ: {diff}")
    if fingerprint != expected:
        raise TransferFailed(
            FailureReason.LAYOUT_MISMATCH,
            f"layout fingerprints differ ({fingerprint!r} vs {expected!r} for the same format fields): "
            "peers run different KVLayout versions",
        )


def pair_key(instance_id: bytes, lane: int) -> bytes:
    """What both sides key a pair's transport state by: the peer's instance id, and the lane when it is not 0
    (a sender runs up to transfer.nccl_lanes nccl transfers to one receiver at once, each on its own
    connection and communicator)."""
    return instance_id if lane == 0 else instance_id + b"/lane" + str(lane).encode()


def make_hello(
    layout: KVLayout,
    instance_id: bytes,
    kind: str,
    device_uuid: str,
    pair_ready: bool = False,
    lane: int = 0,
) -> kv_pb2.KVFrame:
    return kv_pb2.KVFrame(
        hello=kv_pb2.KVHello(
            protocol_version=PROTOCOL_VERSION,
            instance_id=instance_id,
            format=format_message(layout),
            layout_fingerprint=layout.fingerprint(),
            transports=[TRANSPORT_TO_PROTO[kind]],
            device_uuid=device_uuid,
            pair_ready=pair_ready,
            lane=lane,
        )
    )


def check_hello(layout: KVLayout, held: Sequence[str], device_uuid: str, hello: kv_pb2.KVHello) -> str:
    """What both sides check in the peer's KVHello: version, block format, transport and GPUs. `held`: the
    transports this side holds (a worker may hold several); returns the connection's transport, the first the
    peer names that this side holds (a sender names exactly one: its channel's)."""
    if hello.protocol_version != PROTOCOL_VERSION:
        raise TransferFailed(
            FailureReason.PROTOCOL_ERROR,
            f"protocol version {hello.protocol_version}, expected {PROTOCOL_VERSION}",
        )
    if len(hello.instance_id) != HANDLE_BYTES:
        raise TransferFailed(FailureReason.PROTOCOL_ERROR, "hello.instance_id must be 16 bytes")
    if hello.lane >= MAX_LANES:
        raise TransferFailed(
            FailureReason.PROTOCOL_ERROR, f"hello.lane {hello.lane} is not below {MAX_LANES}"
        )
    check_format(layout, hello.format, hello.layout_fingerprint)
    theirs = [TRANSPORT_FROM_PROTO.get(t, str(t)) for t in hello.transports]
    kind = next((k for k in theirs if k in held), None)
    if kind is None:
        raise TransferFailed(
            FailureReason.TRANSPORT_MISMATCH,
            f"transport: ours={','.join(held)} theirs={','.join(theirs) or 'none'}",
        )
    if kind == "cuda_ipc" and hello.format.num_kv_heads != layout.num_kv_heads:
        raise TransferFailed(
            FailureReason.TRANSPORT_MISMATCH,
            f"cuda_ipc copies whole caches, and these hold {hello.format.num_kv_heads} and "
            f"{layout.num_kv_heads} KV heads (tensor-parallel workers of different sizes): use nccl or tcp",
        )
    if kind == "nccl" and device_uuid and hello.device_uuid == device_uuid:
        raise TransferFailed(
            FailureReason.TRANSPORT_MISMATCH,
            "nccl needs two different GPUs but both caches are on one GPU; use cuda_ipc",
        )
    return kind


def check_target(layout: KVLayout, held: Sequence[str], target: kv_pb2.KVTarget) -> str:
    """A sender's checks of a KVTarget before it connects (raise TransferFailed, nothing is sent); returns the
    transport the target names, which this sender must hold (`held`)."""
    if not target.host or not 0 < target.port < 65536:
        raise TransferFailed(
            FailureReason.CONNECT_FAILED, f"target address {target.host!r}:{target.port} is invalid"
        )
    if len(target.handle) != HANDLE_BYTES:
        raise TransferFailed(FailureReason.UNKNOWN_HANDLE, f"target.handle must be {HANDLE_BYTES} bytes")
    if not target.request_id:
        raise TransferFailed(FailureReason.DESCRIPTOR_MISMATCH, "target.request_id is empty")
    check_format(layout, target.format, target.layout_fingerprint)
    wanted = TRANSPORT_FROM_PROTO.get(target.transport, str(target.transport))
    if wanted not in held:
        raise TransferFailed(
            FailureReason.TRANSPORT_MISMATCH, f"transport: ours={','.join(held)} target={wanted}"
        )
    return wanted
