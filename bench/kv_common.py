"""What the KV handoff benchmarks share (bench/kv_transfer.py, bench/kv_sharded.py): the Llama-3-8B KV layout,
the transfer settings, the landed blocks' self-check, the decode side's block pool and landing, the medians and
the NCCL versions."""

from __future__ import annotations

import hashlib
import random
import statistics
import threading
import time

import torch

from kv_transfer import TransferConfig, TransferResult
from model_runtime.kv_layout import KVLayout

SPARE_BLOCKS = 64


def llama3_8b_layout(max_tokens: int) -> KVLayout:
    """32 layers, 8 KV heads, head dim 128, bf16, block size 16: 128 KiB of KV per token."""
    blocks = -(-max_tokens // 16) + SPARE_BLOCKS
    return KVLayout(
        num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, num_blocks=blocks, dtype="bfloat16"
    )


def transfer_config(kind: str) -> TransferConfig:
    return TransferConfig(
        kind=kind,
        poll_interval_s=0.005,
        transfer_timeout_s=300.0,
        lease_ttl_s=300.0,
        connect_timeout_s=30.0,
        pair_setup_timeout_s=120.0,
    )


def kv_checksum(cache: torch.Tensor, ids: list[int]) -> str:
    """Position-weighted sums of each (layer, K|V, block) of cache[:, :, ids], in ids order, on the GPU."""
    index = torch.tensor(ids, device=cache.device)
    weights = torch.arange(cache[0, 0, 0].numel(), device=cache.device) % 251 + 1
    sums = []
    for layer in range(cache.shape[0]):
        blocks = cache[layer].index_select(1, index).reshape(2, len(ids), -1)
        sums.append((blocks.view(torch.int16).to(torch.int64) * weights).sum(-1))
    return hashlib.sha256(torch.stack(sums).cpu().numpy().tobytes()).hexdigest()


def check_landed(cache: torch.Tensor, ids: list[int], expected: str, what: str) -> None:
    """The landed blocks cache[:, :, ids] against the source blocks' checksum; then zero them. The free list
    hands ids out again in the order they came back, so without the zeroing a rep that wrote nothing into
    blocks an earlier rep filled would pass. Raises RuntimeError naming `what` on a mismatch."""
    if kv_checksum(cache, ids) != expected:
        raise RuntimeError(f"CHECKSUM MISMATCH: {what}")
    cache.index_fill_(2, torch.tensor(ids, device=cache.device), 0)
    if cache.is_cuda:  # the receiver writes the next rep on streams of its own: the zeros must come first
        torch.cuda.synchronize(cache.device)


class FreeList:
    """The decode side's block pool: scattered ids, thread-safe."""

    def __init__(self, num_blocks: int) -> None:
        self.ids = list(range(1, num_blocks))
        random.Random(0).shuffle(self.ids)
        self.lock = threading.Lock()

    def allocate(self, n: int) -> list[int] | None:
        with self.lock:
            out, self.ids = self.ids[:n], self.ids[n:]
            return out if len(out) == n else None

    def free(self, ids) -> None:
        with self.lock:
            self.ids.extend(ids)


def use_device(spec: str) -> torch.device:
    """This process's device ("cpu" for --smoke, else "cuda:N"), made current."""
    device = torch.device(spec)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


class Landing:
    """on_result target: the receiver's thread reports, the benchmark loop waits."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.result: TransferResult | None = None
        self.landed_at = 0.0

    def put(self, result: TransferResult) -> None:
        # the receiver's own moment of landing; time.monotonic is one clock for both processes (host-wide)
        self.landed_at = result.landed_at or time.monotonic()
        self.result = result
        self.event.set()


def median_rate(times: list[float], warmup: int, nbytes: int) -> tuple[float, float]:
    med = statistics.median(times[warmup:])
    return med, nbytes / med / 1e9


def median_phases(samples: list[dict[str, float]]) -> dict[str, float]:
    names = {name for sample in samples for name in sample}
    return {name: statistics.median(s.get(name, 0.0) for s in samples) for name in sorted(names)}


def nccl_versions() -> dict[str, object]:
    from cupy.cuda import nccl

    return dict(cupy_nccl=nccl.get_version(), torch_nccl=".".join(map(str, torch.cuda.nccl.version())))
