"""router.pairs: the pair a disaggregated attempt runs on, with its KV transport and nodes, and the router's
count of pairs in use (what `tandem status` lists)."""

from __future__ import annotations

import pytest

from router.pairs import ActivePairs, Pair, pair_of
from tandem_api.tandem.v1 import admin_pb2, kv_pb2

GPU = [kv_pb2.KV_TRANSPORT_TCP, kv_pb2.KV_TRANSPORT_NCCL, kv_pb2.KV_TRANSPORT_CUDA_IPC]
CPU = [kv_pb2.KV_TRANSPORT_TCP]


def info(node: str, gpu: str = "", transports: list[int] = GPU) -> admin_pb2.WorkerInfo:
    return admin_pb2.WorkerInfo(node_id=node, kv_gpu_uuid=gpu, kv_transports=transports)


@pytest.mark.parametrize(
    ("prefill", "decode", "allowed", "transport", "nodes"),
    [
        (info("n1", "g0"), info("n1", "g1"), ["cuda_ipc", "nccl", "tcp"], "cuda_ipc", "same"),
        (info("n1", "g0"), info("n2", "g1"), ["cuda_ipc", "nccl", "tcp"], "nccl", "cross"),
        (info("n1", "g0"), info("n1", "g1"), ["nccl", "cuda_ipc"], "nccl", "same"),
        (info("n1", transports=CPU), info("n2", transports=CPU), ["tcp"], "tcp", "cross"),
        (info("n1", "g0"), info("n1", "g0"), ["nccl"], "", "same"),  # never placed: no transport in common
        (info("n1", "g0"), info("n2", "g1"), [], "", "cross"),  # no allowed list: the router cannot tell
        (info(""), info("n2"), ["tcp"], "tcp", "unknown"),  # a worker that does not say its node
        (None, info("n2"), ["tcp"], "", "unknown"),  # not polled yet
    ],
)
def test_the_pair_names_its_transport_and_whether_it_spans_nodes(prefill, decode, allowed, transport, nodes):
    assert pair_of("p0", "d0", prefill, decode, allowed) == Pair("p0", "d0", transport, nodes)


def test_active_pairs_count_requests_per_pair_and_forget_a_pair_once_idle() -> None:
    pairs = ActivePairs()
    one, two = Pair("p0", "d1", "tcp", "cross"), Pair("p0", "d0", "tcp", "same")
    with pairs.running(one), pairs.running(two), pairs.running(one):
        shown = [
            (p.prefill_worker_id, p.decode_worker_id, p.kv_transport, p.nodes, p.requests)
            for p in pairs.to_proto()
        ]
        assert shown == [("p0", "d0", "tcp", "same", 1), ("p0", "d1", "tcp", "cross", 2)]
    with pytest.raises(RuntimeError), pairs.running(one):
        raise RuntimeError("an attempt that fails still closes its pair")
    assert pairs.to_proto() == []


def test_every_transport_name_has_its_kv_proto_number_and_back() -> None:
    from router.transport_choice import TRANSPORT_NAMES, transport_number

    assert {name: transport_number(name) for name in TRANSPORT_NAMES.values()} == {
        name: number for number, name in TRANSPORT_NAMES.items()
    }
    assert transport_number("") == transport_number("infiniband") == kv_pb2.KV_TRANSPORT_UNSPECIFIED
