"""What `tandem generate` runs: prompts and sampling from the command line or a JSONL file, checked up front.

Pure (no I/O beyond reading the input file, no engine, no network), so every line is validated before any
generation starts. A JSONL line holds exactly one of
    {"prompt": "text"} | {"messages": [{"role": ..., "content": ...}, ...]} | {"prompt_token_ids": [1, 2, ...]}
plus optional per-line max_tokens, temperature, top_p, top_k, seed, stop, logit_bias ({"token id": bias}),
presence_penalty, frequency_penalty and repetition_penalty (overriding the flags).
Ranges (top_p <= 1, ...) are the engine's or the server's to check; here: types and shapes.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from tandem_client.types import ChatMessage, Prompt, Sampling

PROMPT_KEYS = ("prompt", "messages", "prompt_token_ids")
SAMPLING_KEYS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


class InputError(ValueError):
    """The user's input is unusable; the message names the line (in --input files) and the key."""


def positive_int(text: str) -> int:
    """argparse type of a count flag (--concurrency, --prefill, ...): an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


@dataclass(frozen=True)
class GenerationInput:
    """One request: its prompt, its sampling, and where it came from (line 0: the command line)."""

    line: int
    prompt: Prompt
    sampling: Sampling


def sampling_from_flags(
    *,
    max_tokens: int,
    temperature: float,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    logprobs: int | None = None,
    logit_bias: Sequence[str] = (),
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    repetition_penalty: float | None = None,
    prompt_logprobs: int | None = None,
) -> Sampling:
    """The command line's sampling; `tandem generate` defaults to greedy so results reproduce. `logit_bias`:
    the --logit-bias flags as given, each ID=BIAS."""
    return Sampling(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        max_tokens=max_tokens,
        stop=tuple(stop),
        logprobs=logprobs,
        logit_bias=tuple(_logit_bias_flag(flag) for flag in logit_bias),
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        repetition_penalty=repetition_penalty,
        prompt_logprobs=prompt_logprobs,
    )


def _logit_bias_flag(flag: str) -> tuple[int, float]:
    """One --logit-bias ID=BIAS as a (token id, bias) pair; the range is the engine's to check."""
    token, sep, bias = flag.partition("=")
    token, bias = token.strip(), bias.strip()
    if not sep or not (token.isascii() and token.isdigit()):
        raise InputError(f"--logit-bias: must be TOKEN_ID=BIAS with a token id of digits, got {flag!r}")
    try:
        value = float(bias)
    except ValueError:
        raise InputError(f"--logit-bias {flag}: the bias must be a number, got {bias!r}") from None
    return int(token), value


def prompt_from_text(text: str, chat: bool) -> Prompt:
    """A command-line PROMPT: plain text, or (with --chat) a one-message chat from the user."""
    if not text:
        raise InputError("PROMPT: must not be empty")
    return Prompt(messages=(ChatMessage("user", text),)) if chat else Prompt(text=text)


def read_jsonl(path: str, base: Sampling, chat: bool = False) -> list[GenerationInput]:
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"--input {path}: cannot read it ({exc})") from None
    return parse_jsonl(lines, base, chat=chat, source=path)


def parse_jsonl(
    lines: Iterable[str], base: Sampling, *, chat: bool = False, source: str = "input"
) -> list[GenerationInput]:
    """Every non-blank line becomes one GenerationInput; the first bad line raises InputError."""
    inputs = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            inputs.append(_parse_line(line, number, base, chat, f"{source} line {number}"))
    if not inputs:
        raise InputError(f"{source}: no requests (the file is empty)")
    return inputs


def _parse_line(line: str, number: int, base: Sampling, chat: bool, where: str) -> GenerationInput:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InputError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(record, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(record).__name__}")
    unknown = sorted(set(record) - set(PROMPT_KEYS) - set(SAMPLING_KEYS))
    if unknown:
        allowed = ", ".join(PROMPT_KEYS + SAMPLING_KEYS)
        raise InputError(f"{where}: unknown key {unknown[0]!r} (allowed: {allowed})")
    return GenerationInput(number, _prompt(record, chat, where), _sampling(record, base, where))


def _prompt(record: dict[str, object], chat: bool, where: str) -> Prompt:
    given = [k for k in PROMPT_KEYS if k in record]
    if len(given) != 1:
        raise InputError(f"{where}: give exactly one of {', '.join(PROMPT_KEYS)} (got {given or 'none'})")
    key = given[0]
    value = record[key]
    if key == "prompt":
        if not isinstance(value, str) or not value:
            raise InputError(f"{where}: prompt: must be a non-empty string")
        return prompt_from_text(value, chat)
    if key == "messages":
        return Prompt(messages=_messages(value, where))
    if not isinstance(value, list) or not value or not all(_is_int(t) and t >= 0 for t in value):
        raise InputError(f"{where}: prompt_token_ids: must be a non-empty list of non-negative integers")
    return Prompt(token_ids=tuple(value))


def _messages(value: object, where: str) -> tuple[ChatMessage, ...]:
    if not isinstance(value, list) or not value:
        raise InputError(f"{where}: messages: must be a non-empty list of {{'role', 'content'}} objects")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or set(message) != {"role", "content"}:
            raise InputError(f"{where}: messages[{i}]: must be an object with exactly 'role' and 'content'")
        role, content = message["role"], message["content"]
        if not isinstance(role, str) or not role or not isinstance(content, str):
            raise InputError(f"{where}: messages[{i}]: role must be a non-empty string, content a string")
        messages.append(ChatMessage(role, content))
    return tuple(messages)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _sampling(record: dict[str, object], base: Sampling, where: str) -> Sampling:
    return replace(
        base,
        max_tokens=_int_field(record, "max_tokens", base.max_tokens, where),
        top_k=_int_field(record, "top_k", base.top_k, where),
        seed=_int_field(record, "seed", base.seed, where),
        temperature=_float_field(record, "temperature", base.temperature, where),
        top_p=_float_field(record, "top_p", base.top_p, where),
        presence_penalty=_float_field(record, "presence_penalty", base.presence_penalty, where),
        frequency_penalty=_float_field(record, "frequency_penalty", base.frequency_penalty, where),
        repetition_penalty=_float_field(record, "repetition_penalty", base.repetition_penalty, where),
        stop=_stop(record["stop"], where) if "stop" in record else base.stop,
        logit_bias=_logit_bias(record["logit_bias"], where) if "logit_bias" in record else base.logit_bias,
    )


def _logit_bias(value: object, where: str) -> tuple[tuple[int, float], ...]:
    """{"token id": bias} as the OpenAI API takes it (JSON object keys are strings); ranges are the engine's."""
    if not isinstance(value, dict):
        raise InputError(f'{where}: logit_bias: must be an object {{"token id": bias}}, got {value!r}')
    pairs = []
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit()):
            raise InputError(f"{where}: logit_bias: keys must be token ids (strings of digits), got {key!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise InputError(f"{where}: logit_bias: token {key}: the bias must be a number, got {bias!r}")
        pairs.append((int(key), float(bias)))
    return tuple(pairs)


def _int_field(record: dict[str, object], key: str, default: int | None, where: str) -> int | None:
    if key not in record:
        return default
    value = record[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{where}: {key}: must be an integer, got {value!r}")
    return value


def _float_field(record: dict[str, object], key: str, default: float | None, where: str) -> float | None:
    if key not in record:
        return default
    value = record[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InputError(f"{where}: {key}: must be a finite number, got {value!r}")
    return float(value)


def _stop(value: object, where: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise InputError(f"{where}: stop: must be a non-empty string or a list of non-empty strings")
    return tuple(value)
