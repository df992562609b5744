"""Placement with the deployment's transfer.kinds: a prefill/decode pair with no KV transport in common is not
placed (router.transport_choice decides per pair); workers that advertised nothing are placed as before."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from deploy.config import parse_config
from deploy.router_inputs import router_config
from model_runtime.roles import WorkerRole as Role
from router.config import RouterConfig, RouterConfigError
from router.placement import PREFILL_WORKER, Placement, Placer, WorkerLoad, can_serve
from router.pool import Endpoint, WorkerHandle
from router.transport_choice import PairEnd
from tandem_api.tandem.v1 import admin_pb2, kv_pb2

pytestmark = pytest.mark.unit

GPU = frozenset({"tcp", "nccl", "cuda_ipc"})
CPU = frozenset({"tcp"})
IPC_ONLY = Placer(transfer_kinds=("cuda_ipc",))


def worker(
    wid: str, role: Role, node: str | None, kinds: frozenset[str] = GPU, queued: int = 0, running: int = 0
) -> WorkerLoad:
    """node None: the worker advertised nothing (an older build)."""
    end = None if node is None else PairEnd(node, f"gpu-{wid}" if "nccl" in kinds else "", kinds)
    return WorkerLoad(
        wid,
        role,
        free_kv_blocks=100,
        running_requests=running,
        queued_prefill_tokens=queued,
        layout_fingerprint="L",
        pair_end=end,
    )


def test_a_cuda_ipc_deployment_pairs_on_one_node_even_when_another_node_is_cheaper() -> None:
    loads = [
        worker("d0", Role.DECODE, "n1"),
        worker("p0", Role.PREFILL, "n2"),  # cheaper, on the other node
        worker("p1", Role.PREFILL, "n1", queued=500),
    ]
    assert IPC_ONLY.place(loads) == Placement("d0", "p1", PREFILL_WORKER)
    assert Placer().place(loads) == Placement("d0", "p0", PREFILL_WORKER)  # no kinds known: unchecked


def test_the_next_decode_worker_is_tried_when_the_cheapest_has_no_transport_with_any_prefill() -> None:
    loads = [
        worker("d0", Role.DECODE, "n1"),
        worker("d1", Role.DECODE, "n2", running=3),  # dearer, but on the prefill worker's node
        worker("p0", Role.PREFILL, "n2"),
    ]
    assert IPC_ONLY.place(loads) == Placement("d1", "p0", PREFILL_WORKER)
    assert Placer().place(loads) == Placement("d0", "p0", PREFILL_WORKER)


def test_no_pair_with_a_transport_is_no_placement_and_says_why() -> None:
    loads = [worker("d0", Role.DECODE, "n1"), worker("p0", Role.PREFILL, "n2")]
    assert IPC_ONLY.place(loads) is None
    assert not can_serve(loads, IPC_ONLY) and can_serve(loads)  # health follows the router's placer
    assert IPC_ONLY.unpaired_reason(loads) == (
        "p0 -> d0: no transport in transfer.kinds ['cuda_ipc'] suits this pair "
        "(cuda_ipc: the workers are not on one node (prefill n2, decode n1))"
    )
    cpu_prefill = [worker("d0", Role.DECODE, "n1"), worker("p0", Role.PREFILL, "n1", kinds=CPU)]
    assert Placer(transfer_kinds=("nccl",)).place(cpu_prefill) is None
    assert Placer(transfer_kinds=("tcp",)).place(cpu_prefill) == Placement("d0", "p0", PREFILL_WORKER)
    assert Placer(transfer_kinds=("tcp",)).unpaired_reason(cpu_prefill) is None


def test_a_worker_that_advertised_nothing_is_placed_as_before() -> None:
    loads = [worker("d0", Role.DECODE, "n1"), worker("p0", Role.PREFILL, None)]
    assert IPC_ONLY.place(loads) == Placement("d0", "p0", PREFILL_WORKER)
    assert IPC_ONLY.unpaired_reason(loads) is None


def test_the_pool_reads_what_a_worker_advertised() -> None:
    async def loads() -> tuple[WorkerLoad, WorkerLoad]:
        channel = grpc.aio.insecure_channel("127.0.0.1:9")  # never called
        handle = WorkerHandle(Endpoint("p0", Role.PREFILL, "127.0.0.1:9"), channel)
        ready = admin_pb2.WORKER_STATE_READY
        transports = [kv_pb2.KV_TRANSPORT_TCP, kv_pb2.KV_TRANSPORT_CUDA_IPC]
        handle.poll_succeeded(admin_pb2.WorkerInfo(state=ready, node_id="n1", kv_transports=transports), 0.0)
        new = handle.load(dead_after=3)
        handle.poll_succeeded(admin_pb2.WorkerInfo(state=ready), 0.0)
        old = handle.load(dead_after=3)
        await channel.close()
        return new, old

    new, old = asyncio.run(loads())
    assert new.pair_end == PairEnd("n1", "", frozenset({"tcp", "cuda_ipc"}))
    assert old.pair_end is None


def test_the_router_takes_transfer_kinds_from_the_deploy_config_and_checks_them() -> None:
    config = parse_config({"mode": "disaggregated", "transfer": {"kinds": ["cuda_ipc"]}})
    assert router_config(config).transfer_kinds == ("cuda_ipc",)
    with pytest.raises(RouterConfigError, match=r"^transfer_kinds: must be a tuple of distinct transports"):
        RouterConfig(transfer_kinds=("rdma",))
    with pytest.raises(RouterConfigError, match=r"^transfer_kinds: "):
        RouterConfig(transfer_kinds=("tcp", "tcp"))


def test_at_equal_cost_the_prefill_worker_on_the_decode_workers_node_wins_whatever_the_turn() -> None:
    loads = [
        worker("d0", Role.DECODE, "n1"),
        worker("p0", Role.PREFILL, "n2"),
        worker("p1", Role.PREFILL, "n1"),
        worker("p2", Role.PREFILL, "n1"),
    ]
    tcp = Placer(transfer_kinds=("tcp",))
    chosen = {tcp.place(loads, turn=turn).prefill for turn in range(6)}  # type: ignore[union-attr]
    assert chosen == {"p1", "p2"}  # same-node workers still rotate among themselves
    assert tcp.place([*loads[:2], worker("p1", Role.PREFILL, "n1", queued=1)]).prefill == "p0"  # type: ignore[union-attr]
    unknown = [worker("d0", Role.DECODE, ""), worker("p0", Role.PREFILL, ""), worker("p1", Role.PREFILL, "")]
    assert {tcp.place(unknown, turn=t).prefill for t in range(4)} == {"p0", "p1"}  # type: ignore[union-attr]
