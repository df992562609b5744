"""StepRecord: what one engine step computed and how long it took, for whoever watches the engine (metrics).

The engine leaves the record of its last step that ran in `Engine.last_step`; the EngineLoop hands each one to
its step listeners on the loop thread, before the step's outputs reach their subscribers.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from model_runtime.request import Request, SchedulerOutput


@dataclass(frozen=True)
class FirstToken:
    """Where one prompt's time to first token went inside the worker: `waiting` from its arrival (the RPC's,
    when the worker passed it to add_request) until the scheduler first gave it blocks, `prefill` from then
    until the step that sampled its first token ended. Prompts whose KV arrived from elsewhere have none."""

    waiting_s: float
    prefill_s: float
    cached_tokens: int  # prompt tokens the prefix cache served


@dataclass(frozen=True)
class StepRecord:
    duration_s: float  # wall time of Engine.step(): schedule, model, sample, stop rules
    num_tokens: int  # tokens computed: prompt chunks, recomputed tokens and one per decode
    prefill_tokens: int  # prompt tokens computed (a request whose prompt arrived as KV adds 0)
    num_prefill: int  # sequences that ran a prompt chunk (or recomputed after preemption)
    num_decode: int  # sequences that ran one new token
    num_preempted: int  # requests preempted to make room for this step
    first_tokens: tuple[FirstToken, ...] = ()  # the prompts whose first token this step sampled

    @property
    def batch_size(self) -> int:
        """Sequences in the step."""
        return self.num_prefill + self.num_decode

    @classmethod
    def planned(cls, out: SchedulerOutput) -> StepRecord:
        """The record of a scheduled step, before it runs (counts read before the scheduler advances), with
        no duration yet. One pass over the chunks: it runs every step, 512 chunks at a big batch."""
        decodes = prefill_tokens = 0
        for chunk in out.chunks:
            r = chunk.request
            computed, n = r.num_computed_tokens, chunk.num_tokens
            prompt_left = len(r.prompt_token_ids) - computed
            if prompt_left > 0:
                prefill_tokens += min(n, prompt_left)
            # A decode: one token after everything else is computed, for a request that already has output.
            elif n == 1 and r.output_token_ids and computed == r.num_tokens - 1:
                decodes += 1
        return cls(
            duration_s=0.0,
            num_tokens=out.num_tokens,
            prefill_tokens=prefill_tokens,
            num_prefill=len(out.chunks) - decodes,
            num_decode=decodes,
            num_preempted=len(out.preempted),
        )


def first_tokens(requests: Iterable[Request]) -> tuple[FirstToken, ...]:
    """The phases of each request whose first output token was just sampled here (its prompt computed by this
    engine: scheduled_time is set only when the scheduler admitted it from the waiting queue)."""
    now = time.monotonic()
    return tuple(
        FirstToken(r.scheduled_time - r.arrival_time, now - r.scheduled_time, r.num_cached_tokens)
        for r in requests
        if r.scheduled_time is not None and r.num_output_tokens == 1
    )
