"""The Llama family (Llama 2/3/3.1, Mistral, Qwen2/2.5, SmolLM2) over a paged KV cache.

The model file holds only the model. Attention is injected as an `AttentionBackend`; positions, the cache and
the attention metadata are passed explicitly to `forward`. Parameter names are the fused ones that
`model_runtime.weights` produces (qkv, gate_up), so one matmul serves q, k and v, and one serves gate and up.

The elementwise chains between the matmuls (residual add + RMSNorm, rotary, SiLU-and-mul) go through an injected
`FusedOps`, one kernel each on the GPU. The residual stream is carried beside the hidden states so that each
residual add is fused into the norm that follows it:

    layer i:   normed, residual = add_rms_norm(hidden, residual)     (layer 0: residual = embeddings)
               hidden = attn(normed)
               normed, residual = add_rms_norm(hidden, residual)
               hidden = mlp(normed)                  -> (hidden, residual) to layer i + 1
    final:     norm(hidden + residual)
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from model_runtime.attention.base import AttentionBackend, AttentionMetadata
from model_runtime.config import ModelConfig, RopeScaling
from model_runtime.fused import torch_ops
from model_runtime.fused.base import FusedOps
from model_runtime.fused.fp8_rows import QuantizedRows


class Projection(nn.Module):
    """x @ weight^T (+ bias) through the injected ops, which may stream a small batch's weight themselves. Its
    own module so that a quantized projection (model_runtime.quantization) can replace it from outside."""

    def __init__(self, in_features: int, out_features: int, bias: bool, ops: FusedOps) -> None:
        super().__init__()
        self.ops = ops
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias: nn.Parameter | None
        self.register_parameter("bias", nn.Parameter(torch.empty(out_features)) if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        # The projection after this norm takes FP8 rows: the norm writes them (quantization.fp8.fuse_fp8_inputs).
        self.fp8_rows = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch_ops.rms_norm(x, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq.float()
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, blended)
    scaled = torch.where(wavelen < high_wavelen, inv_freq, scaled)
    return scaled.float()


class RotaryEmbedding(nn.Module):
    """Neox-style rotation (rotate the two halves of each head), the Hugging Face convention."""

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu") -> None:
        super().__init__()
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling).to(device)
        t = torch.arange(config.max_position_embeddings, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq)
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", freqs.cos(), persistent=False)  # [P, D/2]
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(
        self, ops: FusedOps, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D] rotated in float32, returned in their dtype (maybe in place)."""
        return ops.rotary(q, k, positions, self.cos, self.sin)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, backend: AttentionBackend, ops: FusedOps) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.ops = ops
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        self.scale = config.head_dim**-0.5
        self.qkv = Projection(
            config.hidden_size, config.q_size + 2 * config.kv_size, config.attention_bias, ops
        )
        self.o_proj = Projection(config.q_size, config.hidden_size, False, ops)
        self.backend = backend
        # An FP8 cache's scale pages for this layer, [2, N, B, Hkv] bfloat16 (use_kv_scales); None else.
        self.kv_scale: torch.Tensor | None = None

    def heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The qkv projection's rows [T, q_size + 2 kv_size] as q [T, Hq, D], k and v [T, Hkv, D]: views, whose
        strides the attention kernels see (and cuDNN keys its plans by: ModelRunner warms them on these)."""
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (
            q.view(t, self.num_heads, self.head_dim),
            k.view(t, self.num_kv_heads, self.head_dim),
            v.view(t, self.num_kv_heads, self.head_dim),
        )

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.heads(self.qkv(hidden))
        t = q.shape[0]
        q, k = rope(self.ops, positions, q, k)
        out = self.backend.forward(
            q, k, v, kv_cache[self.layer_idx, 0], kv_cache[self.layer_idx, 1], meta, self.scale, self.kv_scale
        )
        return self.o_proj(out.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, ops: FusedOps) -> None:
        super().__init__()
        self.ops = ops
        self.intermediate = config.intermediate_size
        self.gate_up = Projection(config.hidden_size, 2 * config.intermediate_size, False, ops)
        self.down = Projection(config.intermediate_size, config.hidden_size, False, ops)

        self.fp8_rows = False  # down takes FP8 rows: silu_mul writes them (quantization.fp8.fuse_fp8_inputs)

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        gate_up = self.gate_up(x)
        return self.down(self.ops.silu_mul_fp8(gate_up) if self.fp8_rows else self.ops.silu_mul(gate_up))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, backend: AttentionBackend, ops: FusedOps) -> None:
        super().__init__()
        self.ops = ops
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config, layer_idx, backend, ops)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, ops)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) in, (this layer's MLP output, the residual stream before it) out; the stream
        after the layer is their sum, which the next norm computes."""
        normed, residual = norm_rows(self.ops, self.input_norm, hidden, residual)
        hidden = self.attn(normed, positions, rope, kv_cache, meta)
        normed, residual = norm_rows(self.ops, self.post_attn_norm, hidden, residual)
        return self.mlp(normed), residual


