"""Turning sampled tokens into text and deciding when a request stops.

Shared by the offline engine, the workers and the router (so it must not import torch). One `OutputTracker`
per request: feed it each new token; it returns the text that is safe to show and whether the request ended.

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


@dataclass
class OutputTracker:
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

    def __post_init__(self) -> None:
        self._stop_tail = max((len(s) for s in self.sampling.stop), default=0)

    def on_token(self, token_id: int) -> TokenVerdict:
        if self.finished is not None:
            raise RuntimeError("on_token after the request finished")
        self.num_output_tokens += 1
        search_from = max(0, len(self.text) - self._stop_tail + 1)
        self.text += self.detokenizer.push([token_id])
        status, reason = self._token_stop(token_id)
        if status is None and self._stop_tail:
            status, reason = self._string_stop(search_from)
        if status is None and (
            self.num_output_tokens >= self.sampling.max_tokens
            or self.prompt_len + self.num_output_tokens >= self.max_model_len
        ):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None and not isinstance(reason, str):
            self.text += (
                self.detokenizer.finish()
            )  # an unfinished character ends as U+FFFD, as decode() has it
        self.finished = status
        return TokenVerdict(self._release(), status, reason)

    def _token_stop(self, token_id: int) -> tuple[RequestStatus | None, int | str | None]:
        if token_id in self.sampling.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token_id
        if not self.sampling.ignore_eos and token_id in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, token_id
        return None, None

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
