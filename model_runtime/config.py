"""Frozen, typed configuration for the engine.

Each concern has its own dataclass (model shape, KV cache, scheduler, device, parallel); `EngineConfig` composes
them.
Every dataclass validates itself in `__post_init__` and raises `ConfigError` naming the field and the allowed
range, so a bad YAML key or CLI flag fails once, at start-up, with a message the user can act on.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
DTYPES = ("float32", "float16", "bfloat16")
# cache.dtype: a model dtype, or FP8 e4m3 with a bfloat16 scale per token and KV head (model_runtime.kv_quant).
KV_CACHE_DTYPES = (*DTYPES, "fp8_e4m3")
QUANTIZATIONS = ("none", "fp8", "fp8_group")
# scheduler.late_launch_margin_s: its default and the most the launch clock's margin may grow to (after misses)
LATE_LAUNCH_MARGIN_S = 0.0015
# ... and a disaggregated decode worker's default (deploy.config), since runs 87-89 (docs/performance.md, "Issue 13
# on one commit"): there 0 let landed requests into the next step sooner at no cost to TPOT, while a colocated
# worker at 10 req/s of decode-heavy traffic ran a 17% longer TPOT p50 at 0 than at 1.5 ms (one run).
DECODE_LATE_LAUNCH_MARGIN_S = 0.0
LATE_LAUNCH_MAX_MARGIN_S = 0.006


class ConfigError(ValueError):
    """A configuration value is missing or out of range; the message names the field."""


def _require(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{name}: {msg}")


def _positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        _require(
            isinstance(value, int) and value > 0,
            f"{type(obj).__name__}.{name}",
            f"must be a positive integer, got {value!r}",
        )


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 style frequency scaling (`rope_type: llama3`). Other rope types are rejected at load."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        _require(self.factor >= 1.0, "rope_scaling.factor", f"must be >= 1, got {self.factor}")
        _require(
            self.high_freq_factor > self.low_freq_factor,
            "rope_scaling.high_freq_factor",
            "must be greater than low_freq_factor",
        )


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder. Filled from config.json, GGUF metadata or a named dummy shape."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""

    def __post_init__(self) -> None:
        _require(
            self.architecture in SUPPORTED_ARCHITECTURES,
            "model.architecture",
            f"{self.architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}",
        )
        _positive(
            self,
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        )
        _require(
            self.num_heads % self.num_kv_heads == 0,
            "model.num_kv_heads",
            f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})",
        )
        _require(
            self.head_dim % 2 == 0,
            "model.head_dim",
            f"must be even for rotary embeddings, got {self.head_dim}",
        )
        _require(self.rms_norm_eps > 0, "model.rms_norm_eps", "must be > 0")
        _require(self.rope_theta > 0, "model.rope_theta", "must be > 0")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def param_count(self) -> int:
        """Parameters, for memory planning and roofline numbers."""
        attn = self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        per_layer = attn + mlp + 2 * self.hidden_size
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return self.num_layers * per_layer + embed + head + self.hidden_size


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache. `num_blocks=None` sizes the cache from free memory (GPU) or `cpu_cache_bytes` (CPU)."""

    block_size: int = 16
    num_blocks: int | None = None
    dtype: str | None = None  # None: the model dtype; "fp8_e4m3": one byte per element (kv_quant.py)
    gpu_memory_utilization: float = 0.90
    cpu_cache_bytes: int = 512 * 2**20
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _require(
            self.block_size in (1, 2, 4, 8, 16, 32, 64, 128),
            "cache.block_size",
            f"must be a power of two in [1, 128], got {self.block_size}",
        )
        _require(
            self.num_blocks is None or (isinstance(self.num_blocks, int) and self.num_blocks >= 2),
            "cache.num_blocks",
            f"must be >= 2 (block 0 is reserved), got {self.num_blocks}",
        )
        _require(
            self.dtype is None or self.dtype in KV_CACHE_DTYPES,
            "cache.dtype",
            f"must be one of {KV_CACHE_DTYPES}, got {self.dtype!r}",
        )
        _require(
            0.05 <= self.gpu_memory_utilization <= 0.99,
            "cache.gpu_memory_utilization",
            f"must be in [0.05, 0.99], got {self.gpu_memory_utilization}",
        )
        _require(self.cpu_cache_bytes > 0, "cache.cpu_cache_bytes", "must be > 0")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits: sequences per step and tokens per step (the chunked-prefill budget)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    # A waiting batch-class prompt older than this is admitted in arrival order with the interactive ones
    # (model_runtime.waiting): interactive traffic delays batch by at most about this, never forever.
    batch_max_wait_s: float = 30.0
    # Schedule and launch step N+1 before step N's tokens reach the host, so the host work of a step (its
    # scheduling, its outputs) runs while the GPU computes (model_runtime.step_ahead). Colocated, decode and
    # offline engines (a decode worker's with kv_receiver): prefill workers and tensor-parallel engines refuse it.
    async_scheduling: bool = False
    # With async_scheduling, in a worker's engine loop: schedule the next decode step shortly before the running
    # one ends rather than as soon as it starts, so that requests arriving meanwhile join it, one step sooner
    # (model_runtime.launch_clock). Offline runs never wait.
    late_launch: bool = True
    # The launch clock's lead beyond 1.5x the host's launch time (the loop's wake-up, the interpreter lock):
    # smaller lets more arrivals into the next step and risks the GPU waiting for a launch held too long (each
    # such miss widens it by 0.5 ms, up to LATE_LAUNCH_MAX_MARGIN_S).
    late_launch_margin_s: float = LATE_LAUNCH_MARGIN_S

    def __post_init__(self) -> None:
        _positive(self, "max_num_seqs", "max_num_batched_tokens")
        margin = self.late_launch_margin_s
        _require(
            isinstance(margin, (int, float))
            and not isinstance(margin, bool)
            and 0 <= margin <= LATE_LAUNCH_MAX_MARGIN_S,
            "scheduler.late_launch_margin_s",
            f"must be seconds in [0, {LATE_LAUNCH_MAX_MARGIN_S}], got {margin!r}",
        )
        for name in ("async_scheduling", "late_launch"):
            value = getattr(self, name)
            _require(isinstance(value, bool), f"scheduler.{name}", f"must be true or false, got {value!r}")
        _require(
            isinstance(self.batch_max_wait_s, (int, float))
            and not isinstance(self.batch_max_wait_s, bool)
            and 0 <= self.batch_max_wait_s < float("inf"),
            "scheduler.batch_max_wait_s",
            f"must be a finite number of seconds >= 0, got {self.batch_max_wait_s!r}",
        )
        _require(
            self.max_model_len is None or self.max_model_len > 0, "scheduler.max_model_len", "must be > 0"
        )


