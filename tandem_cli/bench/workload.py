"""What the load generator sends and when: length distributions, traces, prompts and arrival times.

Everything here is a pure function of its arguments and a seed, so a run can be repeated exactly. Prompts are
token ids (no tokenizer needed on the client) drawn from the middle of the vocabulary: every tokenizer we serve
keeps its special tokens at the ends of the id range (SmolLM2 at 0-16, Llama 3 at 128000+), so the middle 80% holds
only ordinary tokens. Requests set ignore_eos and max_tokens, so output lengths are exact.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tandem_cli.inputs import InputError

DIST_KINDS = ("fixed", "uniform", "normal")


class BenchConfigError(InputError):
    """A bench flag or trace line is unusable; the message names the flag (or file and line)."""


@dataclass(frozen=True)
class LengthDist:
    """Token lengths: `fixed` (a), `uniform` integers in [a, b], or `normal` (mean a, stddev b) rounded and
    clamped to [1, mean + 4 stddev]. Written on the command line as "256", "uniform:2048:4096" or "normal:512:64"."""

    kind: str
    a: float
    b: float = 0.0

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        # Clamped to [1, upper_bound()] so the context-length check made up front always holds.
        return min(self.upper_bound(), max(1, round(rng.gauss(self.a, self.b))))

    def upper_bound(self) -> int:
        """The largest length this distribution is allowed to produce (normal: mean + 4 stddev), for
        checking against the model's context length before sending anything."""
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return int(self.b)
        return math.ceil(self.a + 4 * self.b)

    def describe(self) -> str:
        if self.kind == "fixed":
            return str(int(self.a))
        a = int(self.a) if self.kind == "uniform" else self.a
        b = int(self.b) if self.kind == "uniform" else self.b
        return f"{self.kind}:{a}:{b}"


def _number(text: str, flag: str, what: str, integer: bool) -> float:
    try:
        value = int(text) if integer else float(text)
    except ValueError:
        kind = "an integer" if integer else "a number"
        raise BenchConfigError(f"{flag}: {what} must be {kind}, got {text!r}") from None
    if not math.isfinite(value):
        raise BenchConfigError(f"{flag}: {what} must be finite, got {text!r}")
    return value


def parse_dist(text: str, flag: str) -> LengthDist:
    """Parse a DIST flag value; errors name the flag, e.g. "--input-len: uniform needs low <= high"."""
    parts = text.strip().split(":")
    if len(parts) == 1:
        value = _number(parts[0], flag, "the length", integer=True)
        if value < 1:
            raise BenchConfigError(f"{flag}: the length must be >= 1, got {int(value)}")
        return LengthDist("fixed", value)
    kind = parts[0]
    if kind not in ("uniform", "normal"):
        raise BenchConfigError(
            f"{flag}: unknown distribution {kind!r}; use N, uniform:LOW:HIGH or normal:MEAN:STDDEV"
        )
    if len(parts) != 3:
        raise BenchConfigError(f"{flag}: {kind} takes two numbers ({kind}:A:B), got {text!r}")
    if kind == "uniform":
        low = _number(parts[1], flag, "uniform LOW", integer=True)
        high = _number(parts[2], flag, "uniform HIGH", integer=True)
        if low < 1 or high < low:
            raise BenchConfigError(f"{flag}: uniform needs 1 <= LOW <= HIGH, got {int(low)}:{int(high)}")
        return LengthDist("uniform", low, high)
    mean = _number(parts[1], flag, "normal MEAN", integer=False)
    stddev = _number(parts[2], flag, "normal STDDEV", integer=False)
    if mean < 1 or stddev < 0:
        raise BenchConfigError(f"{flag}: normal needs MEAN >= 1 and STDDEV >= 0, got {mean}:{stddev}")
    return LengthDist("normal", mean, stddev)


@dataclass(frozen=True)
class TraceEntry:
    """One line of a --trace file: {"input_len": N, "output_len": M}, or explicit "prompt_token_ids"."""

    output_len: int
    input_len: int = 0
    prompt_token_ids: tuple[int, ...] = ()


