"""What the KV handoff GPU tests share (test_kv_transfer_gpu.py: real peers, test_kv_rogue_peers_gpu.py: peers that
misbehave): the layout, caches from a seed, checksums, configs, a block pool, and spawning the peer process.

nccl needs two GPUs (NCCL refuses two ranks on one GPU); cuda_ipc runs across two processes on one or two GPUs.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import random
import threading
import time

import pytest
import torch

from kv_transfer import FirstToken, KVReceiver, TransferConfig
from model_runtime.kv_layout import KVLayout

for _name, _value in (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ[_name] = _value  # inherited by the spawned peers

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
try:
    import cupy  # noqa: F401

    HAS_CUPY = True
except ImportError:
    HAS_CUPY = False

MARKS = [
    pytest.mark.gpu,
    pytest.mark.timeout(120),
    pytest.mark.skipif(GPUS < 1 or not HAS_CUPY, reason="needs a CUDA GPU and CuPy"),
]
NCCL_ONLY = pytest.mark.skipif(GPUS < 2, reason="nccl needs two GPUs")
KINDS = [pytest.param("nccl", marks=NCCL_ONLY), "cuda_ipc"]
FIRST = FirstToken(11, -0.5)
NUM_BLOCKS = 64


def layout_of() -> KVLayout:
    return KVLayout(
        num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, num_blocks=NUM_BLOCKS, dtype="bfloat16"
    )


def make_cache(seed: int, device: str) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    cache = torch.randn(layout_of().cache_shape, generator=gen, device=device).to(torch.bfloat16)
    torch.cuda.synchronize(device)  # sends pass no `ready` event: the KV writes must be complete
    return cache


def checksum(cache: torch.Tensor, ids) -> str:
    gathered = cache[:, :, list(ids)].contiguous().cpu()
    return hashlib.sha256(gathered.view(torch.uint8).numpy().tobytes()).hexdigest()


def devices(kind: str) -> tuple[str, str]:
    """(receiver device in the parent, sender device in the child)."""
    return "cuda:0", ("cuda:1" if GPUS > 1 else "cuda:0")


def config(kind: str, **kw) -> TransferConfig:
    """`kind`: one transport, or several comma-separated ("cuda_ipc,nccl": transfer.kinds in that order)."""
    base = dict(
        kinds=tuple(kind.split(",")),
        poll_interval_s=0.01,
        connect_timeout_s=10.0,
        transfer_timeout_s=30.0,
        lease_ttl_s=30.0,
        pair_setup_timeout_s=60.0,
    )
    return TransferConfig(**{**base, **kw})


class FreeList:
    def __init__(self, seed: int) -> None:
        self.free_ids = list(range(1, NUM_BLOCKS))
        random.Random(seed).shuffle(self.free_ids)
        self.lock = threading.Lock()

    def allocate(self, n: int):
        with self.lock:
            out, self.free_ids = self.free_ids[:n], self.free_ids[n:]
            return out if len(out) == n else None

    def free(self, ids) -> None:
        with self.lock:
            self.free_ids.extend(ids)

    @property
    def all_free(self) -> bool:
        return len(self.free_ids) == NUM_BLOCKS - 1


def wait_results(receiver: KVReceiver, n: int = 1, timeout: float = 30.0):
    end, out = time.monotonic() + timeout, []
    while len(out) < n and time.monotonic() < end:
        out += receiver.poll()
        time.sleep(0.01)
    assert len(out) == n, f"expected {n} results, got {out}"
    return out


def spawn(target, *args):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    return parent, proc
