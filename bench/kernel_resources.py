"""What the decode attention kernel compiles to on a GPU this machine does not have: registers, shared memory and
instruction counts, read off Triton's own compiler output. Needs no GPU (CPU box or CI).

    python bench/kernel_resources.py [--arch 90] [--json PATH]

The lent GPU machines have no kernel profiler. The counts that explained the FP8 decode kernel's speed came from
here instead (docs/performance.md, "What bound it"): its registers a thread (how many programs an SM holds), its
shared memory, and per kind the instructions it issues a tile (mma, ldmatrix, single-byte shared loads, e4m3
conversions). Each kernel is compiled exactly as the engine launches it: attention.triton_decode.segment_launch
gives the arguments, constexprs and compile options for Llama-3-8B's shape (32 query heads, 8 KV heads, head dim
128, block 16), and the arguments are specialized as Triton's launcher specializes them (integers equal to 1 as
constants, pointers and integers divisible by 16 marked so). Triton's bundled ptxas assembles the PTX and its
cuobjdump reads the registers and the SASS, so the numbers are the toolchain's, for the Triton installed here
(a GPU machine's Triton may differ: compare there with the same script).

Kernels: bf16 (the 16-bit cache), fp8 (the FP8 cache as launched on sm_89+), fp8-plain (the FP8 cache with Triton
converting V itself, as on older devices and in the interpreter: the byte-by-byte V gather the engine avoids),
and skinny-fp8: the FP8 projections' matmul at <= 16 tokens (fused/skinny_matmul.skinny_matmul_fp8) for
Llama-3-8B's qkv at its first autotune configuration, which should issue e4m3 wgmma and no conversion
(`compile_skinny_fp8` compiles any of its configurations).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model_runtime.attention.decode_plan import DecodeTuning, DecodeWorkspace
from model_runtime.attention.triton_decode import _decode_segment_kernel, segment_launch

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK, BATCH, NUM_BLOCKS = 32, 8, 128, 16, 128, 64
KERNELS = ("bf16", "fp8", "fp8-plain", "skinny-fp8")
TRITON_TYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.int32: "i32",
    torch.int64: "i64",
}


@dataclass(frozen=True)
class KernelResources:
    kernel: str
    arch: int
    registers: int
    shared_bytes: int
    sass_instructions: int
    mma: int  # mma.sync in the PTX
    ldmatrix: int
    shared_byte_loads: int  # ld.shared.b8 / .u8 / .s8: an operand gathered a byte at a time
    e4m3_conversions: int  # cvt.rn.f16x2.e4m3x2
    sass_by_opcode: dict[str, int]
    wgmma: int = 0  # wgmma.mma_async (Hopper's warpgroup MMA) in the PTX
    e4m3_mma: int = 0  # mma.sync or wgmma with e4m3 operands: a dot on FP8 codes as stored


def _toolchain() -> Path:
    import triton.backends.nvidia as nvidia

    return Path(nvidia.__file__).parent / "bin"


def _signature(
    kernel: Any, launch_args: tuple[object, ...]
) -> tuple[dict[str, str], dict, dict[str, object]]:
    """Triton types for `kernel`'s positional arguments, with the launcher's specializations: attrs (divisible
    by 16) and constants (integers equal to 1)."""
    names = list(kernel.arg_names)
    do_not_specialize = set(kernel.do_not_specialize)  # argument names
    signature: dict[str, str] = {}
    attrs: dict[tuple[int, ...], list[list[object]]] = {}
    constants: dict[str, object] = {}
    for i, (name, value) in enumerate(zip(names, launch_args, strict=False)):
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + TRITON_TYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch's allocations are 16-byte aligned
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif isinstance(value, int):
            if value == 1 and name not in do_not_specialize:
                signature[name], constants[name] = "constexpr", 1
                continue
            signature[name] = "i32"
            if value % 16 == 0 and name not in do_not_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            raise TypeError(f"kernel_resources: argument {name} of type {type(value).__name__}")
    return signature, attrs, constants


def _inputs(kernel: str) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
    """CPU tensors of the launch's shapes and dtypes (their values are never read)."""
    cache_dtype = torch.float8_e4m3fn if kernel.startswith("fp8") else torch.bfloat16
    q = torch.zeros(BATCH, Q_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    k_cache = torch.zeros(NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    block_tables = torch.zeros(BATCH, 128, dtype=torch.int32)
    seq_lens = torch.zeros(BATCH, dtype=torch.int32)
    kv_scale = (
        torch.zeros(2, NUM_BLOCKS, BLOCK, KV_HEADS, dtype=torch.bfloat16)
        if cache_dtype != torch.bfloat16
        else None
    )
    return (q, k_cache, v_cache, block_tables, seq_lens), kv_scale


def compile_kernel(kernel: str, arch: int = 90, tuning: DecodeTuning | None = None) -> KernelResources:
    """Compile the decode kernel (or skinny-fp8) for sm_<arch> as the engine would launch it on that device, and
    count."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel_resources: kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    if kernel == "skinny-fp8":
        from model_runtime.fused.skinny_matmul import _TUNED_FP8

        return compile_skinny_fp8(_TUNED_FP8.configs[0], arch)
    (q, k_cache, v_cache, block_tables, seq_lens), kv_scale = _inputs(kernel)
    out = torch.zeros_like(q)
    scratch = DecodeWorkspace().scratch(BATCH, Q_HEADS, 1, HEAD_DIM, q.device)
    launch = segment_launch(
        q, k_cache, v_cache, block_tables, seq_lens, HEAD_DIM**-0.5, scratch, out, 1, tuning or DecodeTuning(),
        kv_scale, converts_e4m3=kernel == "fp8" and arch >= 89,
    )  # fmt: skip
    return _compile(
        kernel, _decode_segment_kernel, launch.args, launch.constexprs, dict(launch.options), arch
    )


def compile_skinny_fp8(config: Any, arch: int = 90) -> KernelResources:
    """skinny_matmul_fp8's kernel for Llama-3-8B's qkv (16 token rows, N 6144, K 4096, no bias) at one of its
    autotune configurations (a triton.Config), as skinny_matmul_fp8 launches it on sm_<arch>."""
    from model_runtime.fused.skinny_matmul import _skinny_fp8_kernel

    n, k = 6144, 4096
    codes = torch.zeros(16, k, dtype=torch.float8_e4m3fn)
    out = torch.zeros(16, n, dtype=torch.bfloat16)
    args = (codes, torch.zeros(16, 1), torch.zeros(n, k, dtype=torch.float8_e4m3fn), torch.zeros(n), out, out,
            16, n, k, k, k, n)  # fmt: skip
    constexprs = {**config.kwargs, "HAS_BIAS": False, "E4M3_DOT": arch >= 89}
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    return _compile("skinny-fp8", _skinny_fp8_kernel, args, constexprs, options, arch)


def _compile(
    name: str, kernel: Any, args: tuple[object, ...], constexprs: dict, options: dict, arch: int
) -> KernelResources:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, attrs, constants = _signature(kernel, args)
    constants.update(constexprs)
    for key in constexprs:
        signature[key] = "constexpr"
    source = ASTSource(kernel, signature, constants, attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    return _count(name, arch, compiled.asm["ptx"], compiled.asm["cubin"], int(compiled.metadata.shared))


def _count(kernel: str, arch: int, ptx: str, cubin: bytes, shared: int) -> KernelResources:
    cuobjdump = str(_toolchain() / "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run(
            [cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
        )
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True)
    registers = int(re.search(r"REG:(\d+)", usage.stdout).group(1))  # type: ignore[union-attr]
    opcodes: Counter[str] = Counter()
    for line in sass.stdout.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m:
            opcodes[m.group(1)] += 1
    return KernelResources(
        kernel=kernel,
        arch=arch,
        registers=registers,
        shared_bytes=shared,
        sass_instructions=sum(opcodes.values()),
        mma=len(re.findall(r"\bmma\.sync\b", ptx)),
        ldmatrix=len(re.findall(r"\bldmatrix\.", ptx)),
        shared_byte_loads=len(re.findall(r"\bld\.shared\.[bsu]8\b", ptx)),
        e4m3_conversions=len(re.findall(r"cvt\.rn\.f16x2\.e4m3x2", ptx)),
        sass_by_opcode=dict(opcodes.most_common(12)),
        wgmma=len(re.findall(r"\bwgmma\.mma_async\b", ptx)),
        e4m3_mma=len(re.findall(r"\b(?:mma\.sync|wgmma\.mma_async)\S*\.e4m3\.e4m3\b", ptx)),
    )


def main(argv: list[str] | None = None) -> list[KernelResources]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 (H100/H200)")
    parser.add_argument("--kernels", default=",".join(KERNELS), help=f"a comma list of {', '.join(KERNELS)}")
    parser.add_argument("--json", default=None, help="also write the counts here")
    args = parser.parse_args(argv)
    kernels = [k.strip() for k in args.kernels.split(",")]
    unknown = [k for k in kernels if k not in KERNELS]
    if unknown:
        raise SystemExit(f"--kernels: unknown {', '.join(unknown)}; a comma list of {', '.join(KERNELS)}")
    rows = []
    for kernel in kernels:
        print(f"compiling {kernel} for sm_{args.arch} ...", flush=True)
        rows.append(compile_kernel(kernel, args.arch))
    print(
        f"\n{'kernel':>10} {'regs':>5} {'smem KB':>8} {'SASS':>6} {'mma':>5} {'ldmatrix':>9} {'byte lds':>9} "
        f"{'e4m3 cvt':>9} {'wgmma':>6} {'e4m3 mma':>9}"
    )
    for r in rows:
        print(
            f"{r.kernel:>10} {r.registers:>5} {r.shared_bytes / 1024:>8.1f} {r.sass_instructions:>6} {r.mma:>5} "
            f"{r.ldmatrix:>9} {r.shared_byte_loads:>9} {r.e4m3_conversions:>9} {r.wgmma:>6} {r.e4m3_mma:>9}"
        )
    print("(static counts over the whole kernel: a tile's loop plus its prologue and epilogue)")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
        print(f"wrote {args.json}")
    return rows


if __name__ == "__main__":
    main()