# In an eager step with prompt chunks, decode rows whose contexts total at most this many tokens join the
# cached group (device.decode_gather_tokens): their contexts are gathered and attended in the group's one
# FlashAttention-2 call instead of the paged decode kernel. Such a step is host-bound: the decode kernel's two
# Triton launches and their inputs cost 130-230 us of host time a layer (4-7 ms a step for a 32-layer model;
# two H200 machines, bench/diag/mixed_host_cost.py; docs/performance.md, "Mixed steps are host-bound"), where
# the gather and the larger call cost the GPU, by the bytes they move, about 5 us per 1,000 context tokens a
# layer for Llama-3-8B. Past this many tokens the GPU's extra work would outgrow the host's saving. Nor does a
# step of more than DECODE_GATHER_MAX_STEP_TOKENS tokens gather: its kernels outlast its launches (the piecewise
# prefill graphs stop at the same size by default), so it would pay the GPU's extra work for nothing.
DECODE_GATHER_MAX_TOKENS = 8192
DECODE_GATHER_MAX_STEP_TOKENS = 1024
# A step's cached group (prompt chunks over cached prefixes, and the decode rows gathered with them; not decode
# rows alone) of at most this many query rows is attended by the split-KV chunk kernel straight from the pages
# (attention.triton_chunk) instead of a gather and one FlashAttention-2 call whose few programs walk the whole
# context each. On one H200 (Llama-3-8B shape, one decode beside the chunk) it won at every size measured, 64 to
# 1,024 new tokens over 2k and 8k cached (docs/performance.md, "A chunk over a cached prefix, split along its
# context"); larger groups were not measured and keep the gather.
CHUNK_ATTENTION_MAX_TOKENS = 1024
# With an FP8 cache the kernel reads codes and scales in place where the gather dequantizes the context once a
# layer: over 8k cached it won 3.4-6.5 ms at 64-128 new tokens, tied at 256 and lost 2.4 ms at 512 (not profiled:
# taller tiles, which halve its key conversions, did not change that); over 2k it tied within the run's spread
# (one H200, the same section). So FP8 cached groups take it up to this many rows (never past
# chunk_attention_tokens).
CHUNK_ATTENTION_FP8_MAX_TOKENS = 256


