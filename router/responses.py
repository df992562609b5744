"""The client's side of one request: worker tokens in, Delta messages and the Final message out.

An OutputTracker (model_runtime.output, the same stop rules the engine applies) over an IncrementalDetokenizer
decides the text of each Delta and when the request ends; stop strings exist only here (workers stop on
tokens). Tokens after the one that ended the request are dropped, so the client never sees text past a stop.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from model_runtime.detokenizer import IncrementalDetokenizer
from model_runtime.output import OutputTracker
from model_runtime.request import RequestStatus
from router.model import ServedModel
from router.validation import ValidatedRequest
from tandem_api.tandem.v1 import generate_pb2

_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: generate_pb2.FINISH_REASON_STOP,
    RequestStatus.FINISHED_LENGTH: generate_pb2.FINISH_REASON_LENGTH,
    RequestStatus.FINISHED_ABORTED: generate_pb2.FINISH_REASON_ABORT,
}


@dataclass
class RequestClock:
    """Monotonic times of one request, for Final.timings."""

    arrival: float
    started: float | None = None  # the first worker call of the attempt that produced the output
    first_token: float | None = None

    def timings(self) -> generate_pb2.Timings:
        now = time.monotonic()
        return generate_pb2.Timings(
            queue_seconds=(self.started or now) - self.arrival,
            time_to_first_token_seconds=(self.first_token or now) - self.arrival,
            e2e_seconds=now - self.arrival,
        )


class ResponseBuilder:
    def __init__(self, request: ValidatedRequest, model: ServedModel, clock: RequestClock) -> None:
        self.request = request
        self.clock = clock
        self._detok = IncrementalDetokenizer(model.tokenizer, request.prompt_token_ids)
        self._tracker = OutputTracker(
            request.sampling,
            model.eos_token_ids,
            self._detok,
            model.max_model_len,
            len(request.prompt_token_ids),
        )
        self.token_ids: list[int] = []
        self.cached_prompt_tokens = 0
        self.finish_reason: int | None = None  # generate_pb2.FinishReason once finished
        self.stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def stopped_by_string(self) -> bool:
        """Ended by a stop string: a rule the workers do not know, so their streams must be cancelled."""
        return isinstance(self.stop_reason, str)

    def add(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[generate_pb2.TokenLogprob] = (),
        prompt_logprobs: Sequence[generate_pb2.TokenLogprob] = (),
    ) -> generate_pb2.GenerateResponse:
        """The Delta for one batch of new tokens (one message per batch, even when its text is held back); the
        first batch brings the prompt's scores when the request asked for them. A score-only request ends
        there, its one sampled token dropped."""
        if self.finished:
            raise RuntimeError("tokens added after the request finished")
        delta = generate_pb2.Delta(prompt_logprobs=prompt_logprobs)
        if self.request.score_only:
            self.clock.first_token = self.clock.first_token or time.monotonic()
            self._finish(generate_pb2.FINISH_REASON_LENGTH, None)
            return generate_pb2.GenerateResponse(delta=delta)
        parts = []
        for i, token in enumerate(token_ids):
            verdict = self._tracker.on_token(token)
            delta.token_ids.append(token)
            if i < len(logprobs):
                delta.logprobs.append(logprobs[i])
            parts.append(verdict.text_delta)
            if verdict.finished is not None:
                self._finish(_FINISH_REASONS[verdict.finished], verdict.stop_reason)
                break
        delta.text = "".join(parts)
        self.token_ids.extend(delta.token_ids)
        if self.clock.first_token is None and delta.token_ids:
            self.clock.first_token = time.monotonic()
        return generate_pb2.GenerateResponse(delta=delta)

    def end(
        self, finish_reason: int, stop_token_id: int | None = None
    ) -> generate_pb2.GenerateResponse | None:
        """A worker ended the request before the router's own rules did (an abort, or a length limit the worker
        applies differently): the held-back text is final now. Returns a text-only Delta with it, if any."""
        if self.finished:
            return None
        # Read, not modify, the tracker: it is done once the worker is, and its held-back tail plus the
        # detokenizer's incomplete bytes are exactly what the client has not seen.
        text = (self._tracker.text + self._detok.finish())[self._tracker.emitted :]
        self._finish(finish_reason, stop_token_id)
        return generate_pb2.GenerateResponse(delta=generate_pb2.Delta(text=text)) if text else None

    def final(self) -> generate_pb2.GenerateResponse:
        if self.finish_reason is None:
            raise RuntimeError("final message before the request finished")
        final = generate_pb2.Final(
            request_id=self.request.request_id,
            finish_reason=self.finish_reason,  # type: ignore[arg-type]
            usage=generate_pb2.Usage(
                prompt_tokens=len(self.request.prompt_token_ids),
                completion_tokens=len(self.token_ids),
                cached_prompt_tokens=self.cached_prompt_tokens,
            ),
            timings=self.clock.timings(),
            prompt_token_ids=self.request.prompt_token_ids,
        )
        if self.finish_reason == generate_pb2.FINISH_REASON_STOP:
            if isinstance(self.stop_reason, str):
                final.stop_string = self.stop_reason
            elif self.stop_reason is not None:
                final.stop_token_id = self.stop_reason
        return generate_pb2.GenerateResponse(final=final)

    def _finish(self, finish_reason: int, stop_reason: int | str | None) -> None:
        self.finish_reason = finish_reason
        self.stop_reason = stop_reason
