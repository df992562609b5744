"""Turning sampled tokens into text and deciding when a request stops.

Shared by the offline engine, the workers and the router (so it must not import torch). One tracker per
request: feed it each new token; it says whether the request ended (and, for an `OutputTracker`, the text that is
safe to show).

    TokenRules      the stop rules on token ids alone: a stop id, EOS (unless ignore_eos), max_tokens, the context
    TokenTracker    TokenRules per token, no text: what a worker runs (the router owns text)
    OutputTracker   TokenRules plus detokenization and stop strings: the router and the offline engine

Text is held back while it could still become a stop string, so the streamed deltas always join to exactly the
final text (which ends before the stop string).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from model_runtime.request import RequestStatus, SamplingParams


class Detokenizer(Protocol):
    def push(self, token_ids: list[int]) -> str: ...

    def finish(self) -> str: ...


@dataclass
class TokenVerdict:
    text_delta: str
    finished: RequestStatus | None = None
    stop_reason: int | str | None = None


@dataclass(frozen=True)
class TokenRules:
    """The stop rules that need only token ids. A worker applies these alone; stop strings need the text."""

    sampling: SamplingParams
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    prompt_len: int

    def stop(self, token_id: int) -> tuple[RequestStatus | None, int | None]:
        """(FINISHED_STOPPED, the id) when `token_id` is a stop id, or an EOS the request does not ignore."""
        if token_id in self.sampling.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token_id
        if not self.sampling.ignore_eos and token_id in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, token_id
        return None, None

    def at_length(self, num_output_tokens: int) -> bool:
        """max_tokens reached, or the model's context is full."""
        return (
            num_output_tokens >= self.sampling.max_tokens
            or self.prompt_len + num_output_tokens >= self.max_model_len
        )


@dataclass
class TokenTracker:
    """TokenRules over a request's output, without text: the verdicts an OutputTracker would give, minus stop
    strings, with an empty text_delta. Workers run this; the router detokenizes once, on its side."""

    rules: TokenRules
    num_output_tokens: int = 0
    finished: RequestStatus | None = None

    def on_token(self, token_id: int) -> TokenVerdict:
        if self.finished is not None:
            raise RuntimeError("on_token after the request finished")
        self.num_output_tokens += 1
        status, reason = self.rules.stop(token_id)
        if status is None and self.rules.at_length(self.num_output_tokens):
            status = RequestStatus.FINISHED_LENGTH
        self.finished = status
        return TokenVerdict("", status, reason)


@dataclass
class OutputTracker:
    """TokenRules plus the text: incremental detokenization and stop strings (the router, the offline engine)."""

    sampling: SamplingParams
    eos_token_ids: tuple[int, ...]
    detokenizer: Detokenizer
    max_model_len: int
    prompt_len: int
    num_output_tokens: int = 0
    text: str = ""  # everything decoded so far (may run past a stop string until finished)
    emitted: int = 0  # characters of `text` already handed out
    finished: RequestStatus | None = None
    _stop_tail: int = field(init=False)
    _rules: TokenRules = field(init=False)

    def __post_init__(self) -> None:
        self._stop_tail = max((len(s) for s in self.sampling.stop), default=0)
        self._rules = TokenRules(self.sampling, self.eos_token_ids, self.max_model_len, self.prompt_len)

    def on_token(self, token_id: int) -> TokenVerdict:
        if self.finished is not None:
            raise RuntimeError("on_token after the request finished")
        self.num_output_tokens += 1
        search_from = max(0, len(self.text) - self._stop_tail + 1)
        self.text += self.detokenizer.push([token_id])
        status: RequestStatus | None
        reason: int | str | None
        status, reason = self._rules.stop(token_id)
        if status is None and self._stop_tail:
            status, reason = self._string_stop(search_from)
        if status is None and self._rules.at_length(self.num_output_tokens):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None and not isinstance(reason, str):
            self.text += (
                self.detokenizer.finish()
            )  # an unfinished character ends as U+FFFD, as decode() has it
        self.finished = status
        return TokenVerdict(self._release(), status, reason)

    def _string_stop(self, search_from: int) -> tuple[RequestStatus | None, int | str | None]:
        hits = [(idx, s) for s in self.sampling.stop if (idx := self.text.find(s, search_from)) >= 0]
        if not hits:
            return None, None
        idx, stop = min(hits)
        self.text = self.text[:idx]
        return RequestStatus.FINISHED_STOPPED, stop

    def _release(self) -> str:
        """New text that can no longer turn into a stop string (all of it once finished)."""
        upto = len(self.text)
        if self.finished is None and self._stop_tail:
            upto = max(self.emitted, len(self.text) - self._stop_tail + 1)
        delta = self.text[self.emitted : upto]
        self.emitted = max(self.emitted, upto)
        return delta
