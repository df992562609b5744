"""What a sender's KVBegin and KVDone must agree with on the receiver (kv_transfer.receive_session): the lease
a KVBegin claims, the heads it fills, and the first token a KVDone carries. Each disagreement is a
TransferFailed that names it."""

from __future__ import annotations

from kv_transfer.contracts import FailureReason, FirstToken, Lease, TransferFailed
from model_runtime.kv_layout import KVLayout
from tandem_api.tandem.v1 import kv_pb2


def check_begin(begin: kv_pb2.KVBegin, lease: Lease, kind: str, layout: KVLayout) -> None:
    """A KVBegin against the lease it claims, on a connection of transport `kind`: another transport than the
    lease's is TRANSPORT_MISMATCH; the block, token and byte counts and (cuda_ipc) one source block id per block
    are DESCRIPTOR_MISMATCH, naming each that disagrees."""
    if lease.transport != kind:  # the sender connected over another transport than the lease names
        raise TransferFailed(
            FailureReason.TRANSPORT_MISMATCH,
            f"request {lease.request_id!r}: its lease is for {lease.transport}, this connection is {kind}",
        )
    n = len(lease.block_ids)
    expected_bytes = layout.bytes_per_block * n
    problems = []
    if begin.num_blocks != n:
        problems.append(f"num_blocks: lease={n} sender={begin.num_blocks}")
    if begin.num_tokens != lease.num_tokens:
        problems.append(f"num_tokens: lease={lease.num_tokens} sender={begin.num_tokens}")
    if begin.num_bytes != expected_bytes:
        problems.append(f"num_bytes: lease={expected_bytes} sender={begin.num_bytes}")
    if kind == "cuda_ipc" and len(begin.src_block_ids) != n:
        problems.append(f"src_block_ids: {len(begin.src_block_ids)} ids for {n} blocks")
    if problems:
        raise TransferFailed(
            FailureReason.DESCRIPTOR_MISMATCH, f"request {lease.request_id!r}: " + "; ".join(problems)
        )


def begin_window(layout: KVLayout, begin: kv_pb2.KVBegin) -> tuple[int, int] | None:
    """The heads a KVBegin fills, (begin, count) in our cache, or None for every head."""
    if begin.num_heads == 0 or (begin.head_begin == 0 and begin.num_heads == layout.num_kv_heads):
        return None
    try:
        layout.head_window(begin.head_begin, begin.num_heads)
    except ValueError as exc:
        raise TransferFailed(
            FailureReason.DESCRIPTOR_MISMATCH, f"request {begin.request_id!r}: {exc}"
        ) from None
    return begin.head_begin, begin.num_heads


def first_token_of(done: kv_pb2.KVDone) -> FirstToken:
    if not done.HasField("first_token"):
        raise TransferFailed(FailureReason.DESCRIPTOR_MISMATCH, "KVDone carries no first token")
    try:
        return first_token_from_message(done.first_token)
    except ValueError as exc:
        raise TransferFailed(FailureReason.DESCRIPTOR_MISMATCH, str(exc)) from None


def first_token_from_message(token: kv_pb2.KVFirstToken) -> FirstToken:
    """The KVFirstToken on the wire as a FirstToken (ValueError for a negative id)."""
    return FirstToken(
        token.token_id,
        token.logprob if token.HasField("logprob") else None,
        tuple((t.token_id, t.logprob) for t in token.top_logprobs),
    )
