"""SiLU-and-multiply writing FP8 rows (TritonOps.silu_mul_fp8, the input of an FP8 down projection) against its
bytes' roofline and against the unfused kernel, on the GPU, at decode batches and prefill chunk sizes: the kernel
that holds a whole row in one program's registers (model_runtime.fused.triton_ops.launch_silu_mul_fp8) at
several warp counts. (Runs 59-60 also timed two passes over column chunks, the second re-reading gate and up from
L2, at 67b1abe: slower than the row kernel at every size, so removed; docs/performance.md. Run 78 timed the row
kernel multiplying by the scale's reciprocal beside the one dividing each element: 147 against 223 us at 8,192
rows, 4.5 codes in a million one step apart; the multiply is the kernel since.)

    python3 bench/fused_rows.py [--rows 32,300,512,2048,8192] [--width 14336] [--reps 20] [--out PATH]
    python3 bench/fused_rows.py --smoke      # CPU (Triton's interpreter): every variant's bytes, times nothing

Per row count, CUDA-event-timed CUDA-graph replays of 10 back-to-back calls (median of --reps), in one run:
- silu_mul: the unfused kernel (bfloat16 out), which the FP8 path replaced with silu_mul + act_quant;
- row: the whole row in one program's registers (one read of gate and up, one write of the codes) at the
  engine's warp count; row/wW the same with W warps.
Floor: the bytes one call must move (gate and up in bfloat16, the codes, the scales) at the HBM copy rate
measured in the same run. Every FP8 variant's codes and scales are checked byte for byte against the row kernel's
(on the CPU: against the interpreter's row kernel). Writes bench/results/fused_rows_<gpu>.json and prints a table.
A row count of under ~2k rows fits in L2 across the 10 replayed calls, so small counts read high.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROW_WARPS = (4, 8, 32)  # the engine's choice for 14336 is 16 ("row")


def variants() -> dict[str, int | None]:
    """name -> num_warps for launch_silu_mul_fp8 (None: the engine's own)."""
    return {"row": None} | {f"row/w{warps}": warps for warps in ROW_WARPS}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="32,300,512,2048,8192")
    p.add_argument("--width", type=int, default=14336, help="I: gate_up is [rows, 2I] (Llama-3-8B: 14336)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument(
        "--smoke", action="store_true", help="CPU under Triton's interpreter: small sizes, checks only"
    )
    p.add_argument("--out")
    args = p.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
    import torch

    from bench import harness as gpu
    from bench.attention import time_graph
    from model_runtime.fused.fp8_rows import QuantizedRows
    from model_runtime.fused.triton_ops import TritonOps, launch_silu_mul_fp8
    from model_runtime.weights.canonical import FP8_DTYPE

    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        p.error("needs a CUDA GPU (or --smoke)")
    row_counts = [int(r) for r in ("1,3" if args.smoke else args.rows).split(",")]
    width = 300 if args.smoke else args.width
    dtype = torch.float32 if args.smoke else torch.bfloat16
    hbm = 0.0 if args.smoke else gpu.measure_copy_gbps(device, 2 << 30)
    table, results = variants(), []
    for rows in row_counts:
        gen = torch.Generator(device=device).manual_seed(rows)
        gate_up = (torch.randn(rows, 2 * width, device=device, generator=gen) * 3).to(dtype)
        outs = {name: QuantizedRows(torch.empty(rows, width, dtype=FP8_DTYPE, device=device),
                                    torch.empty(rows, 1, device=device)) for name in table}  # fmt: skip
        calls = {name: partial(launch_silu_mul_fp8, gate_up, outs[name], w) for name, w in table.items()}
        for call in calls.values():
            call()
        ref = outs["row"]
        wrong = [name for name, o in outs.items()
                 if not (torch.equal(o.codes.view(torch.uint8), ref.codes.view(torch.uint8))
                         and torch.equal(o.scales, ref.scales))]  # fmt: skip
        row: dict = {"rows": rows, "width": width, "wrong": wrong}
        nbytes = rows * (2 * width * gate_up.element_size() + width + 4)
        if device == "cuda":
            ops = TritonOps()
            row["us"] = {"silu_mul": time_graph(partial(ops.silu_mul, gate_up), 10, args.reps)}
            row["us"] |= {name: time_graph(call, 10, args.reps) for name, call in calls.items()}
            row["floor_us"] = nbytes / (hbm * 1e9) * 1e6
        results.append(row)
        gpu.log(f"{rows} rows done" + (f"; codes differ from the row kernel's: {wrong}" if wrong else ""))
    gpu_name = gpu.device_name(device)
    doc = {"benchmark": "silu_mul_fp8 kernels vs their bytes' roofline", "gpu": gpu_name,
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "hbm_gbps": hbm,
           "variants": table, "rows": results}  # fmt: skip
    path = Path(args.out) if args.out else gpu.result_path(None, "fused_rows", device, args.smoke)
    gpu.write_json_atomic(path, doc)
    if device == "cuda":
        names = ["silu_mul", *table]
        print(f"\n{gpu_name}: silu_mul_fp8, us per call (HBM {hbm:.0f} GB/s; % = the bytes' floor / time)")
        for r in results:
            best = min(table, key=lambda n: r["us"][n])
            cells = ", ".join(f"{n} {r['us'][n]:.1f} ({r['floor_us'] / r['us'][n]:.0%})" for n in names)
            print(f"{r['rows']:>6} x {r['width']}: floor {r['floor_us']:.1f}; {cells}; fastest FP8: {best}")
    print(f"wrote {path}")
    bad = [r for r in results if r["wrong"]]
    if bad:
        print(f"codes or scales differ from the row kernel's: {bad}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
