"""Probe: attention of a short chunk over a long cached prefix, one Llama-3-8B layer (32 query heads, 8 KV
heads, head_dim 128, bf16) on one GPU. Today's cached group, one FlashAttention-2 varlen call over the whole
context, against the prefix split into S parts (one non-causal varlen call, the queries repeated per part) plus
the chunk's own keys (one causal call), merged by their log-sum-exps (here in torch ops: `split` is the two
calls and that merge, `calls` the two calls alone). The kernels gained up to 3.3x; built into the engine the
split lost end to end, because such steps are host-bound, and it was dropped (docs/performance.md, "Mixed steps
are host-bound").

    PYTHONPATH=. python3 bench/diag/prefix_split_probe.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.prefill_attention import time_ms

HQ, HKV, D = 32, 8, 128
REPS = 50
SCALE = D**-0.5
PARTS = (2, 3, 4, 6, 8, 12, 16)
SHAPES = [(320, 2048), (128, 2048), (64, 4096), (512, 2048), (128, 8192), (1024, 2048), (2048, 2048)]


def cumulative(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def flash(q, k, v, cu_q, cu_k, max_q, max_k, causal):
    return torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=SCALE
    )[:2]


class Split:
    """The split of one shape into `parts` prefix parts: the two calls, and the two calls with their merge."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, parts: int) -> None:
        n = q.shape[0]
        self.n, self.parts = n, parts
        self.lens = [prefix // parts + (1 if i < prefix % parts else 0) for i in range(parts)]
        self.q, self.repeated = q, q.repeat(parts, 1, 1)
        self.kp, self.vp, self.ko, self.vo = k[:prefix], v[:prefix], k[prefix:], v[prefix:]
        self.cu_q, self.cu_k, self.cu_own = cumulative([n] * parts), cumulative(self.lens), cumulative([n])

    def calls(self) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        n = self.n
        a = flash(self.repeated, self.kp, self.vp, self.cu_q, self.cu_k, n, max(self.lens), False)
        b = flash(self.q, self.ko, self.vo, self.cu_own, self.cu_own, n, n, True)
        return a, b

    def merged(self) -> torch.Tensor:
        (oa, la), (ob, lb) = self.calls()
        n, s = self.n, self.parts
        lse = torch.cat([la.view(HQ, s, n), lb.view(HQ, 1, n)], 1)
        weights = torch.softmax(lse, 1).permute(1, 2, 0).unsqueeze(-1)
        outputs = torch.cat([oa.view(s, n, HQ, D), ob.view(1, n, HQ, D)])
        return (weights * outputs.float()).sum(0).to(self.q.dtype)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="JSON file for the rows")
    args = p.parse_args()
    torch.manual_seed(0)
    print(torch.__version__, torch.cuda.get_device_name())
    rows = []
    for n, prefix in SHAPES:
        ctx = prefix + n
        q = torch.randn(n, HQ, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(ctx, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        cu_q, cu_k = cumulative([n]), cumulative([ctx])

        def whole(q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k, n=n, ctx=ctx):
            return flash(q, k, v, cu_q, cu_k, n, ctx, True)

        reference = whole()[0].float()
        row: dict[str, object] = {"q": n, "prefix": prefix, "whole_ms": time_ms(whole, REPS)}
        for parts in PARTS:
            split = Split(q, k, v, prefix, parts)
            row[f"split{parts}_ms"] = time_ms(split.merged, REPS)
            row[f"calls{parts}_ms"] = time_ms(split.calls, REPS)
            row[f"split{parts}_max_err"] = float((split.merged().float() - reference).abs().max())
        rows.append(row)
        best = min(PARTS, key=lambda s: float(row[f"calls{s}_ms"]))  # type: ignore[arg-type]
        print(
            f"q {n:5d} prefix {prefix:5d}: whole {row['whole_ms']:.3f} ms, calls at best {row[f'calls{best}_ms']:.3f}"
            f" ({best} parts); " + " ".join(f"S{s} {row[f'calls{s}_ms']:.3f}" for s in PARTS)
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1
            )


if __name__ == "__main__":
    main()
