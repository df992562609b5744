"""Turn one step's logits into token ids: greedy, temperature, top-k, top-p, seeded sampling, logprobs.

Per row, in the order Hugging Face and vLLM use:

    logits -float32-> + logit_bias - penalties -> / temperature -> top-k -> top-p -> softmax -> argmax(probs / Exp(1))
       \\-> log_softmax of the raw logits -> logprob of the chosen token, top-n (id, logprob) pairs

Choices, each deliberate:
- logit_bias (a request's token id -> bias pairs) is added before anything else, so greedy rows take the argmax
  of the biased logits and sampled rows sample from them, as OpenAI and vLLM apply it. It is one index_add_ over
  the flattened pairs of every row that has any, no per-row loop.
- repetition_penalty (vLLM's and transformers'), then presence_penalty and frequency_penalty (OpenAI's), in
  vLLM's order: a row's logit of a token that appears in its prompt or output so far is divided by
  repetition_penalty when positive and multiplied by it when not; then the logit of token t loses
  frequency_penalty x c(t) + presence_penalty x [c(t) > 0], c(t) the times t was generated so far (the prompt's
  tokens do not count; a resumed request's tokens already sent do). Counts and the seen mask are built on the
  device for the penalized rows only: an index_add_ of the ids the host knows, and one of the ids still on the
  device (a step-ahead engine's pending token, Penalties.pending), so they need no host sync either.
- Greedy: temperature < MIN_TEMPERATURE (0 included) takes argmax of the (biased) logits, the first index on ties.
  Dividing by a smaller temperature could overflow float32 into inf - inf = nan.
- Top-k ties: every token whose scaled logit equals the k-th largest value is kept, so more than k may survive.
  The mask then depends only on the values, never on the tie order of a sort. k larger than the vocabulary keeps
  everything.
- Top-p acts on the distribution left after temperature and top-k. It keeps the smallest prefix of the tokens
  sorted by probability whose cumulative probability reaches top_p (at least one token), widened to every token
  whose probability equals the last kept one (the top-k tie rule). top_p = 1 skips the mask: a float32 cumsum
  may stop short of 1.0 and must not drop the tail.
- Logprobs describe the raw model distribution (log_softmax of the logits before temperature and masks), as vLLM
  returns them by default: they report the model, not the sampling knobs.
- Sampling is the exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) picks token i with probability p_i,
  needs one noise draw per row and no host sync (torch.multinomial syncs).
- Seeds: the noise for output token t of a request with seed s comes from a generator seeded with
  derive_step_seed(s, t). The sampler's state for a request is then (seed, output index), which every worker
  already knows: the first token sampled on a prefill worker and the rest sampled on a decode worker form one
  reproducible stream, and batch composition, preemption and restarts do not change it. (A generator seeded once
  and advanced per sample would have to travel with the KV.) Streams repeat on the same device type only: CPU
  and CUDA generators differ, and so may CUDA kernels across GPU models.
- Rows without a seed share the Sampler's generator; their draws depend on the batch, which is allowed.

No host sync on a GPU: the per-row parameters travel in one pinned, non-blocking copy, and every shape depends
only on host-known values (batch size, the largest top-k, the largest logprobs count). The caller's `.tolist()`
of the sampled ids is the step's only sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from model_runtime.request import SamplingError, SamplingParams

MIN_TEMPERATURE = 1e-5
# (chosen token's logprob, [(token id, logprob), ...] best first): the shape of Request.output_logprobs entries.
TokenLogprobs = tuple[float, list[tuple[int, float]]]

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """One SplitMix64 step: a bijective 64-bit mixer, so nearby inputs give unrelated outputs."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def derive_step_seed(seed: int, output_index: int) -> int:
    """The generator seed for output token `output_index` of a request seeded with `seed`, in [0, 2^63)."""
    if seed < 0 or output_index < 0:
        raise SamplingError(f"seed: seed ({seed}) and output_index ({output_index}) must be >= 0")
    return _splitmix64(_splitmix64(seed) ^ output_index) >> 1


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator on `device` seeded with `seed` (the sampler re-seeds its own per step; see derive_step_seed)."""
    generator = torch.Generator(device=torch.device(device))
    generator.manual_seed(seed)
    return generator


@dataclass(frozen=True)
class SamplingTensors:
    """One step's per-row sampling parameters on the logits' device, plus the host facts that fix shapes."""

    temperatures: torch.Tensor  # [B] float32; 1.0 on greedy rows so the division is always safe
    top_ks: torch.Tensor  # [B] int64 in [1, V]; V where top-k is off
    top_ps: torch.Tensor  # [B] float32 in (0, 1]; 1.0 where top-p is off
    greedy: torch.Tensor  # [B] bool
    step_seeds: tuple[int | None, ...]  # derive_step_seed(seed, output index), None: the shared generator
    num_logprobs: tuple[int | None, ...]  # what each row asked for, clamped to V
    vocab_size: int
    all_greedy: bool
    max_top_k: int  # 0 when no row uses top-k
    any_top_p: bool
    # logit_bias of every row that has one, flattened: (row * vocab_size + token id [E] int64, bias [E] float32);
    # None when no row has any
    bias: tuple[torch.Tensor, torch.Tensor] | None = None
    penalties: Penalties | None = None  # None when no row has a presence or frequency penalty

    @property
    def batch_size(self) -> int:
        return len(self.step_seeds)

    @property
    def max_num_logprobs(self) -> int | None:
        """The widest top-n any row asked for; None when no row asked for logprobs."""
        asked = [n for n in self.num_logprobs if n is not None]
        return max(asked) if asked else None

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        output_indices: Sequence[int],
        vocab_size: int,
        device: torch.device | str,
        generated: Sequence[Sequence[int]] | None = None,
        pending: PendingIds | None = None,
        prompts: Sequence[Sequence[int]] | None = None,
    ) -> SamplingTensors:
        """Row i samples output token `output_indices[i]` (its request's num_output_tokens) under params[i].
        `generated[i]`: the tokens row i generated so far that the host knows (read only for penalized rows);
        `pending`: those still on the device (a step-ahead engine's pending tokens); `prompts[i]`: row i's prompt
        (read only for rows with a repetition penalty)."""
        if len(params) != len(output_indices):
            raise SamplingError(f"output_indices: {len(output_indices)} entries for {len(params)} rows")
        if vocab_size < 1:
            raise SamplingError(f"vocab_size: must be >= 1, got {vocab_size}")
        greedy = [p.temperature < MIN_TEMPERATURE for p in params]
        top_ks = [min(p.effective_top_k, vocab_size) or vocab_size for p in params]
        top_ps = [float(p.top_p) for p in params]
        temps = [1.0 if g else float(p.temperature) for g, p in zip(greedy, params)]
        rows = to_device([temps, [float(k) for k in top_ks], top_ps, [float(g) for g in greedy]], device)
        sampled = [not g for g in greedy]
        return cls(
            temperatures=rows[0],
            top_ks=rows[1].long(),
            top_ps=rows[2],
            greedy=rows[3] > 0.5,
            step_seeds=tuple(
                None if p.seed is None else derive_step_seed(p.seed, t)
                for p, t in zip(params, output_indices)
            ),
            num_logprobs=tuple(None if p.logprobs is None else min(p.logprobs, vocab_size) for p in params),
            vocab_size=vocab_size,
            all_greedy=all(greedy),
            max_top_k=max((k for k, s in zip(top_ks, sampled) if s and k < vocab_size), default=0),
            any_top_p=any(p.top_p < 1 for p, s in zip(params, sampled) if s),
            bias=_bias(params, vocab_size, device),
            penalties=Penalties.build(params, generated, pending, prompts, vocab_size, device),
        )


@dataclass(frozen=True)
class PendingIds:
    """Generated tokens the host does not have yet: row rows[j]'s is values[j] (int64, on the device)."""

    rows: tuple[int, ...]
    values: torch.Tensor


@dataclass(frozen=True)
class Penalties:
    """The penalized rows of a step and what their counts are built from (module docstring)."""

    rows: torch.Tensor  # [R] int64: the penalized sampler rows
    presence: torch.Tensor  # [R] float32
    frequency: torch.Tensor  # [R] float32
    # [E] int64: local row * vocab_size + token id, one entry per generated token the host knows
    known: torch.Tensor
    pending: torch.Tensor | None  # [P] int64 on the device: local row * vocab_size + pending token id
    repetition: torch.Tensor | None = None  # [R] float32 (1: none); None when no row has one
    seen: torch.Tensor | None = None  # [S] int64: local row * vocab_size + each prompt token the host knows

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        generated: Sequence[Sequence[int]] | None,
        pending: PendingIds | None,
        prompts: Sequence[Sequence[int]] | None,
        vocab_size: int,
        device: torch.device | str,
    ) -> Penalties | None:
        rows = [i for i, p in enumerate(params) if p.penalized]
        if not rows:
            return None
        if generated is None or len(generated) != len(params):
            raise SamplingError("penalties: the generated tokens of every row are needed for penalized rows")
        repeating = [j for j, row in enumerate(rows) if params[row].repetition_penalty != 1]
        if repeating and (prompts is None or len(prompts) != len(params)):
            raise SamplingError("penalties: the prompt of every row is needed for a repetition penalty")
        known = [j * vocab_size + t for j, row in enumerate(rows) for t in generated[row]]
        per_row = to_device(
            [[float(r) for r in rows], [float(params[r].presence_penalty) for r in rows],
             [float(params[r].frequency_penalty) for r in rows],
             [float(params[r].repetition_penalty) for r in rows]],
            device,
        )  # fmt: skip
        known_ids = to_device(known, device, torch.int64)
        seen_ids = None
        if repeating:
            assert prompts is not None  # checked above
            seen = [j * vocab_size + t for j in repeating for t in prompts[rows[j]]]
            seen_ids = to_device(seen, device, torch.int64)
        pending_flat = None
        if pending is not None:
            local = {row: j for j, row in enumerate(rows)}
            keep = [j for j, row in enumerate(pending.rows) if row in local]
            values = pending.values
            if len(keep) < len(pending.rows):  # rows without a penalty: their pending ids are not counted
                values = values.index_select(0, to_device(keep, device, torch.int64))
            offsets = [local[pending.rows[j]] * vocab_size for j in keep]
            pending_flat = to_device(offsets, device, torch.int64) + values if keep else None
        return cls(
            rows=per_row[0].long(),
            presence=per_row[1],
            frequency=per_row[2],
            known=known_ids,
            pending=pending_flat,
            repetition=per_row[3] if repeating else None,
            seen=seen_ids,
        )

    def apply(self, logits: torch.Tensor) -> None:
        """Apply each penalized row's penalties to `logits` [B, V] in place."""
        vocab = logits.shape[1]
        counts = torch.zeros(self.rows.shape[0], vocab, dtype=torch.float32, device=logits.device)
        flat = counts.view(-1)
        for ids in (self.known, self.pending):
            if ids is not None and ids.numel():
                flat.index_add_(0, ids, torch.ones(ids.shape[0], dtype=torch.float32, device=logits.device))
        if self.repetition is not None:  # seen: generated (counts > 0) or in the prompt
            seen = counts > 0
            if self.seen is not None and self.seen.numel():
                seen.view(-1).index_fill_(0, self.seen, True)
            rows = logits.index_select(0, self.rows)
            factor = self.repetition.unsqueeze(1)
            repeated = torch.where(rows > 0, rows / factor, rows * factor)
            logits.index_copy_(0, self.rows, torch.where(seen, repeated, rows))
        penalty = counts * self.frequency.unsqueeze(1) + (counts > 0).float() * self.presence.unsqueeze(1)
        logits.index_add_(0, self.rows, penalty.neg_())


def _bias(
    params: Sequence[SamplingParams], vocab_size: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor] | None:
    entries = [
        (row * vocab_size + token, bias) for row, p in enumerate(params) for token, bias in p.logit_bias
    ]
    if not entries:
        return None
    flat, biases = zip(*entries)
    return to_device(flat, device, torch.int64), to_device(biases, device)


def to_device(
    values: Sequence[object], device: torch.device | str, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """`values` (numbers, or rows of them) as one `dtype` tensor on `device` in one copy; pinned + non_blocking
    so a GPU copy does not sync. float32 holds every top-k and row index exactly (< 2^24)."""
    device = torch.device(device)
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


@dataclass(frozen=True)
class LogprobsTensors:
    chosen: torch.Tensor  # [B] float32: logprob of the sampled token
    top_ids: torch.Tensor  # [B, N] int64, best first
    top_logprobs: torch.Tensor  # [B, N] float32

    def to_host(self) -> LogprobsTensors:
        """Pinned host copies, started without waiting (the caller records an event after them and waits on
        it before reading); on a CPU, these tensors."""
        if self.chosen.device.type != "cuda":
            return self
        return LogprobsTensors(*(_pinned_copy(t) for t in (self.chosen, self.top_ids, self.top_logprobs)))


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


@dataclass(frozen=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64 on the logits' device
    logprobs: LogprobsTensors | None  # None when no row asked
    num_logprobs: tuple[int | None, ...]

    def logprobs_lists(self) -> list[TokenLogprobs | None]:
        """Per row: (chosen logprob, top-n pairs) for rows that asked, else None. Copies to the host."""
        if self.logprobs is None:
            return [None] * len(self.num_logprobs)
        chosen = self.logprobs.chosen.tolist()
        ids = self.logprobs.top_ids.tolist()
        values = self.logprobs.top_logprobs.tolist()
        return [
            None if n is None else (chosen[i], list(zip(ids[i][:n], values[i][:n])))
            for i, n in enumerate(self.num_logprobs)
        ]


def apply_top_k(logits: torch.Tensor, top_ks: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Set every logit below its row's k-th largest value to -inf (ties at the k-th value survive).

    `max_top_k` is the largest k among rows that use top-k (a host int, so the shape is known); rows whose k is
    the vocabulary size keep everything.
    """
    vocab_size = logits.shape[-1]
    if max_top_k <= 0:
        return logits
    top_values = logits.topk(max_top_k, dim=-1).values  # [B, max_top_k], descending
    kth = top_values.gather(1, (top_ks.clamp(max=max_top_k) - 1).unsqueeze(1))  # [B, 1]
    kth = kth.masked_fill((top_ks >= vocab_size).unsqueeze(1), float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Keep each row's nucleus: the smallest most-probable set with probability >= top_p, plus its ties.

    sorted probs   0.5   0.2   0.2   0.1        top_p = 0.6
    cumsum         0.5   0.7   0.9   1.0        cumsum < top_p at one position -> keep 1 + 1 = 2
    threshold = sorted[2 - 1] = 0.2             keep p >= 0.2: three tokens (the tie joins)
    """
    probs = logits.softmax(dim=-1)
    sorted_probs = probs.sort(dim=-1, descending=True).values
    below = (sorted_probs.cumsum(dim=-1) < top_ps.unsqueeze(1)).sum(dim=-1, keepdim=True)
    num_keep = (below + 1).clamp(max=logits.shape[-1])
    threshold = sorted_probs.gather(1, num_keep - 1)
    threshold = threshold.masked_fill((top_ps >= 1).unsqueeze(1), 0.0)
    return logits.masked_fill(probs < threshold, float("-inf"))


def compute_logprobs(logits: torch.Tensor, sampled: torch.Tensor, max_num_logprobs: int) -> LogprobsTensors:
    """log_softmax of the raw logits: the chosen token's logprob and the `max_num_logprobs` best per row."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1)
    top = logprobs.topk(max_num_logprobs, dim=-1)
    return LogprobsTensors(chosen=chosen, top_ids=top.indices, top_logprobs=top.values)


class Sampler:
    """Samples one token per row. Holds the shared generator for unseeded rows and a scratch one for seeded rows."""

    def __init__(self, device: torch.device | str = "cpu", seed: int | None = None) -> None:
        self.device = torch.device(device)
        self._shared = make_generator(torch.Generator().seed() if seed is None else seed, self.device)
        # Re-seeded before each seeded row's draw. Safe to reuse: a CUDA kernel takes its Philox seed and
        # offset by value at launch, so re-seeding afterwards cannot change a draw already queued.
        self._scratch = torch.Generator(device=self.device)

    def __call__(self, logits: torch.Tensor, tensors: SamplingTensors) -> SamplerOutput:
        self._check(logits, tensors)
        logits32 = logits.float()
        # what the token is chosen from: the logits + each row's logit_bias - its penalties
        chosen_from = logits32
        if tensors.bias is not None or tensors.penalties is not None:
            chosen_from = logits32.clone()
        if tensors.bias is not None:  # one index_add_ (atomics on a GPU: no sort, no sync) over the copy
            flat, biases = tensors.bias
            chosen_from.view(-1).index_add_(0, flat, biases)
        if tensors.penalties is not None:
            tensors.penalties.apply(chosen_from)
        greedy_ids = chosen_from.argmax(dim=-1)
        if tensors.all_greedy:
            sampled = greedy_ids
        else:
            random_ids = self._sample_random(chosen_from, tensors)
            sampled = torch.where(tensors.greedy, greedy_ids, random_ids)
        max_n = tensors.max_num_logprobs
        logprobs = None if max_n is None else compute_logprobs(logits32, sampled, max_n)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs, num_logprobs=tensors.num_logprobs)

    def _sample_random(self, logits: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
        scaled = logits / tensors.temperatures.unsqueeze(1)
        scaled = apply_top_k(scaled, tensors.top_ks, tensors.max_top_k)
        if tensors.any_top_p:
            scaled = apply_top_p(scaled, tensors.top_ps)
        probs = scaled.softmax(dim=-1)
        noise = self._exponential_noise(probs, tensors)
        return (probs / noise).argmax(dim=-1)

    def _exponential_noise(self, probs: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
        """Exp(1) noise per row: seeded rows from their own step seed (independent of the batch), others shared.

        A seeded row costs one re-seed and one launch (about 12 us of host time each on an H200), a loop over
        rows, never over the vocabulary.
        """
        noise = torch.empty_like(probs)
        seeded = [(i, s) for i, s in enumerate(tensors.step_seeds) if s is not None]
        if len(seeded) < len(tensors.step_seeds):
            noise.exponential_(generator=self._shared)
        for row, step_seed in seeded:
            self._scratch.manual_seed(step_seed)
            noise[row].exponential_(generator=self._scratch)
        # Exp(1) draws can round to 0; a floor keeps p / E finite without moving any realistic race.
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)

    def _check(self, logits: torch.Tensor, tensors: SamplingTensors) -> None:
        if logits.dim() != 2:
            raise SamplingError(f"logits: expected [batch, vocab], got shape {tuple(logits.shape)}")
        if logits.shape != (tensors.batch_size, tensors.vocab_size):
            raise SamplingError(
                f"logits: shape {tuple(logits.shape)} does not match the sampling tensors "
                f"[{tensors.batch_size}, {tensors.vocab_size}]"
            )
        if not (
            _same_device(logits.device, self.device)
            and _same_device(tensors.temperatures.device, self.device)
        ):
            raise SamplingError(
                f"logits: on {logits.device}, sampling tensors on {tensors.temperatures.device}, "
                f"sampler on {self.device}; all must match"
            )


def _same_device(a: torch.device, b: torch.device) -> bool:
    """`cuda` and `cuda:0` name one device when the index is left out."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)
