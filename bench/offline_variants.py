"""The engine variants bench/offline_throughput.py runs (--variants): which FP8 parts each turns on, the bytes its
ceiling counts, and how its rows compare with the bf16 rows of the same run (issue 19's goals).

    variant       device.quantization  cache.dtype   the ceiling's decode bytes (floors.ModelCost)
    bf16          none                 model dtype   every weight but the embedding table, K and V: model dtype
    fp8-weights   fp8                  model dtype   projections 1 byte an element + a float32 scale a row
    fp8-kv        none                 fp8_e4m3      K and V 1 byte an element
    fp8           fp8                  fp8_e4m3      both
    *-ahead       as without           as without    the same; steps scheduled ahead (scheduler.async_scheduling)
    *-exact       as without           as without    the same; FP8 matmuls accumulate in float32
                                                     (device.fp8_fast_accum false; the others: true, the default)

"bf16" is the model dtype: bfloat16 on a GPU, float32 in the CPU smoke. Embeddings, norms and lm_head stay in
the model dtype in every variant. The ceiling's FLOPs: with FP8 weights the projections' at the FP8 matmul
rate measured in the same run (harness.measure_fp8_matmul_tflops: 8192^3 e4m3 through torch._scaled_mm with
row-wise scales and fast accumulation, what the projections run), attention's and lm_head's at the model dtype's
rate. (Before 2026-11-29 every FLOP counted at the bf16 rate, so FP8 rows could read above 100%.) fp8_group's
Triton GEMM is counted at the same FP8 rate, which it does not reach.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bench.floors import ModelCost
from model_runtime.config import ModelConfig

# Issue 19: FP8 weights + FP8 KV >= 75% of TensorRT-LLM's published FP8 H100 numbers (28,312 / 15,220 / 3,450
# tok/s), and >= 1.6x this run's own bf16 rows.
FP8_GOAL_TOK_S = {"128/128": 21200.0, "1000/1000": 11400.0, "2048/128": 2600.0}
SPEEDUP_GOAL = 1.6


@dataclass(frozen=True)
class Variant:
    name: str
    quantization: str  # device.quantization
    cache_dtype: str | None  # cache.dtype; None: the model dtype
    ahead: bool = False  # scheduler.async_scheduling: the next step launched before this one's tokens return
    fast_accum: bool = True  # device.fp8_fast_accum (FP8 weights only)

    @property
    def baseline(self) -> bool:
        return self.name == "bf16"

    @property
    def full_fp8(self) -> bool:  # FP8 weights and FP8 KV: issue 19's goals apply
        return self.quantization in ("fp8", "fp8_group") and self.cache_dtype == "fp8_e4m3"

    @property
    def job_prefix(
        self,
    ) -> str:  # job names: "tandem 128/128" for bf16 (as before variants), else "tandem fp8 ..."
        return "tandem" if self.baseline else f"tandem {self.name}"

    def cost(self, mc: ModelConfig, dtype_bytes: int) -> ModelCost:
        # fp8_group's scales (4 bytes per 64 weights, 6%) are left out of its floor, as per-row scales are
        fp8_weights, fp8_kv = self.quantization in ("fp8", "fp8_group"), self.cache_dtype == "fp8_e4m3"
        return ModelCost.from_config(mc, dtype_bytes, fp8_weights=fp8_weights, fp8_kv=fp8_kv)

    def describe(self, model_dtype: str) -> str:
        weights = {"fp8": "fp8 projections", "fp8_group": "fp8 projections, a scale per 64 channels"}.get(
            self.quantization, model_dtype
        )
        steps = ", steps scheduled ahead" if self.ahead else ""
        exact = ", float32 accumulation" if not self.fast_accum else ""
        return f"{self.name}: weights {weights}{exact}, KV cache {self.cache_dtype or model_dtype}{steps}"


VARIANTS = {
    v.name: v
    for v in (
        Variant("bf16", "none", None),
        Variant("fp8-weights", "fp8", None),
        Variant("fp8-kv", "none", "fp8_e4m3"),
        Variant("fp8", "fp8", "fp8_e4m3"),
        Variant("fp8-exact", "fp8", "fp8_e4m3", fast_accum=False),
        Variant("fp8-group", "fp8_group", "fp8_e4m3"),  # the quality goal's configuration (1% perplexity)
        Variant("bf16-ahead", "none", None, ahead=True),
        Variant("fp8-ahead", "fp8", "fp8_e4m3", ahead=True),
        Variant("fp8-ahead-exact", "fp8", "fp8_e4m3", ahead=True, fast_accum=False),
    )
}
BF16 = VARIANTS["bf16"]


def parse_variants(text: str) -> list[Variant]:
    """--variants NAME,... -> the variants in VARIANTS' order, whatever the order given: bf16 runs first, so the
    others' rows find its rows to compare with."""
    names = [name.strip() for name in text.split(",")]
    unknown = [name for name in names if name not in VARIANTS]
    if unknown:
        raise SystemExit(
            f"--variants: unknown {', '.join(map(repr, unknown))}; a comma list of {', '.join(VARIANTS)}"
        )
    return [v for v in VARIANTS.values() if v.name in names]


@dataclass(frozen=True)
class VersusBf16:
    """What a row adds beside its own numbers (every key None on bf16 rows)."""

    speedup_vs_bf16: float | None = None  # tok/s / the complete bf16 row's of the same shape in this run
    fp8_goal_tok_s: float | None = None  # variants with FP8 weights and KV only: 75% of TensorRT-LLM FP8
    fraction_of_fp8_goal: float | None = None
    speedup_goal: float | None = None  # the same variants: SPEEDUP_GOAL
    versus: str | None = None  # the bf16 variant speedup_vs_bf16 divides by


def baselines(variant: Variant) -> tuple[str, ...]:
    """The bf16 rows a variant compares with, in order of preference: steps scheduled ahead against bf16's
    steps ahead when the run has them (the same scheduling on both sides), else against bf16."""
    if variant.ahead and variant.name != "bf16-ahead":
        return ("bf16-ahead", BF16.name)
    return (BF16.name,)


def versus_bf16(variant: Variant, shape: str, tok_s: float, rows: list[dict[str, Any]]) -> VersusBf16:
    """`rows`: the run's Tandem rows so far (as written to the JSON). No speedup when no bf16 variant ran this
    shape, or stopped before it finished (its rate would be over part of the work)."""
    if variant.baseline:
        return VersusBf16()
    done = {r["variant"]: r for r in rows if r["shape"] == shape and r["complete"]}
    versus = next((name for name in baselines(variant) if name in done), None)
    speedup = tok_s / done[versus]["output_tok_s"] if versus else None
    if not variant.full_fp8:
        return VersusBf16(speedup, versus=versus)
    goal = FP8_GOAL_TOK_S.get(shape)
    return VersusBf16(speedup, goal, tok_s / goal if goal else None, SPEEDUP_GOAL, versus)