@dataclass(frozen=True)
class DeviceConfig:
    """Where the engine runs. `device='auto'` picks cuda when present; dtype None picks bf16 on GPU, fp32 on CPU."""

    device: str = "auto"
    dtype: str | None = None
    enforce_eager: bool = False
    attention_backend: str = "auto"  # auto | torch | triton
    # The fused elementwise kernels (model_runtime.fused): auto (Triton on CUDA, torch on CPU) | torch |
    # triton | compile (torch.compile of the torch reference; CUDA).
    kernels: str = "auto"
    # How the projection weights (q/k/v/o, gate/up/down) are stored: none (the model dtype) | fp8 (e4m3, one
    # float32 scale per output channel, quantized at load; model_runtime.quantization) | fp8_group (e4m3, a
    # scale per output channel and group of 64 input channels, activations alike; group_gemm on a GPU).
    quantization: str = "none"
    # FP8 projections on Hopper (quantization fp8): the tensor cores keep their FP8 partial sums in their own
    # accumulator for the whole K loop (torch._scaled_mm use_fast_accum, as vLLM's CUTLASS FP8 kernels do)
    # instead of promoting them into float32 every few K steps: faster matmuls, a larger rounding error
    # (docs/performance.md has both). false: promote. The CPU emulation, fp8_group and steps of at most 16 tokens
    # (fused/skinny_matmul.skinny_matmul_fp8) accumulate in float32 either way.
    fp8_fast_accum: bool = True
    # Steps with prompt chunks of up to this many tokens (decodes included) replay piecewise CUDA graphs:
    # everything but the attention (model_runtime.prefill_graphs); 0 runs them eagerly. Larger steps always
    # run eagerly: their kernels outlast their launches.
    prefill_graph_tokens: int = 1024
    # Those graphs also store each layer's new K/V in the cache (model_runtime.prefill_graphs), so the eager part
    # of a layer is its attention alone: one host launch fewer per layer. Off: on an H200 it was 0.5-0.7 ms
    # slower at 128-320 new tokens beside one decode and no different in the service (the launch it saves is
    # hidden behind the GPU there; docs/performance.md, "A chunk over a cached prefix, split along its context").
    prefill_graph_kv_store: bool = False
    # In a step with prompt chunks (of at most DECODE_GATHER_MAX_STEP_TOKENS tokens in all), decode rows whose
    # contexts total at most this many tokens are attended in the chunks' FlashAttention call over contexts
    # gathered from the cache, instead of the paged decode kernel, whose launches cost more host time than the
    # gather costs the GPU (DECODE_GATHER_MAX_TOKENS above; Triton backend). 0: never.
    decode_gather_tokens: int = DECODE_GATHER_MAX_TOKENS
    # A step's cached group (chunks over cached prefixes, with the decode rows gathered beside them) of at most
    # this many query rows is attended straight from the pages by the split-KV chunk kernel, not gathered for
    # one FlashAttention-2 call (CHUNK_ATTENTION_MAX_TOKENS above; Triton backend; with an FP8 cache at most
    # CHUNK_ATTENTION_FP8_MAX_TOKENS rows). 0: never.
    chunk_attention_tokens: int = CHUNK_ATTENTION_MAX_TOKENS
    seed: int = 0

    def __post_init__(self) -> None:
        _require(
            self.prefill_graph_tokens >= 0,
            "device.prefill_graph_tokens",
            f"must be >= 0 (0 turns the prefill graphs off), got {self.prefill_graph_tokens}",
        )
        _require(
            isinstance(self.prefill_graph_kv_store, bool),
            "device.prefill_graph_kv_store",
            f"must be true or false, got {self.prefill_graph_kv_store!r}",
        )
        _require(
            isinstance(self.decode_gather_tokens, int) and self.decode_gather_tokens >= 0,
            "device.decode_gather_tokens",
            f"must be an integer >= 0 (0: never), got {self.decode_gather_tokens!r}",
        )
        _require(
            isinstance(self.chunk_attention_tokens, int) and self.chunk_attention_tokens >= 0,
            "device.chunk_attention_tokens",
            f"must be an integer >= 0 (0: never), got {self.chunk_attention_tokens!r}",
        )
        _require(
            self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
            "device.device",
            f"must be auto, cpu or cuda[:N], got {self.device!r}",
        )
        _require(self.dtype is None or self.dtype in DTYPES, "device.dtype", f"must be one of {DTYPES}")
        _require(
            self.attention_backend in ("auto", "torch", "triton"),
            "device.attention_backend",
            "must be auto, torch or triton",
        )
        _require(
            self.kernels in ("auto", "torch", "triton", "compile"),
            "device.kernels",
            f"must be auto, torch, triton or compile, got {self.kernels!r}",
        )
        _require(
            isinstance(self.fp8_fast_accum, bool),
            "device.fp8_fast_accum",
            f"must be true or false, got {self.fp8_fast_accum!r}",
        )
        _require(
            self.quantization in QUANTIZATIONS,
            "device.quantization",
            f"must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}",
        )

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self) -> str:
        if self.dtype is not None:
            return self.dtype
        return "float32" if self.resolved_device() == "cpu" else "bfloat16"


