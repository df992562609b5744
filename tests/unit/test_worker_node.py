"""What a worker advertises about where it runs and what its KV can travel over (WorkerInfo.node_id,
kv_transports, kv_gpu_uuid), and the router's reading of it into a pair's transport."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import grpc
import pytest
import torch

from decode_worker.worker import DecodeWorker
from model_runtime.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from prefill_worker.worker import PrefillWorker
from router.transport_choice import NoCommonTransport, pair_end, pair_transport
from tandem_api.tandem.v1 import admin_pb2, kv_pb2, worker_pb2, worker_pb2_grpc
from worker_host.node import describe_node, host_identity
from worker_host.spec import WorkerSpec

pytestmark = pytest.mark.unit


def test_outside_ray_a_worker_names_its_host_and_a_cpu_cache_travels_over_tcp_only() -> None:
    assert host_identity() == host_identity()
    assert host_identity().startswith(f"host:{socket.gethostname()}")
    node = describe_node("", torch.zeros(2, 4))
    assert (node.node_id, node.kv_transports, node.kv_gpu_uuid) == (host_identity(), ("tcp",), "")
    assert node.kv_transport_values == [kv_pb2.KV_TRANSPORT_TCP]
    assert describe_node("0f3a-ray-node", torch.zeros(1)).node_id == "0f3a-ray-node"  # Ray's, when it has one
    # A worker with a KV sender or receiver names the transports it holds, not all its device could use.
    assert describe_node("", torch.zeros(1), ("nccl", "tcp")).kv_transports == ("nccl", "tcp")


def _tiny_engine() -> EngineConfig:
    """A worker's engine on the CPU with random weights (nothing to write or read)."""
    return EngineConfig(
        model="dummy:tiny-llama",
        cache=CacheConfig(block_size=4, num_blocks=16),
        scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32),
        device=DeviceConfig(device="cpu"),
    )


@contextmanager
def _started(worker: PrefillWorker | DecodeWorker) -> Iterator[str]:
    try:
        yield worker.start()
    finally:
        worker.stop()


def _status(address: str, stub_class) -> admin_pb2.WorkerInfo:
    with grpc.insecure_channel(address) as channel:
        return stub_class(channel).Status(worker_pb2.WorkerStatusRequest(), timeout=10)


def test_started_workers_report_their_node_and_transports_and_pair_over_tcp() -> None:
    engine = _tiny_engine()
    prefill = PrefillWorker(
        WorkerSpec(worker_id="prefill-0", role="prefill", engine=engine, node_id="node-a")
    )
    decode = DecodeWorker(WorkerSpec(worker_id="decode-0", role="decode", engine=engine))
    with ExitStack() as stack:
        p_info = _status(stack.enter_context(_started(prefill)), worker_pb2_grpc.PrefillWorkerStub)
        d_info = _status(stack.enter_context(_started(decode)), worker_pb2_grpc.DecodeWorkerStub)
        sender_id = prefill.sender.instance_id
    assert (p_info.node_id, d_info.node_id) == ("node-a", host_identity())
    assert list(p_info.kv_transports) == list(d_info.kv_transports) == [kv_pb2.KV_TRANSPORT_TCP]
    assert p_info.kv_gpu_uuid == d_info.kv_gpu_uuid == ""
    # The prefill worker names its KVSender (what a cuda_ipc lease is armed for); a decode worker has none.
    assert p_info.kv_sender_id == sender_id and len(sender_id) == 16
    assert d_info.kv_sender_id == b""

    ends = pair_end(p_info), pair_end(d_info)
    assert pair_transport(["tcp"], *ends) == "tcp"
    with pytest.raises(NoCommonTransport, match="cuda_ipc: the prefill and the decode worker cannot use it"):
        pair_transport(["cuda_ipc"], *ends)


def test_a_decode_worker_refuses_a_transport_its_receiver_does_not_hold_before_reserving() -> None:
    engine = _tiny_engine()
    decode = DecodeWorker(WorkerSpec(worker_id="decode-0", role="decode", engine=engine))

    def decode_call(stub, rid: str, transport: int):
        request = worker_pb2.DecodeRequest(
            request_id=rid, prompt_token_ids=[5, 6, 7], lease_ttl_ms=5000, kv_transport=transport
        )
        request.sampling.max_tokens, request.sampling.top_p = 2, 1.0
        return stub.Decode(request, timeout=10)

    with _started(decode) as address, grpc.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.DecodeWorkerStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            next(decode_call(stub, "r-nccl", kv_pb2.KV_TRANSPORT_NCCL))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert info.value.details().startswith(
            "kv_transport: the router chose nccl for this pair; decode worker decode-0's KV receiver holds tcp"
        )
        status = stub.Status(worker_pb2.WorkerStatusRequest(), timeout=10)
        assert (status.kv_blocks_used, status.active_leases) == (0, 0)  # refused before reserving anything
        for transport in (
            kv_pb2.KV_TRANSPORT_TCP,
            kv_pb2.KV_TRANSPORT_UNSPECIFIED,
        ):  # its own, or the default
            call = decode_call(stub, f"r-{transport}", transport)
            assert next(call).reserved.transport == kv_pb2.KV_TRANSPORT_TCP
            call.cancel()


def test_a_started_worker_keeps_its_start_up_objects_out_of_the_collector_until_it_stops() -> None:
    """A full collection walked everything a worker built at start-up (model, graphs, kernels) on the engine
    thread: 137-162 ms on an H200 host. Once started, those objects are frozen (gc.freeze); stop() thaws them."""
    import gc

    engine = _tiny_engine()
    worker = DecodeWorker(WorkerSpec(worker_id="colocated-0", role="colocated", engine=engine))
    gc.unfreeze()  # whatever an earlier test of this process left frozen
    assert gc.get_freeze_count() == 0
    with _started(worker):
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # the engine, its model and everything imported so far
    assert gc.get_freeze_count() == 0