def norm_rows(
    ops: FusedOps, norm: RMSNorm, hidden: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
    """(RMSNorm(hidden + residual), hidden + residual); with no residual (layer 0) (RMSNorm(hidden), hidden). The
    normed rows come as FP8 QuantizedRows when the projection they feed takes them (norm.fp8_rows)."""
    if residual is None:
        normed = (ops.rms_norm_fp8 if norm.fp8_rows else ops.rms_norm)(hidden, norm.weight, norm.eps)
        return normed, hidden
    return (ops.add_rms_norm_fp8 if norm.fp8_rows else ops.add_rms_norm)(
        hidden, residual, norm.weight, norm.eps
    )


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        rope_device: torch.device | str,
        ops: FusedOps | None = None,
    ) -> None:
        """Build under `with torch.device("meta")` and call load_weights to avoid allocating random weights;
        the rotary tables are built on `rope_device` regardless. `ops` defaults to the torch reference."""
        super().__init__()
        self.config = config
        ops = ops if ops is not None else torch_ops.TorchOps()
        self.ops = ops
        # An explicit (meta) weight skips Embedding's normal_ init: on the meta device that runs torch._refs,
        # whose import of torch._dynamo cost each worker about 3 s of start-up; load_weights replaces it.
        embedding = torch.empty(config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=embedding)
        with torch.device(rope_device):
            self.rope = RotaryEmbedding(config, rope_device)
        self.layers = nn.ModuleList(DecoderLayer(config, i, backend, ops) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Called with n after the n-th layer's kernels were queued (ModelRunner sets it for one eager step, so
        # that the KV of a prompt's first layers can leave while its last layers run).
        self.layer_hook: Callable[[int], None] | None = None
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [T]; kv_cache: [L, 2, N, B, Hkv, D]. Returns final hidden states [T, H]."""
        hidden = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        hook = self.layer_hook
        for n, layer in enumerate(self.layers, 1):
            hidden, residual = layer(hidden, residual, positions, self.rope, kv_cache, meta)
            if hook is not None:
                hook(n)
        if residual is None:  # a model with no layers
            return self.ops.rms_norm(hidden, self.norm.weight, self.norm.eps)
        return self.ops.add_rms_norm(hidden, residual, self.norm.weight, self.norm.eps)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return self.ops.linear(hidden, weight).float()

    def use_kv_scales(self, scales: torch.Tensor) -> None:
        """An FP8 cache's scale pages, [num_layers, 2, N, B, Hkv] bfloat16 (kv_quant.split_fp8_cache): each
        layer's attention stores and reads its rows' scales through its own [2, N, B, Hkv] view."""
        for i, layer in enumerate(self.layers):
            attn = layer.get_submodule("attn")
            assert isinstance(attn, Attention)
            attn.kv_scale = scales[i]

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Adopt the canonical fused tensors from model_runtime.weights (no copy); a missing or extra name, or
        a shape that disagrees with the config, is an error. The model may be built on the meta device."""
        params = dict(self.named_parameters())
        renamed = {_module_path(name): tensor for name, tensor in weights.items()}
        missing = sorted(set(params) - set(renamed))
        extra = sorted(set(renamed) - set(params))
        if missing or extra:
            raise ValueError(f"weights do not match the model: missing {missing[:5]}, unexpected {extra[:5]}")
        for name, tensor in renamed.items():
            if params[name].shape != tensor.shape:
                raise ValueError(
                    f"weight {name}: shape {tuple(tensor.shape)}, model expects {tuple(params[name].shape)}"
                )
            owner_name, _, leaf = name.rpartition(".")
            setattr(self.get_submodule(owner_name), leaf, nn.Parameter(tensor, requires_grad=False))


# Canonical weight names are flat per layer (layers.N.qkv.weight); the modules group them.
_SUBMODULE = {"qkv": "attn.qkv", "o_proj": "attn.o_proj", "gate_up": "mlp.gate_up", "down": "mlp.down"}


def _module_path(name: str) -> str:
    parts = name.split(".")
    if parts[0] == "layers" and len(parts) == 4 and parts[2] in _SUBMODULE:
        return f"layers.{parts[1]}.{_SUBMODULE[parts[2]]}.{parts[3]}"
    return name
