"""The rules a request must meet to run, stated once. Torch-free: the router uses them too.

    limits = RequestLimits(vocab_size, max_model_len, block_size, usable_blocks)
    limits.check(prompt_token_ids, sampling)      # InvalidRequest naming the field, or None

Who applies what:
    router      every field, with the client's field names (`input.token_ids: ...`), through the rule functions
                below; plus its own policies (an explicit max_tokens past the context is rejected, not capped)
    engine      `RequestLimits.check` on every request it accepts (add_request, add_prefilled, and the decode
                worker's reservation, in the same engine-thread call that allocates the blocks)
    scheduler   `prompt_leaves_no_room` and `pool_overflow` at admission, besides its own invariants
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from model_runtime.request import SamplingError, SamplingParams

EMPTY_PROMPT = "must hold at least one token id"


class InvalidRequest(ValueError):
    """A request the engine cannot run (bad prompt or parameters); the message names the field."""


def ints_within(values: Sequence[object], low: int | None = None, high: int | None = None) -> bool:
    """Whether every value is exactly an int (not a bool, not an int subclass) in [low, high) (None: unbounded).

    For the id lists on a request's or a handoff's hot path (thousands of prompt tokens, hundreds of block ids):
    set, min and max are C loops. It only answers the common case quickly; a caller that gets False walks the
    values itself to name the offender (and may accept what this does not, such as a bool)."""
    if not set(map(type, values)) <= {int}:
        return False
    if not values:
        return True
    ints: Sequence[int] = values  # type: ignore[assignment]  # every value is an int (checked above)
    return (low is None or min(ints) >= low) and (high is None or max(ints) < high)


def out_of_vocab(token_ids: Sequence[object], vocab_size: int) -> object | None:
    """The first id that is not an integer in [0, vocab_size), or None. (ints_within decides the common case:
    a decode worker checks every admitted prompt on its engine thread.)"""
    if ints_within(token_ids, 0, vocab_size):
        return None
    return next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab_size), None)


def prompt_leaves_no_room(num_prompt_tokens: int, max_model_len: int) -> str | None:
    """Why a prompt this long cannot run (it must leave room for one output token), or None."""
    if num_prompt_tokens < max_model_len:
        return None
    return (
        f"{num_prompt_tokens} tokens leave no room for output in the model's context of {max_model_len} "
        f"tokens; at most {max_model_len - 1} prompt tokens fit"
    )


def token_cap(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> int:
    """Most tokens (prompt + output) a request may ever hold: max_tokens, capped by the context."""
    return min(num_prompt_tokens + max_tokens, max_model_len)


def pool_overflow(cap_tokens: int, block_size: int, usable_blocks: int) -> str | None:
    """Why a request of `cap_tokens` tokens could never run in this pool (it must fit alone), or None."""
    need = -(-cap_tokens // block_size)
    if need <= usable_blocks:
        return None
    return (
        f"prompt + max_tokens (capped at max_model_len) is {cap_tokens} tokens = {need} blocks of "
        f"{block_size}, but the pool has only {usable_blocks} blocks"
    )


@dataclass(frozen=True)
class RequestLimits:
    """One engine's limits: its vocabulary, its context and its KV pool."""

    vocab_size: int
    max_model_len: int
    block_size: int
    usable_blocks: int

    def check(self, prompt_token_ids: Sequence[int], sampling: SamplingParams) -> None:
        """Raise InvalidRequest naming the field when the request can never run here."""
        if not prompt_token_ids:
            raise InvalidRequest(f"prompt_token_ids: {EMPTY_PROMPT}")
        bad = out_of_vocab(prompt_token_ids, self.vocab_size)
        if bad is not None:
            raise InvalidRequest(
                f"prompt_token_ids: {bad!r} is outside the vocabulary [0, {self.vocab_size})"
            )
        n = len(prompt_token_ids)
        problem = prompt_leaves_no_room(n, self.max_model_len)
        if problem is not None:
            raise InvalidRequest(f"prompt_token_ids: {problem}")
        try:
            sampling.check_vocab(self.vocab_size)
        except SamplingError as exc:
            raise InvalidRequest(str(exc)) from None
        cap = token_cap(n, sampling.max_tokens, self.max_model_len)
        problem = pool_overflow(cap, self.block_size, self.usable_blocks)
        if problem is not None:
            raise InvalidRequest(f"max_tokens: {problem}")
