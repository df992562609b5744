"""router.transport_choice from plain values: every kind of pair under every allowed order, and the reasons."""

from __future__ import annotations

from itertools import permutations

import pytest

from kv_transfer import TRANSPORT_KINDS
from router.transport_choice import NoCommonTransport, PairEnd, pair_transport, transport_names, why_not
from tandem_api.tandem.v1 import kv_pb2

pytestmark = pytest.mark.unit

GPU = frozenset({"tcp", "nccl", "cuda_ipc"})
GPU_NO_NCCL = frozenset({"tcp", "cuda_ipc"})
CPU = frozenset({"tcp"})

# (prefill, decode, the transports this pair can use), written out by hand for each kind of pair.
PAIRS = {
    "one node, two GPUs": (PairEnd("n1", "g1", GPU), PairEnd("n1", "g2", GPU), {"cuda_ipc", "nccl", "tcp"}),
    "one node, one shared GPU": (PairEnd("n1", "g1", GPU), PairEnd("n1", "g1", GPU), {"cuda_ipc", "tcp"}),
    "two nodes, GPUs": (PairEnd("n1", "g1", GPU), PairEnd("n2", "g2", GPU), {"nccl", "tcp"}),
    "two nodes, GPU ids unknown": (PairEnd("n1", "", GPU), PairEnd("n2", "", GPU), {"nccl", "tcp"}),
    "node ids unknown, GPUs": (PairEnd("", "g1", GPU), PairEnd("", "g2", GPU), {"nccl", "tcp"}),
    "one node, prefill on CPU": (PairEnd("n1", "", CPU), PairEnd("n1", "g1", GPU), {"tcp"}),
    "one node, decode on CPU": (PairEnd("n1", "g1", GPU), PairEnd("n1", "", CPU), {"tcp"}),
    "two nodes, both on CPU": (PairEnd("n1", "", CPU), PairEnd("n2", "", CPU), {"tcp"}),
    "one node, tensor-parallel 2 -> 1": (
        PairEnd("n1", "g1", GPU, 2),
        PairEnd("n1", "g3", GPU),
        {"nccl", "tcp"},
    ),
    "one node, tensor-parallel 2 -> 2": (
        PairEnd("n1", "g1", GPU, 2),
        PairEnd("n1", "g3", GPU, 2),
        {"cuda_ipc", "nccl", "tcp"},
    ),
    "one node, one GPU without NCCL": (
        PairEnd("n1", "g1", GPU_NO_NCCL),
        PairEnd("n1", "g2", GPU),
        {"cuda_ipc", "tcp"},
    ),
    "two nodes, one GPU without NCCL": (PairEnd("n1", "g1", GPU), PairEnd("n2", "g2", GPU_NO_NCCL), {"tcp"}),
}
# Every order of every non-empty subset of the three transports: 3 + 6 + 6 = 15.
ORDERS = [order for n in (1, 2, 3) for order in permutations(("cuda_ipc", "nccl", "tcp"), n)]


@pytest.mark.parametrize("order", ORDERS, ids="-".join)
@pytest.mark.parametrize("pair", PAIRS)
def test_the_first_allowed_transport_that_the_pair_can_use(pair: str, order: tuple[str, ...]) -> None:
    prefill, decode, usable = PAIRS[pair]
    expected = next((kind for kind in order if kind in usable), None)
    if expected is not None:
        assert pair_transport(order, prefill, decode) == expected
        return
    with pytest.raises(NoCommonTransport) as caught:
        pair_transport(order, prefill, decode)
    for kind in order:  # each allowed transport is named with its reason
        assert f"{kind}: " in str(caught.value)


def test_the_reasons_say_what_is_missing() -> None:
    gpu_a, gpu_b = PairEnd("n1", "g1", GPU), PairEnd("n2", "g2", GPU)
    assert why_not("cuda_ipc", gpu_a, gpu_b) == "the workers are not on one node (prefill n1, decode n2)"
    assert why_not("cuda_ipc", PairEnd("", "g1", GPU), PairEnd("", "g2", GPU)) == (
        "the workers are not on one node (prefill unknown, decode unknown)"
    )
    assert why_not("nccl", PairEnd("n1", "", CPU), PairEnd("n1", "", CPU)) == (
        "the prefill and the decode worker cannot use it"
    )
    assert why_not("nccl", gpu_a, PairEnd("n1", "", CPU)) == "the decode worker cannot use it"
    assert (
        why_not("nccl", gpu_a, PairEnd("n1", "g1", GPU)) == "both KV caches are on one GPU (nccl needs two)"
    )
    assert why_not("rdma", gpu_a, gpu_b) == "unknown transport (known: cuda_ipc, nccl, tcp)"
    assert why_not("tcp", gpu_a, gpu_b) is None


def test_nothing_in_common_names_the_field_and_every_reason() -> None:
    cpu, gpu = PairEnd("n1", "", CPU), PairEnd("n1", "g1", GPU)
    with pytest.raises(NoCommonTransport, match=r"transfer\.kinds \['cuda_ipc', 'nccl'\]") as caught:
        pair_transport(["cuda_ipc", "nccl"], cpu, gpu)
    assert "cuda_ipc: the prefill worker cannot use it; nccl: the prefill worker cannot use it" in str(
        caught.value
    )
    with pytest.raises(NoCommonTransport, match="allows none"):
        pair_transport([], gpu, gpu)


def test_names_come_from_the_proto_and_match_the_config() -> None:
    numbers = [kv_pb2.KV_TRANSPORT_TCP, kv_pb2.KV_TRANSPORT_NCCL, kv_pb2.KV_TRANSPORT_CUDA_IPC]
    assert transport_names(numbers) == frozenset(TRANSPORT_KINDS)
    assert transport_names([kv_pb2.KV_TRANSPORT_UNSPECIFIED, 99]) == frozenset()
