"""How a split-KV decode launch is planned (attention.triton_decode): the kernel's launch knobs (DecodeTuning),
the segment count chosen from shapes alone, and the scratch its stage 1 writes, sized before CUDA-graph capture
and reused by every layer and step."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

MAX_SEGMENTS = 64
DEFAULT_TILE_N = 64


@dataclass(frozen=True)
class DecodeScratch:
    """Stage-1 results: partial outputs [S, Hq, G, D] and base-2 log-sum-exps [S, Hq, G] (fp32)."""

    partial_out: torch.Tensor
    partial_lse: torch.Tensor


class DecodeWorkspace:
    """Scratch for the split-KV decode, grown on demand and reused by every layer and step.

    Views are carved from the front of two flat buffers, so a given (batch, heads, segments, head_dim) always
    gets the same addresses: what a captured CUDA graph needs. Size it with `reserve` before capturing;
    growing during a capture is refused (the graph would hold an address the next growth frees).
    """

    def __init__(self) -> None:
        self._out: torch.Tensor | None = None
        self._lse: torch.Tensor | None = None

    def reserve(
        self, num_seqs: int, num_heads: int, num_segments: int, head_dim: int, device: torch.device | str
    ) -> None:
        self.scratch(num_seqs, num_heads, num_segments, head_dim, torch.device(device))

    def scratch(
        self, num_seqs: int, num_heads: int, num_segments: int, head_dim: int, device: torch.device
    ) -> DecodeScratch:
        lse_numel = num_seqs * num_heads * num_segments
        out_numel = lse_numel * head_dim
        if self._needs_growth(out_numel, lse_numel, device):
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"DecodeWorkspace: scratch for {num_seqs} sequences x {num_heads} heads x {num_segments} "
                    "segments is not reserved; call TritonAttention.reserve(...) (or run the largest batch "
                    "eagerly) before CUDA-graph capture"
                )
            self._out = torch.empty(out_numel, dtype=torch.float32, device=device)
            self._lse = torch.empty(lse_numel, dtype=torch.float32, device=device)
        assert self._out is not None and self._lse is not None  # set just above; narrows the type
        shape = (num_seqs, num_heads, num_segments)
        return DecodeScratch(self._out[:out_numel].view(*shape, head_dim), self._lse[:lse_numel].view(shape))

    def _needs_growth(self, out_numel: int, lse_numel: int, device: torch.device) -> bool:
        if self._out is None or self._lse is None or self._out.device != device:
            return True
        return self._out.numel() < out_numel or self._lse.numel() < lse_numel


def choose_num_segments(num_seqs: int, num_kv_heads: int, target_programs: int) -> int:
    """Segments per sequence from shapes only (never from seq_lens, so a CUDA graph's grid stays valid).

    Enough (sequence, KV head, segment) programs to fill the GPU about `target_programs` deep; a power of two
    (the reduce kernel's arange) capped at MAX_SEGMENTS. Large batches get 1: no split, no reduce pass.
    """
    wanted = math.ceil(target_programs / max(1, num_seqs * num_kv_heads))
    return min(MAX_SEGMENTS, triton.next_power_of_2(max(1, wanted)))


@dataclass(frozen=True)
class DecodeTuning:
    """Launch knobs of the stage-1 kernel: tokens per loop step, warps per program, software-pipeline depth.

    Defaults from a sweep on an H200 (Llama-3-8B layer, bf16, block 16; bench/attention.py): 64/4/2 is within
    a few percent of the best setting everywhere and at the roofline for large batches. 32 tokens with 2 warps
    is 5-15% faster at batch <= 32 but 25% slower at batch 128 with one segment; 128-token tiles or 8 warps
    are slower throughout. An FP8 cache takes 128-token tiles (`fp8_tile_n`): with 64 its kernel ran at 0.96x
    the bf16 one, with 128 at 1.06-1.13x (batch 32-256, contexts 2k-8k; 4 pipeline stages or 8 warps were
    slower; bench/results/fp8/attention_tiles_run2.txt), and 3 pipeline stages (`fp8_num_stages`): 3-4% faster
    than 2 on an H100 at batch 128-256 (bench/results/fp8/attention_sweep_h100_run6.log).

    `fp8_max_registers` caps the FP8 kernel's registers per thread (Triton's maxnreg; None: the compiler's
    choice), which decides how many of its programs an SM holds at once: uncapped it took 203-204 (Triton 3.6,
    sm_90), two programs an SM; at 168, three, and the kernel ran 1.02-1.20x faster at batch 32-300 on an H200;
    at 128 (four programs, spilling) and 96 it ran slower, as with 8 warps or 64-token tiles
    (bench/results/fp8/attention_run52_*.json).
    """

    tile_n: int = DEFAULT_TILE_N
    num_warps: int = 4
    num_stages: int = 2
    fp8_tile_n: int = 128
    fp8_num_stages: int = 3
    fp8_max_registers: int | None = 168

    def __post_init__(self) -> None:
        for name, tile in (("tile_n", self.tile_n), ("fp8_tile_n", self.fp8_tile_n)):
            if tile < 16 or tile & (tile - 1):
                raise ValueError(f"DecodeTuning.{name}: must be a power of two >= 16, got {tile}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"DecodeTuning.num_warps: must be 1, 2, 4, 8 or 16, got {self.num_warps}")
        for name, stages in (("num_stages", self.num_stages), ("fp8_num_stages", self.fp8_num_stages)):
            if not 1 <= stages <= 6:
                raise ValueError(f"DecodeTuning.{name}: must be in [1, 6], got {stages}")
        regs = self.fp8_max_registers
        if regs is not None and not (24 <= regs <= 255 and regs % 8 == 0):
            raise ValueError(
                f"DecodeTuning.fp8_max_registers: must be a multiple of 8 in [24, 255], got {regs}"
            )
