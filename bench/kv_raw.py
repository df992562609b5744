"""The raw baselines of bench/kv_transfer.py: one contiguous buffer between the same two processes and GPUs,
rank 0 = the prefill side, rank 1 = the decode side. CuPy NCCL and torch.distributed send/recv (the send timed
after the peer posted its receive) and a one-sided CUDA IPC pull: what a handoff is measured against."""

from __future__ import annotations

import time

import torch


def raw_times(cmd, rank: int, peer, device: torch.device, state: dict) -> list[float]:
    _, kind, nbytes, runs, port = cmd
    if kind == "ipc":
        return ipc_pull(nbytes, runs, peer, device, state) if rank == 1 else ipc_export(nbytes, peer, device)
    setup_comm(kind, rank, peer, device, state, port)
    return nccl_p2p(kind, rank, nbytes, runs, peer, device, state)


def close_raw(state: dict) -> None:
    """A process's end of the baselines, once it is done with them: the torch.distributed group destroyed
    (torch warns at exit otherwise) and the peer's IPC buffer unmapped. Safe when none ran; CuPy's
    communicator ends with the process."""
    if state.pop("torch", False) and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if "ipc_base" in state:
        from cupy.cuda import runtime

        runtime.ipcCloseMemHandle(state.pop("ipc_base"))
        state.pop("ipc_handle", None)


def expect(peer, token: bytes) -> None:
    """The peer's next message is `token` (the pipe protocol's step); anything else is a protocol error."""
    got = peer.recv()
    if got != token:
        raise RuntimeError(f"raw baseline: expected {token!r} from the peer process, got {got!r:.80}")


def setup_comm(kind: str, rank: int, peer, device: torch.device, state: dict, port: int) -> None:
    """Once per run: a CuPy 2-rank communicator, or a torch.distributed NCCL group, between the two GPUs."""
    if kind in state:
        return
    if kind == "cupy":
        from cupy.cuda import nccl

        from kv_transfer.nccl import _new_comm, _uid_bytes

        if rank == 0:
            uid = _uid_bytes(nccl.get_unique_id())
            peer.send(uid)
        else:
            uid = peer.recv()
        state["nccl"], state["cupy"] = nccl, _new_comm(uid, rank)
    else:
        torch.distributed.init_process_group(
            "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, device_id=device
        )
        state["torch"] = True
    # NCCL connects a pair inside its first send/recv, and that first receive blocks the host until the send
    # arrives: one exchange now, so the timed loop's "posted" handshake cannot deadlock on it.
    probe = torch.zeros(1, dtype=torch.uint8, device=device)
    if kind == "cupy":
        op = state["cupy"].send if rank == 0 else state["cupy"].recv
        op(
            probe.data_ptr(),
            1,
            state["nccl"].NCCL_UINT8,
            1 - rank,
            torch.cuda.current_stream(device).cuda_stream,
        )
    elif rank == 0:
        torch.distributed.send(probe, dst=1)
    else:
        torch.distributed.recv(probe, src=0)
    torch.cuda.synchronize(device)


def nccl_p2p(
    kind: str, rank: int, nbytes: int, runs: int, peer, device: torch.device, state: dict
) -> list[float]:
    """Send timed on the sender after the receiver posted its receive (so no wait for the peer is counted)."""
    if rank == 0:
        buf = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    else:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.current_stream(device).cuda_stream
    torch.cuda.synchronize(device)
    times = []
    for _ in range(runs):
        if rank == 1:
            if kind == "cupy":
                state["cupy"].recv(buf.data_ptr(), nbytes, state["nccl"].NCCL_UINT8, 0, stream)
                work = None
            else:
                work = torch.distributed.irecv(buf, src=0)
            peer.send(b"posted")
            if work is not None:
                work.wait()
            torch.cuda.synchronize(device)
            continue
        expect(peer, b"posted")
        start = time.perf_counter()
        if kind == "cupy":
            state["cupy"].send(buf.data_ptr(), nbytes, state["nccl"].NCCL_UINT8, 1, stream)
        else:
            torch.distributed.send(buf, dst=1)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def ipc_export(nbytes: int, peer, device: torch.device) -> list[float]:
    from cupy.cuda import runtime

    from kv_transfer.cuda_ipc import allocation_range

    buf = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    torch.cuda.synchronize(device)
    base, _ = allocation_range(buf.data_ptr())
    peer.send((bytes(runtime.ipcGetMemHandle(base)), buf.data_ptr() - base))
    expect(peer, b"done")  # keep `buf` alive while the decode side pulls
    return []


def ipc_pull(nbytes: int, runs: int, peer, device: torch.device, state: dict) -> list[float]:
    """One-sided copy of the peer's buffer into ours, on our stream (what cuda_ipc does, minus the blocks)."""
    from cupy.cuda import runtime

    handle, offset = peer.recv()
    if state.get("ipc_handle") != handle:
        if "ipc_base" in state:
            runtime.ipcCloseMemHandle(state["ipc_base"])
        state["ipc_handle"], state["ipc_base"] = handle, int(runtime.ipcOpenMemHandle(handle))
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.current_stream(device)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        runtime.memcpyAsync(
            buf.data_ptr(), state["ipc_base"] + offset, nbytes, runtime.memcpyDefault, stream.cuda_stream
        )
        stream.synchronize()
        times.append(time.perf_counter() - start)
    peer.send(b"done")
    return times
