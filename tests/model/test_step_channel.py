"""The channel between a tensor-parallel engine's lead and its other ranks (model_runtime.parallel.step_sync):
control messages out (CONTROL), queued reports back (GATHER), ordered with the steps, over real gloo ranks.

This is what a rank's own KV agent will use (issue 18's handoff between workers of different sizes): the lead
tells every rank what to send or receive, and each rank tells the lead what it finished."""

from __future__ import annotations

import random

import pytest

from tests.model import tp_ranks

pytestmark = pytest.mark.model


def expected_reports(rank: int, messages: list[bytes]) -> list[int]:
    words: list[int] = []
    for i, message in enumerate(messages):
        words += [rank, len(message), sum(message) % 1000, i]
    return words


@pytest.mark.parametrize("tp", [2, 3])
def test_control_messages_reach_every_rank_and_their_reports_come_back_in_order(tp: int) -> None:
    rng = random.Random(tp)
    # Lengths from one byte to past a gloo chunk; bytes of every value (no text assumed).
    messages = [bytes([7]), bytes(rng.randrange(256) for _ in range(300_000)), b"\x00" * 17]
    batch = tp_ranks.prefill_then_decode([[5, 9, 14], [11, 4]])[0]
    lead, *followers = tp_ranks.run_ranks(tp_ranks.channel_exchange, tp, messages, batch, timeout_s=120)
    for rank, (got, steps) in enumerate(followers, start=1):
        assert got == messages, f"rank {rank} got other messages"
        assert steps == [batch.token_ids.tolist()], f"rank {rank} steps {steps}"
    # Each gather brings at most 3 words per follower; what did not fit comes with the next ones, in order.
    for rank in range(1, tp):
        words = [w for gather in lead for w in gather[rank - 1]]
        assert words == expected_reports(rank, messages), f"rank {rank}'s reports"
    assert all(len(gather) == tp - 1 and all(len(row) <= 3 for row in gather) for gather in lead)
    assert lead[-1] == [[]] * (tp - 1)  # the lead stopped once every queue was empty
