"""Requests, their sampling parameters and their lifecycle states.

WAITING --schedule--> RUNNING --finish--> FINISHED_*
   ^                     |
   +----- PREEMPTED <----+        (blocks freed; resumes by recomputing prompt + output so far)

WAITING_FOR_KV: a decode worker reserved blocks and waits for a prefill worker's KV to land; it becomes
RUNNING with num_computed_tokens = prompt length and one output token (the one prefill sampled).
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import NoReturn


class SamplingError(ValueError):
    """A sampling parameter is out of range; the message starts with the parameter's name."""


MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_SEED = 2**63 - 1
# logit_bias: at most this many token ids a request, each bias within +-MAX_LOGIT_BIAS (OpenAI's range)
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_LOGIT_BIAS = 100.0
# presence_penalty and frequency_penalty: OpenAI's range; repetition_penalty: (0, MAX_REPETITION_PENALTY]
MAX_PENALTY = 2.0
MAX_REPETITION_PENALTY = 10.0


def _number(value: object) -> bool:
    """A finite int or float (a bool is neither here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request. temperature 0 is greedy; top_k 0 (or -1) and top_p 1 disable those."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    # Score the prompt: each prompt token after the first gets its logprob under the model (and the top-n
    # alternatives at its position), the way evaluation harnesses ask for it (model_runtime.prompt_scores).
    # None is off; 0 the prompt token's own logprob only. A request that asks reads nothing from the prefix
    # cache: every position must run.
    prompt_logprobs: int | None = None
    # (token id, bias) pairs, one per id, added to those logits before the token is chosen (greedy or sampled);
    # the logprobs returned stay the model's own (model_runtime.sampler)
    logit_bias: tuple[tuple[int, float], ...] = ()
    # OpenAI's penalties on the tokens generated so far (the prompt's do not count), subtracted from their logits
    # before the token is chosen: presence_penalty once for every token that appeared, frequency_penalty times
    # the number of times it appeared (model_runtime.sampler); each in [-2, 2], 0 is off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's and transformers' repetition penalty on every token of the prompt and the output so far: a positive
    # logit is divided by it, a negative one multiplied; 1 is off
    repetition_penalty: float = 1.0
    # whether any of the three penalties applies: read for every row of every step, so computed once here
    penalized: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        def bad(name: str, msg: str) -> NoReturn:
            raise SamplingError(f"{name}: {msg}")

        if (
            not isinstance(self.temperature, (int, float))
            or not math.isfinite(self.temperature)
            or self.temperature < 0
        ):
            bad("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            bad("top_k", f"must be -1 or 0 (disabled) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED):
            bad("seed", f"must be an integer in [0, 2^63), got {self.seed!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            bad("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS:
                bad("stop", f"each stop string must be 1..{MAX_STOP_STRING_CHARS} characters, got {s!r}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0:
                bad("stop_token_ids", f"must be non-negative integers, got {t!r}")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        pl = self.prompt_logprobs
        if pl is not None and (
            not isinstance(pl, int) or isinstance(pl, bool) or not 0 <= pl <= MAX_LOGPROBS
        ):
            bad("prompt_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {pl!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            bad("logit_bias", f"at most {MAX_LOGIT_BIAS_ENTRIES} token ids, got {len(self.logit_bias)}")
        seen: set[int] = set()
        for entry in self.logit_bias:
            token, bias = entry if isinstance(entry, tuple) and len(entry) == 2 else (None, None)
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                bad("logit_bias", f"token ids must be non-negative integers, got {entry!r}")
            if token in seen:
                bad("logit_bias", f"token id {token} appears twice")
            seen.add(token)
            if not _number(bias) or abs(bias) > MAX_LOGIT_BIAS:
                bad("logit_bias", f"token {token}: the bias must be a number in [-100, 100], got {bias!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _number(value) or abs(value) > MAX_PENALTY:
                bad(name, f"must be a number in [-2, 2], got {value!r}")
        rep = self.repetition_penalty
        if not _number(rep) or not 0 < rep <= MAX_REPETITION_PENALTY:
            bad("repetition_penalty", f"must be a number in (0, {MAX_REPETITION_PENALTY:g}], got {rep!r}")
        penalized = self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
        object.__setattr__(self, "penalized", penalized)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def effective_top_k(self) -> int:
        """0 when top-k is disabled."""
        return max(self.top_k, 0)

    def check_vocab(self, vocab_size: int) -> None:
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise SamplingError(f"stop_token_ids: {t} is outside the vocabulary [0, {vocab_size})")
        for t, _ in self.logit_bias:
            if t >= vocab_size:
                raise SamplingError(f"logit_bias: token id {t} is outside the vocabulary [0, {vocab_size})")


class Priority(enum.Enum):
    """A request's priority class: which waiting prompt the scheduler admits first (model_runtime.waiting)."""

    INTERACTIVE = "interactive"
    BATCH = "batch"


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in _FINISHED


# Read per request per step (Request.is_finished): one frozenset, not a tuple built each call.
_FINISHED = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
)


@dataclass(eq=False)
class Request:
    """One sequence in the engine. The scheduler and block pool mutate it; nothing else does."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None  # when the scheduler first gave its prompt blocks (same clock)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # Top-n logprobs per output token when sampling.logprobs is set: (chosen logprob, [(id, logprob), ...]).
    output_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens that came from the prefix cache on first admission
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    # Output index of this request's first output token: non-zero when it resumes a request that another
    # worker was generating (the prompt then holds the tokens already sent). Seeded sampling draws output
    # token t with derive_step_seed(seed, output_offset + t), so a resumed stream continues the same draws.
    output_offset: int = 0
    priority: Priority = Priority.INTERACTIVE
    # sampling.prompt_logprobs: the score of prompt token i at index i (index 0, the first token, stays None),
    # filled as the prompt's chunks run; `scoring_prompt` until they go out with the request's first token.
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None
    scoring_prompt: bool = False

    def __post_init__(self) -> None:
        if self.sampling.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)
            self.scoring_prompt = True

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None


# A request's output token whose value a step in flight is still sampling (Scheduler.append_pending/resolve).
PENDING_TOKEN = -1


def generated_tokens(request: Request) -> list[int]:
    """The tokens `request` generated so far that the host knows, in order: a resumed request's tokens already
    sent (the last output_offset of its prompt) and its own outputs, less a pending one (step-ahead)."""
    resumed = request.prompt_token_ids[len(request.prompt_token_ids) - request.output_offset :]
    return [*resumed, *(t for t in request.output_token_ids if t != PENDING_TOKEN)]


@dataclass(slots=True)  # not frozen: one per sequence per step (see engine.StepOutput); nothing mutates it
class ScheduledChunk:
    """`num_tokens` tokens of `request`, starting at `request.num_computed_tokens`, run this step.

    `sample` is true when the chunk reaches the end of the request's known tokens, so the step's output for
    its last position is a new token (false for the earlier chunks of a chunked prefill).
    """

    request: Request
    num_tokens: int
    sample: bool


@dataclass(frozen=True)
class SchedulerOutput:
    """What one engine step runs: the contract between scheduler and model runner."""

    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[Request, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class PromptInput:
    """Exactly one of text, messages (a chat, rendered with the model's template) or token_ids."""

    text: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        given = [n for n in ("text", "messages", "token_ids") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(f"prompt: give exactly one of text, messages, token_ids (got {given or 'none'})")


@dataclass(frozen=True)
class Completion:
    """The whole result of one request, as the offline engine and the service both report it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    # sampling.prompt_logprobs: one entry per prompt token, None for the first (Request.prompt_logprobs)
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None
