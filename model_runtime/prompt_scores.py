"""Prompt logprobs (SamplingParams.prompt_logprobs): the model's logprob of each prompt token after the first,
with the top-n alternatives at its position. Evaluation harnesses score text this way (OpenAI's `echo` with
`logprobs`, vLLM's `prompt_logprobs`).

The logits at prompt position p predict token p + 1, so a prompt chunk covering positions [s, e) scores tokens
s + 1 .. min(e, n - 1) of an n-token prompt; the chunk's last row at position n - 1 is the sampler's (the first
output token). A step's scoring rows are planned on the host with its other inputs (HostBatch.prompt_rows,
which tensor-parallel ranks receive too: the logits are gathered across them), computed on the device after
the forward in slices of SLICE_ROWS rows (so a 2k-token chunk never holds 2k x vocab float32 logits at once),
and stored into each request (Request.prompt_logprobs) once the step's results are on the host. The request's
first output carries the whole list (Engine._emit).

A request that scores its prompt reads nothing from the prefix cache (scheduler: every position must run);
its blocks still enter the cache for others. A preempted request that recomputes its prompt stores the same
positions again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from model_runtime.request import Request, ScheduledChunk
from model_runtime.sampler import LogprobsTensors

SLICE_ROWS = 256  # scoring rows per lm_head call: [256, vocab] float32 logits at a time


@dataclass(frozen=True)
class PromptSpan:
    """`count` prompt tokens of `request` scored in one step: tokens first..first+count-1 (prompt positions),
    from the step's rows row..row+count-1."""

    request: Request
    row: int
    first: int
    count: int


@dataclass(frozen=True)
class PromptScores:
    """One step's scores: `scores` rows in `spans` order (device tensors until copied to the host)."""

    spans: tuple[PromptSpan, ...]
    scores: LogprobsTensors

    def to_host(self) -> PromptScores:
        """Pinned host copies, started without waiting (ModelRunner's caller records an event after them)."""
        return PromptScores(self.spans, self.scores.to_host())

    def store(self) -> None:
        """Each span's scores (on the host) into its request's prompt_logprobs, at the positions of the tokens
        they score, with each request's own top-n."""
        chosen = self.scores.chosen.tolist()
        widest = self.scores.top_ids.shape[1]
        ids = self.scores.top_ids.tolist() if widest else None
        values = self.scores.top_logprobs.tolist() if widest else None
        at = 0
        for span in self.spans:
            request = span.request
            held = request.prompt_logprobs
            if held is not None and request.scoring_prompt:  # not already sent (a recomputed chunk)
                n = request.sampling.prompt_logprobs or 0
                end = at + span.count
                if n and ids is not None and values is not None:
                    entries = [
                        (c, list(zip(i[:n], v[:n])))
                        for c, i, v in zip(chosen[at:end], ids[at:end], values[at:end])
                    ]
                else:
                    entries = [(c, []) for c in chosen[at:end]]
                held[span.first : span.first + span.count] = entries
            at += span.count


def span_of(chunk: ScheduledChunk, row: int) -> PromptSpan | None:
    """The prompt tokens a chunk of a scoring request scores, from the step's row `row` on (None: none). Read
    before the scheduler advances the step: num_computed_tokens is still the chunk's start."""
    request = chunk.request
    start = request.num_computed_tokens
    end = min(start + chunk.num_tokens, request.num_prompt_tokens - 1)
    return PromptSpan(request, row, start + 1, end - start) if end > start else None


def plan_rows(spans: list[PromptSpan]) -> tuple[np.ndarray, np.ndarray, int]:
    """(rows [P] int64, targets [P] int64: the prompt token each row predicts, the widest top-n asked)."""
    rows = np.concatenate([np.arange(s.row, s.row + s.count, dtype=np.int64) for s in spans])
    targets = np.concatenate(
        [np.asarray(s.request.prompt_token_ids[s.first : s.first + s.count], dtype=np.int64) for s in spans]
    )
    top_n = max(s.request.sampling.prompt_logprobs or 0 for s in spans)
    return rows, targets, top_n


def score_rows(
    hidden: torch.Tensor,
    rows: torch.Tensor,
    targets: torch.Tensor,
    top_n: int,
    logits_of: Callable[[torch.Tensor], torch.Tensor],
) -> LogprobsTensors:
    """Each target's logprob at `rows` of `hidden` and the `top_n` best there. `logits_of(hidden_rows)` is the
    runner's lm_head (float32 logits, gathered across tensor-parallel ranks)."""
    parts = [
        _score(
            logits_of(hidden.index_select(0, rows[begin : begin + SLICE_ROWS])),
            targets[begin : begin + SLICE_ROWS],
            top_n,
        )
        for begin in range(0, int(rows.shape[0]), SLICE_ROWS)
    ]
    if len(parts) == 1:
        return parts[0]
    return LogprobsTensors(
        chosen=torch.cat([p.chosen for p in parts]),
        top_ids=torch.cat([p.top_ids for p in parts]),
        top_logprobs=torch.cat([p.top_logprobs for p in parts]),
    )


def _score(logits: torch.Tensor, targets: torch.Tensor, top_n: int) -> LogprobsTensors:
    """Logprobs without the log_softmax tensor: a logprob is its logit less the row's logsumexp, and the top-n
    logits are the top-n logprobs; two reads of the float32 logits where log_softmax writes and rereads them
    (each row is vocab wide)."""
    lse = torch.logsumexp(logits, dim=-1)
    chosen = logits.gather(1, targets.unsqueeze(1)).squeeze(1) - lse
    if not top_n:
        empty = logits.new_empty((logits.shape[0], 0))
        return LogprobsTensors(chosen=chosen, top_ids=empty.long(), top_logprobs=empty)
    # top 1 (an evaluation harness's "is the continuation greedy"): a max, one pass; topk over a vocabulary-wide
    # row takes several
    top = logits.max(dim=-1, keepdim=True) if top_n == 1 else logits.topk(top_n, dim=-1)
    return LogprobsTensors(chosen=chosen, top_ids=top.indices, top_logprobs=top.values - lse.unsqueeze(1))