ALL_REDUCE_PATHS = ("auto", "nccl")


@dataclass(frozen=True)
class ParallelConfig:
    """How many devices one engine spans. `tensor_parallel_size` ranks each hold 1/N of every layer's query
    heads, KV heads (replicated when the model has fewer KV heads than ranks), MLP width and vocabulary
    (model_runtime.parallel). Its fit to a model's shape is checked by `check_model`, once the shape is known.

    `all_reduce`: "auto" sums small tensors (a decode step's) over CUDA symmetric memory when every rank can map
    its peers' memory, and everything else with NCCL; "nccl" always uses NCCL."""

    tensor_parallel_size: int = 1
    all_reduce: str = "auto"

    def __post_init__(self) -> None:
        size = self.tensor_parallel_size
        _require(
            isinstance(size, int) and not isinstance(size, bool) and size > 0,
            "parallel.tensor_parallel_size",
            f"must be a positive integer, got {size!r}",
        )
        _require(
            self.all_reduce in ALL_REDUCE_PATHS,
            "parallel.all_reduce",
            f"must be one of {', '.join(ALL_REDUCE_PATHS)}, got {self.all_reduce!r}",
        )

    def check_model(self, model: ModelConfig) -> None:
        """Raise ConfigError naming the field when the model's heads or MLP cannot be split this many ways."""
        tp, name = self.tensor_parallel_size, "parallel.tensor_parallel_size"
        _require(
            model.num_heads % tp == 0,
            name,
            f"{tp} must divide model.num_heads ({model.num_heads}): each rank holds whole query heads",
        )
        kv = model.num_kv_heads
        _require(
            kv % tp == 0 if kv >= tp else tp % kv == 0,
            name,
            f"{tp} and model.num_kv_heads ({kv}) must divide one another: each rank holds whole KV heads "
            "(a KV head is replicated when there are fewer of them than ranks)",
        )
        _require(
            model.intermediate_size % tp == 0,
            name,
            f"{tp} must divide model.intermediate_size ({model.intermediate_size})",
        )


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine instance needs, besides the weights themselves."""

    model: str = "smollm2-135m-instruct"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "engine") -> EngineConfig:
        """Build from a plain mapping (parsed YAML); unknown keys are errors that name the key."""
        sections = {
            "cache": CacheConfig,
            "scheduler": SchedulerConfig,
            "device": DeviceConfig,
            "parallel": ParallelConfig,
        }
        _reject_unknown(data, {"model", *sections}, where)
        kwargs: dict[str, Any] = {}
        if "model" in data:
            _require(isinstance(data["model"], str), f"{where}.model", "must be a string")
            kwargs["model"] = data["model"]
        for key, klass in sections.items():
            if key in data:
                kwargs[key] = dataclass_from_dict(klass, data[key], f"{where}.{key}")
        return cls(**kwargs)


def _reject_unknown(data: object, allowed: set[str], where: str) -> None:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: must be a mapping, got {type(data).__name__}")
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: unknown key; allowed: {', '.join(sorted(allowed))}")


def dataclass_from_dict(klass: Any, data: object, where: str) -> Any:
    """Build a flat frozen dataclass from a mapping, naming the key on unknown fields or wrong types."""
    names = {f.name: f for f in dataclasses.fields(klass)}
    _reject_unknown(data, set(names), where)
    assert isinstance(data, dict)
    try:
        return klass(**data)
    except ConfigError as exc:
        # Field errors read "section.field: message"; re-root them at `where` ("decode.engine.cache.field").
        name, sep, message = str(exc).partition(": ")
        field_name = name.rpartition(".")[2]
        raise ConfigError(f"{where}.{field_name}: {message}" if sep else f"{where}: {exc}") from None
    except TypeError as exc:
        raise ConfigError(f"{where}: {exc}") from None
