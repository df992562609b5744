"""The arithmetic floors the fast-path GPU benchmarks compare against: a step is no faster than its FLOPs at the
matmul rate, nor than the bytes it must read at the HBM rate (both measured in the same run: bench/harness.py's
DeviceRates). ModelCost is what one model costs per token and per step; throughput_floor the ceiling of an
offline run.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.harness import DeviceRates
from model_runtime.config import ModelConfig
from model_runtime.kv_layout import FP8_SCALE_BYTES as KV_SCALE_BYTES

FP8_BYTES, FP8_SCALE_BYTES = 1, 4  # an e4m3 element; a float32 weight scale


@dataclass(frozen=True)
class ModelCost:
    """Per-token work of a Llama-family decoder, from its shape alone (no weights needed)."""

    layer_matmul_params: int  # q, k, v, o, gate, up, down over all layers
    head_params: int  # lm_head (vocab x hidden): multiplied once per sampled token
    weight_bytes_read: int  # what a decode step reads: every weight but the embedding table (unless tied)
    kv_bytes_per_token: int  # K and V over all layers
    attn_flops_per_key: int  # QK^T and PV of one query against one cached key, all layers and heads
    # device.quantization fp8: the projections' FLOPs run at the FP8 matmul rate (DeviceRates.fp8_matmul_tflops);
    # attention and lm_head stay in the model dtype.
    fp8_projections: bool = False

    @classmethod
    def from_config(
        cls, mc: ModelConfig, dtype_bytes: int, fp8_weights: bool = False, fp8_kv: bool = False
    ) -> ModelCost:
        """`dtype_bytes`: the model dtype's. `fp8_weights` (device.quantization fp8): the projections at one byte
        an element plus a float32 scale per output row; embeddings, norms and lm_head keep the model dtype.
        `fp8_kv` (cache.dtype fp8_e4m3): K and V at one byte an element plus a bfloat16 scale per token and KV
        head (what attention reads; a block's padding is not read). FLOPs are the same either way."""
        per_layer = mc.hidden_size * (mc.q_size + 2 * mc.kv_size) + mc.q_size * mc.hidden_size
        per_layer += 3 * mc.hidden_size * mc.intermediate_size
        projections, embed = mc.num_layers * per_layer, mc.vocab_size * mc.hidden_size
        read = mc.param_count() - (0 if mc.tie_word_embeddings else embed)
        weight_bytes = read * dtype_bytes
        if fp8_weights:  # output rows: q|k|v, o, gate|up, down
            rows = mc.num_layers * (
                mc.q_size + 2 * mc.kv_size + 2 * mc.hidden_size + 2 * mc.intermediate_size
            )
            weight_bytes += projections * (FP8_BYTES - dtype_bytes) + rows * FP8_SCALE_BYTES
        kv_element_bytes = FP8_BYTES if fp8_kv else dtype_bytes
        kv_scale_bytes = KV_SCALE_BYTES * mc.num_kv_heads if fp8_kv else 0  # a bf16 scale per token and head
        return cls(
            layer_matmul_params=projections,
            head_params=embed,
            weight_bytes_read=weight_bytes,
            kv_bytes_per_token=2 * mc.num_layers * (mc.kv_size * kv_element_bytes + kv_scale_bytes),
            attn_flops_per_key=4 * mc.num_layers * mc.num_heads * mc.head_dim,
            fp8_projections=fp8_weights,
        )

    def projection_flops(self, tokens: float) -> float:
        """The q/k/v, o, gate/up and down matmuls of `tokens` positions through every layer."""
        return 2 * self.layer_matmul_params * tokens

    def by_rate(self, flops: float, tokens: float) -> tuple[float, float]:
        """`flops` of a step that takes `tokens` positions through the layers, split by the rate they run at:
        (model dtype's, FP8's): the projections' are FP8's when they are FP8, the rest (attention, lm_head) the
        model dtype's. DeviceRates.compute_s and step_floor_s take the two parts."""
        fp8 = self.projection_flops(tokens) if self.fp8_projections else 0.0
        return flops - fp8, fp8

    def compute_s(self, rates: DeviceRates, flops: float, tokens: float) -> float:
        """`flops` of such a step at the rates they run at (by_rate)."""
        return rates.compute_s(*self.by_rate(flops, tokens))

    def prefill_flops(self, prompt_len: int, cached: int = 0) -> float:
        """One causal prompt of which the first `cached` tokens are already in the KV cache: every new position
        through the layers, new query i attends to the cached keys and i new ones, one logits row."""
        new = prompt_len - cached
        causal_keys = cached * new + new * (new + 1) / 2
        linear = 2 * self.layer_matmul_params * new + 2 * self.head_params
        return linear + self.attn_flops_per_key * causal_keys

    def decode_step_flops(self, batch: int, context: float) -> float:
        """`batch` sequences each decode one token attending to `context` keys, each with a logits row."""
        per_seq = 2 * (self.layer_matmul_params + self.head_params) + self.attn_flops_per_key * context
        return batch * per_seq

    def decode_step_bytes(self, batch: int, context: float) -> float:
        return self.weight_bytes_read + batch * context * self.kv_bytes_per_token


@dataclass(frozen=True)
class ThroughputFloor:
    batch: int  # sequences decoding together
    prefill_s: float
    decode_s: float
    output_tokens: int
    decode_bytes: float  # weights + KV the decode steps read, all waves (the floor's memory side)
    tokens_per_s: float


def throughput_floor(
    cost: ModelCost, rates: DeviceRates, num_prompts: int, input_len: int, output_len: int, batch: int
) -> ThroughputFloor:
    """Fastest possible offline run: every prompt's prefill at the matmul rate, then the prompts decode in
    waves of `batch` (the last one partial); the first output token comes from prefill, so a wave runs
    output_len - 1 steps whose mean context is input_len + output_len / 2 keys (step k attends input_len + k).
    Each step costs max(its FLOPs at the matmul rates, weights + KV bytes at the HBM rate); FP8 projections'
    FLOPs count at the FP8 matmul rate where it was measured (ModelCost.compute_s)."""
    if min(num_prompts, input_len, output_len, batch) < 1:
        raise ValueError("throughput_floor: num_prompts, input_len, output_len and batch must be >= 1")
    prefill_s = num_prompts * cost.compute_s(rates, cost.prefill_flops(input_len), input_len)
    context = input_len + output_len / 2
    waves = [batch] * (num_prompts // batch) + ([num_prompts % batch] if num_prompts % batch else [])
    steps = output_len - 1

    def step_s(b: int) -> float:
        flops, fp8_flops = cost.by_rate(cost.decode_step_flops(b, context), b)
        return rates.step_floor_s(flops, cost.decode_step_bytes(b, context), fp8_flops)

    decode_s = sum(steps * step_s(b) for b in waves)
    decode_bytes = sum(steps * cost.decode_step_bytes(b, context) for b in waves)
    tokens = num_prompts * output_len
    return ThroughputFloor(batch, prefill_s, decode_s, tokens, decode_bytes, tokens / (prefill_s + decode_s))


# --- engine and models -----------------------------------------------------------------------------------