def _positive_field(obj: dict, key: str, where: str) -> int:
    value = obj.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise BenchConfigError(f"{where}: {key!r} must be an integer >= 1, got {value!r}")
    return value


def _trace_entry(line: str, where: str) -> TraceEntry:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise BenchConfigError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise BenchConfigError(f"{where}: each line must be a JSON object")
    unknown = sorted(set(obj) - {"input_len", "output_len", "prompt_token_ids"})
    if unknown:
        raise BenchConfigError(
            f"{where}: unknown key {unknown[0]!r}; allowed: input_len, output_len, prompt_token_ids"
        )
    output_len = _positive_field(obj, "output_len", where)
    ids = obj.get("prompt_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
            raise BenchConfigError(f"{where}: 'prompt_token_ids' must be a non-empty list of ids >= 0")
        return TraceEntry(output_len, len(ids), tuple(ids))
    return TraceEntry(output_len, _positive_field(obj, "input_len", where))


def read_trace(path: str | Path) -> list[TraceEntry]:
    p = Path(path)
    try:
        lines = p.read_text().splitlines()
    except OSError as exc:
        raise BenchConfigError(f"--trace: cannot read {p} ({exc.strerror})") from None
    entries = [_trace_entry(line, f"--trace {p} line {n}") for n, line in enumerate(lines, 1) if line.strip()]
    if not entries:
        raise BenchConfigError(f"--trace: {p} holds no requests")
    return entries


@dataclass(frozen=True)
class RequestSpec:
    index: int
    prompt_token_ids: tuple[int, ...]
    output_len: int


def safe_id_range(vocab_size: int) -> tuple[int, int]:
    """[low, high) of the ids random prompts use: the middle 80% of the vocabulary (see the module doc)."""
    if vocab_size < 10:
        raise BenchConfigError(f"the served model's vocab_size is {vocab_size}; random prompts need >= 10")
    return vocab_size // 10, vocab_size - vocab_size // 10


def build_requests(
    count: int,
    input_len: LengthDist,
    output_len: LengthDist,
    vocab_size: int,
    seed: int,
    trace: Sequence[TraceEntry] = (),
    shared_prefix: int = 0,
) -> list[RequestSpec]:
    """`count` requests; with a trace, its entries in order (cycling when count exceeds it). With shared_prefix
    N, every prompt starts with the same N tokens (a system prompt) before its own input_len tokens; the prefix
    does not depend on `seed`, so every run and sweep point of a deployment shares it, as users of one
    application share its system prompt."""
    rng = random.Random(f"tandem-bench-prompts-{seed}")
    low, high = safe_id_range(vocab_size)
    prefix_rng = random.Random("tandem-bench-shared-prefix")
    prefix = tuple(prefix_rng.randrange(low, high) for _ in range(shared_prefix))
    specs = []
    for index in range(count):
        if trace:
            entry = trace[index % len(trace)]
            n_in, n_out, ids = entry.input_len, entry.output_len, entry.prompt_token_ids
        else:
            n_in, n_out, ids = input_len.sample(rng), output_len.sample(rng), ()
        if not ids:
            ids = prefix + tuple(rng.randrange(low, high) for _ in range(n_in))
        specs.append(RequestSpec(index, ids, n_out))
    return specs


def arrival_offsets(count: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times in seconds from the start: cumulative gamma inter-arrival gaps with shape `burstiness` and
    mean 1/rate (scale = 1 / (rate * burstiness)). Shape 1 is a Poisson process; < 1 is burstier (clumps and
    long gaps), > 1 more regular. rate = inf sends everything at t = 0. The first request leaves at t = 0."""
    if not rate > 0:
        raise BenchConfigError(f"--rate: must be > 0, got {rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise BenchConfigError(f"--burstiness: must be a finite number > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(f"tandem-bench-arrivals-{seed}")
    scale = 1.0 / (rate * burstiness)
    offsets, t = [], 0.0
    for _ in range(count):
        offsets.append(t)
        t += rng.gammavariate(burstiness, scale)
    return offsets
