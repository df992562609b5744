"""KVLayout: the single owner of the paged KV cache's shape, bytes and slot arithmetic.

The allocator (block_pool), the cache tensor (model_runner), attention kernels and kv_transfer all derive what
they need from one KVLayout. Prefill and decode workers compare `fingerprint()` when they pair, so two sides
that disagree on the format of a block refuse to pair instead of silently corrupting KV.

One tensor holds the whole cache:

    cache[layer, kv, block, offset, kv_head, head_dim]      kv: 0 = K, 1 = V
          L      2   N      B       H        D

    slot(token t of a sequence) = block_table[t // B] * B + t % B

so `cache[l, 0]` is layer l's K pages, contiguous, `[N, B, H, D]`, and a token's slot indexes the flattened
`[N * B, H, D]` view. Block 0 is the null block: never handed out, the target of padding in CUDA graphs.
A request's blocks move between workers as `cache[:, :, block_ids]` (all layers) or `cache[l, :, block_ids]`
(one layer, for transfer overlapped with prefill).

Under tensor parallelism each rank's cache holds only its KV heads: H is the rank's count and `shard` says
which of the model's heads they are (model heads [head_start, head_start + H), replicated on several ranks when
the model has fewer KV heads than ranks). A sharded layout's fingerprint covers the sharding, so a rank never
pairs with a peer that holds other heads; an unsharded layout (shard None) fingerprints exactly as before.

An FP8 cache (dtype float8_e4m3fn, `quantized`) stores one byte per element and one bfloat16 scale per token
and KV head (model_runtime.kv_quant). A block of one layer's K (or V) is `block_bytes` bytes: its codes
[B, H, D], then its scales [H, B] (a head's B scales side by side, so a kernel reads them in one 32-byte
sector), padded to 16 bytes:

    cache[layer, kv, block, byte]      block: B*H*D codes | H*B bf16 scales | padding

The scales live inside the blocks, so every path that moves blocks (prefix copies, each transport) moves them
with the codes, and a block's bytes mean the same on every worker that has the same format fields. A handoff
moves about half of a bfloat16 cache's bytes (Llama-3-8B: 16,640 per block and layer against 32,768).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

from model_runtime.config import DTYPES, ConfigError
from model_runtime.request_rules import ints_within

FP8_KV_DTYPE = "float8_e4m3fn"  # the layout's (and torch's) name for cache.dtype fp8_e4m3
LAYOUT_DTYPES = (*DTYPES, FP8_KV_DTYPE)
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, FP8_KV_DTYPE: 1}
NULL_BLOCK = 0
FP8_SCALE_BYTES = 2  # one bfloat16 scale per (token, KV head) in an FP8 cache
BLOCK_ALIGN = 16  # an FP8 block is padded to this many bytes, so that every block's codes start aligned

# The fields that define what a block's bytes mean. num_blocks is not among them: the two sides of a
# handoff may size their caches differently.
FORMAT_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype")


@dataclass(frozen=True)
class KVShard:
    """Which of the model's KV heads one tensor-parallel rank's cache holds."""

    tp_size: int
    tp_rank: int
    head_start: int  # the model's index of the rank's first KV head
    model_kv_heads: int  # KV heads of the whole model

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(f"KVShard.tp_rank: must be in [0, {self.tp_size}), got {self.tp_rank}")
        if not 0 <= self.head_start < self.model_kv_heads:
            raise ConfigError(
                f"KVShard.head_start: must be in [0, {self.model_kv_heads}), got {self.head_start}"
            )

    def describe(self) -> str:
        fields = ("tp_size", "tp_rank", "head_start", "model_kv_heads")
        return ";".join(f"{name}={getattr(self, name)}" for name in fields)


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int  # heads in this cache: the rank's own under tensor parallelism
    head_dim: int
    block_size: int
    num_blocks: int
    dtype: str
    shard: KVShard | None = None  # None: one rank holds every head

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"KVLayout.{name}: must be positive, got {getattr(self, name)}")
        if self.num_blocks < 2:
            raise ConfigError(
                f"KVLayout.num_blocks: must be >= 2 (block 0 is reserved), got {self.num_blocks}"
            )
        if self.dtype not in LAYOUT_DTYPES:
            raise ConfigError(f"KVLayout.dtype: must be one of {LAYOUT_DTYPES}, got {self.dtype!r}")
        if self.shard is not None and self.shard.head_start + self.num_kv_heads > self.shard.model_kv_heads:
            raise ConfigError(
                f"KVLayout.shard: heads [{self.shard.head_start}, {self.shard.head_start + self.num_kv_heads}) "
                f"exceed the model's {self.shard.model_kv_heads} KV heads"
            )

    # --- shape and bytes -------------------------------------------------------------------------------
    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block of one layer's K (or V): [B, H, D] elements, or an FP8 cache's [block_bytes] bytes."""
        if self.quantized:
            return (self.block_bytes,)
        return (self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def cache_shape(self) -> tuple[int, ...]:
        """[L, 2, N, B, H, D] (FP8: [L, 2, N, block_bytes]): the one tensor of the whole cache."""
        return (self.num_layers, 2, self.num_blocks, *self.block_shape)

    @property
    def quantized(self) -> bool:
        """The cache holds FP8 codes and their scales: reading a value means multiplying by its scale."""
        return self.dtype == FP8_KV_DTYPE

    @property
    def element_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def block_bytes(self) -> int:
        """One block of one layer's K (or V): its values, or an FP8 cache's codes and scales (padded)."""
        return block_layer_bytes(
            self.block_size, self.num_kv_heads, self.head_dim, self.element_bytes, self.quantized
        )

    @property
    def bytes_per_block(self) -> int:
        """One block across all layers, K and V."""
        return 2 * self.num_layers * self.block_bytes

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token across all layers (an FP8 block's padding spread over its tokens)."""
        return self.bytes_per_block // self.block_size

    @property
    def bytes_per_block_layer(self) -> int:
        """One block of one layer, K and V."""
        return 2 * self.block_bytes

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_block * self.num_blocks

    @property
    def usable_blocks(self) -> int:
        """Blocks the pool can hand out (block 0 is the null block)."""
        return self.num_blocks - 1

    # --- tensor parallelism ----------------------------------------------------------------------------
    @property
    def model_kv_heads(self) -> int:
        """KV heads of the whole model (this cache may hold only some of them)."""
        return self.shard.model_kv_heads if self.shard is not None else self.num_kv_heads

    def whole(self) -> KVLayout:
        """The model's whole cache in this format: every head, no shard. Workers of different tensor-parallel
        sizes pair when their whole layouts agree (the router compares its fingerprint)."""
        if self.shard is None:
            return self
        return replace(self, num_kv_heads=self.model_kv_heads, shard=None)

    def head_window(self, begin: int, count: int) -> KVLayout:
        """Heads [begin, begin + count) of this cache as a layout of their own, for the bytes and staging shapes
        of a transfer that moves only them (a piece of a handoff between different tensor-parallel sizes).
        An FP8 block keeps its heads' codes and scales apart (see above), so it moves whole or not at all."""
        if not (begin >= 0 and count > 0 and begin + count <= self.num_kv_heads):
            raise ValueError(f"head window [{begin}, {begin + count}) is not inside [0, {self.num_kv_heads})")
        if count == self.num_kv_heads:
            return replace(self, shard=None)
        if self.quantized:
            raise ValueError(
                "head window: an FP8 cache's blocks move whole; a handoff between different tensor-parallel "
                "sizes needs a bfloat16, float16 or float32 cache"
            )
        return replace(self, num_kv_heads=count, shard=None)

    def staging_shape(self, num_blocks: int, layers: tuple[int, int] | None = None) -> tuple[int, ...]:
        """Shape of `cache[l0:l1, :, block_ids]`: the contiguous buffer a request's blocks travel in."""
        l0, l1 = layers if layers is not None else (0, self.num_layers)
        return (l1 - l0, 2, num_blocks, *self.block_shape)

    # --- slot arithmetic -------------------------------------------------------------------------------
    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def slot(self, block_table: list[int], position: int) -> int:
        return block_table[position // self.block_size] * self.block_size + position % self.block_size

    def slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        """Slots of positions [start, end) of a sequence whose blocks are `block_table`."""
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def check_block_ids(self, block_ids: list[int] | tuple[int, ...], where: str = "block id") -> None:
        """Reject ids outside [1, num_blocks): a peer must never make us read or write the null block or beyond.
        (ints_within first: a handoff checks hundreds of ids on its critical path.)"""
        if ints_within(block_ids, 1, self.num_blocks):
            return
        for b in block_ids:
            if not 1 <= b < self.num_blocks:
                raise ValueError(f"{where} {b} is out of range [1, {self.num_blocks})")

    # --- pairing ---------------------------------------------------------------------------------------
    def format_dict(self) -> dict[str, int | str]:
        return {name: getattr(self, name) for name in FORMAT_FIELDS}

    def fingerprint(self) -> str:
        text = ";".join(f"{k}={v}" for k, v in self.format_dict().items())
        if self.shard is not None:  # appended only when sharded: unsharded fingerprints stay as they were
            text += ";" + self.shard.describe()
        if self.quantized:  # names the FP8 block format: codes [B, H, D], then bf16 scales [H, B]
            text += ";fp8_block=codes_bhd+scales_hb_bf16"
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def mismatch(self, other_format: dict[str, int | str]) -> str | None:
        """None if `other_format` (a peer's format_dict) describes the same block format, else what differs."""
        diffs = [
            f"{k}: ours={getattr(self, k)} theirs={other_format.get(k)}"
            for k in FORMAT_FIELDS
            if getattr(self, k) != other_format.get(k)
        ]
        return "; ".join(diffs) if diffs else None


def block_layer_bytes(
    block_size: int, num_kv_heads: int, head_dim: int, element_bytes: int, quantized: bool
) -> int:
    """Bytes of one block of one layer's K (or V): B * H * D values, or FP8 codes then B * H bf16 scales, padded
    so that the next block starts on a BLOCK_ALIGN boundary."""
    values = block_size * num_kv_heads * head_dim * element_bytes
    if not quantized:
        return values
    raw = values + FP8_SCALE_BYTES * num_kv_heads * block_size
    return -(-raw // BLOCK_ALIGN) * BLOCK_ALIGN
