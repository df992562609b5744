"""Routing through the real RouterServer to fake workers that follow worker.proto (see fake_workers.py):
the disaggregated and colocated paths, stop rules, retries, admission, deadlines and cancellation."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest

from router.model import ServedModel
from tandem_client import (
    ChatMessage,
    DeadlineExceeded,
    FinishReason,
    GenerationDelta,
    ResourceExhausted,
    Unavailable,
)
from tests.e2e.fake_workers import (
    FakeColocated,
    FakeDecode,
    FakePrefill,
    LoopThread,
    RouterHarness,
    Script,
)
from tests.polling import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]
PROMPT = "Tell me about foxes."
REPLY = " The quick brown fox jumps over the lazy dog."
EOS = 2  # SmolLM2's <|im_end|>


@pytest.fixture
def make(router_loop: LoopThread, served_model: ServedModel) -> Iterator:
    harnesses: list[RouterHarness] = []

    def build(reply: str = REPLY, batch: int = 2, step_s: float = 0.0, **config: object) -> RouterHarness:
        script = Script(
            served_model.tokenizer.encode(reply, False) + [EOS],
            batch=batch,
            step_s=step_s,
            num_cached_tokens=3,
        )
        harness = RouterHarness(router_loop, served_model, script, **config)
        harnesses.append(harness)
        return harness

    yield build
    for harness in harnesses:
        harness.close()


def _pair(
    harness: RouterHarness, decode_mode: str = "ok", prefill_mode: str = "ok"
) -> tuple[FakeDecode, FakePrefill]:
    return harness.add(FakeDecode, "d0", mode=decode_mode), harness.add(FakePrefill, "p0", mode=prefill_mode)


def test_disaggregated_stream_relays_first_token_then_decode_batches(make, served_model: ServedModel) -> None:
    harness = make(lease_ttl_s=7.0)
    decode, prefill = _pair(harness)
    harness.start()
    with harness.client() as client:
        events = list(client.stream(PROMPT, max_tokens=64, temperature=0, logprobs=2, request_id="req-1"))
    *deltas, result = events
    tokens = harness.script.tokens
    assert all(isinstance(d, GenerationDelta) for d in deltas)
    assert deltas[0].token_ids == (tokens[0],)  # the prefill worker's first token, alone, at once
    assert [t for d in deltas for t in d.token_ids] == tokens == list(result.token_ids)
    assert result.text == "".join(d.text for d in deltas) == REPLY
    assert (result.finish_reason, result.stop_reason) == (FinishReason.STOP, EOS)
    assert result.request_id == "req-1"
    assert list(result.prompt_token_ids) == served_model.tokenizer.encode(PROMPT)
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (
        len(result.prompt_token_ids),
        len(tokens),
    )
    assert result.usage.cached_prompt_tokens == 3
    assert len(result.logprobs) == len(tokens) and all(len(lp.top) == 2 for lp in result.logprobs)
    t = result.timings
    assert 0 <= t.queue_seconds <= t.time_to_first_token_seconds <= t.e2e_seconds
    (d_req,), (p_req,) = decode.requests, prefill.requests
    assert not d_req.local_prefill and d_req.lease_ttl_ms == 7000 and d_req.sampling.max_tokens == 64
    assert d_req.sampling.temperature == 0 and d_req.sampling.logprobs == 2
    assert p_req.request_id == d_req.request_id == p_req.target.request_id and d_req.request_id.startswith(
        "req-1"
    )
    assert list(p_req.prompt_token_ids) == list(d_req.prompt_token_ids) == list(result.prompt_token_ids)
    wait_until(lambda: harness.router.metrics.outcomes["stop"] == 1, what="the outcome recorded")
    assert decode.cancelled == prefill.cancelled == []  # both streams ended on their own


def test_deltas_never_split_a_character(make) -> None:
    reply = " Café 世界 🙂 ok"
    harness = make(reply=reply, batch=1)
    _pair(harness)
    harness.start()
    with harness.client() as client:
        *deltas, result = list(client.stream("Say it", max_tokens=64))
    assert result.text == reply and "".join(d.text for d in deltas) == reply
    assert not any("\ufffd" in d.text for d in deltas)
    assert any(d.token_ids and not d.text for d in deltas)  # some bytes were held back until complete


def test_decode_tokens_that_overtake_the_first_token_wait_for_it(make) -> None:
    harness = make(batch=1)
    _pair(harness, prefill_mode="late")
    harness.start()
    with harness.client() as client:
        *deltas, result = list(client.stream(PROMPT, max_tokens=64))
    assert deltas[0].token_ids == (harness.script.tokens[0],)
    assert list(result.token_ids) == harness.script.tokens and result.text == REPLY


def test_prefill_failure_cancels_the_reservation_and_retries_on_another_prefill(make) -> None:
    harness = make()
    decode = harness.add(FakeDecode, "d0")
    down = harness.add(FakePrefill, "p-down", mode="down")
    harness.add(FakePrefill, "p-ok", mode="ok")
    harness.start()
    with harness.client() as client:
        results = [client.generate(PROMPT, max_tokens=64) for _ in range(4)]  # p-down is met on the way
    assert all(r.text == REPLY for r in results) and down.requests
    failed = {r.request_id for r in down.requests}
    wait_until(lambda: failed <= set(decode.cancelled), what="the failed attempts' reservations cancelled")
    assert len(decode.requests) == len(results) + len(failed)  # each failure cost one extra reservation


def test_stop_string_cuts_the_text_and_cancels_the_decode_call(make) -> None:
    harness = make(batch=1, step_s=0.02)
    decode, _ = _pair(harness)
    harness.start()
    with harness.client() as client:
        *deltas, result = list(client.stream(PROMPT, max_tokens=64, stop=[" fox"]))
    assert result.text == " The quick brown" == "".join(d.text for d in deltas)
    assert (result.finish_reason, result.stop_reason) == (FinishReason.STOP, " fox")
    wait_until(
        lambda: decode.cancelled == [decode.requests[0].request_id], what="the decode call to be cancelled"
    )


def test_first_token_that_finishes_cancels_the_reservation(make) -> None:
    harness = make()
    decode, prefill = _pair(harness)
    harness.start()
    with harness.client() as client:
        result = client.generate(PROMPT, max_tokens=1)
    assert (result.token_ids, result.finish_reason) == ((harness.script.tokens[0],), FinishReason.LENGTH)
    assert result.text == " The"
    wait_until(lambda: len(decode.cancelled) == 1, what="the decode reservation to be cancelled")
    assert prefill.cancelled == []  # it shipped nothing and ended on its own


def test_colocated_worker_computes_the_prompt_itself(make, served_model: ServedModel) -> None:
    harness = make()
    worker = harness.add(FakeColocated, "c0")
    harness.start()
    with harness.client() as client:
        result = client.generate(messages=[ChatMessage("user", PROMPT)], max_tokens=64)
    assert result.text == REPLY and result.finish_reason == FinishReason.STOP
    assert list(result.prompt_token_ids) == served_model.tokenizer.encode_chat([ChatMessage("user", PROMPT)])
    assert result.usage.cached_prompt_tokens == 3  # from the worker's first TokenBatch
    (request,) = worker.requests
    assert request.local_prefill and worker.cancelled == []


def test_a_prompt_spills_onto_the_decode_worker_while_the_prefill_queue_is_long(make) -> None:
    """router.local_prefill_spill_tokens: the prefill worker reports a queue past the bound, so the decode worker
    computes the prompt itself (Decode with local_prefill) and the placement is counted as local_spill."""
    harness = make(local_prefill_spill_tokens=1000)
    decode = harness.add(FakeDecode, "d0")
    prefill = harness.add(FakePrefill, "p0", queued_prefill_tokens=5000)
    harness.start()
    with harness.client() as client:
        assert client.generate(PROMPT, max_tokens=64).text == REPLY
    (request,) = decode.requests
    assert request.local_prefill and prefill.requests == []
    assert harness.router.metrics.placements["local_spill"] == 1
    prefill.queued_prefill_tokens = 0  # its queue drained: the next prompt goes to the prefill worker again
    wait_until(lambda: harness.status().workers and all(w.queued_prefill_tokens == 0 for w in harness.status().workers),
               what="the router to poll the drained queue")  # fmt: skip
    with harness.client() as client:
        assert client.generate(PROMPT, max_tokens=64).text == REPLY
    assert len(prefill.requests) == 1 and harness.router.metrics.placements["prefill_worker"] == 1


def test_two_plus_two_workers_all_serve_traffic(make) -> None:
    harness = make()
    workers = [
        harness.add(kind, f"{kind.__name__}{i}") for kind in (FakeDecode, FakePrefill) for i in range(2)
    ]
    harness.start()
    with harness.client() as client:
        for _ in range(8):
            assert client.generate(PROMPT, max_tokens=64).text == REPLY
    assert all(w.requests for w in workers), [len(w.requests) for w in workers]


def test_no_room_moves_to_the_next_decode_worker(make) -> None:
    harness = make()
    full = harness.add(FakeDecode, "d-full", mode="no_room", free_blocks=500)  # looks best, refuses
    roomy = harness.add(FakeDecode, "d-roomy", free_blocks=50)
    harness.add(FakePrefill, "p0")
    harness.start()
    with harness.client() as client:
        assert client.generate(PROMPT, max_tokens=64).text == REPLY
    assert len(full.requests) == 1 and len(roomy.requests) == 1
    assert harness.router.metrics.retries["no_room"] == 1


def test_no_room_anywhere_waits_with_backoff_until_the_deadline(make) -> None:
    harness = make()
    full, _ = _pair(harness, decode_mode="no_room")
    harness.start()
    with harness.client() as client, pytest.raises(DeadlineExceeded):
        client.generate(PROMPT, timeout=0.6)
    assert 3 <= len(full.requests) <= 30  # retried, with growing pauses in between


def test_worker_failing_before_any_token_is_retried_once_elsewhere(make) -> None:
    harness = make()
    broken = harness.add(FakeDecode, "d-broken", mode="down", free_blocks=500)
    healthy = harness.add(FakeDecode, "d-ok")
    harness.add(FakePrefill, "p0")
    harness.start()
    with harness.client() as client:
        assert client.generate(PROMPT, max_tokens=64).text == REPLY
    assert len(broken.requests) == 1 and len(healthy.requests) == 1
    assert harness.router.metrics.retries["worker_failed"] == 1


def test_second_failure_gives_unavailable(make) -> None:
    harness = make()
    harness.add(FakeDecode, "d0", mode="down")
    harness.add(FakeDecode, "d1", mode="down")
    harness.add(FakePrefill, "p0")
    harness.start()
    with harness.client() as client, pytest.raises(Unavailable, match="the retry failed too"):
        client.generate(PROMPT)


def test_worker_failing_after_tokens_were_sent_past_the_retry_budget_is_unavailable(make) -> None:
    # step_s: the decode stream must not overtake the prefill's first token (then no token was sent yet).
    # worker_retries=0: no resume (tests/e2e/test_faults.py covers resuming on real workers).
    harness = make(batch=2, step_s=0.05, worker_retries=0)
    _pair(harness, decode_mode="fail_after")
    harness.start()
    seen: list[int] = []
    with (
        harness.client() as client,
        pytest.raises(Unavailable, match=r"decode worker d0 failed: UNAVAILABLE.*3 tokens had been sent"),
    ):
        for event in client.stream(PROMPT, max_tokens=64):
            seen += event.token_ids  # type: ignore[union-attr]
    assert seen == harness.script.tokens[:3]  # first token + one batch, then the failure


def test_router_full_refuses_at_once_with_resource_exhausted(make) -> None:
    harness = make(max_inflight=1, max_queue=1, worker_rpc_timeout_s=60.0)
    decode, _ = _pair(harness, decode_mode="hang")
    harness.start()
    with harness.client() as client:
        running = client.stream(PROMPT)
        wait_until(lambda: harness.status().router.in_flight_requests == 1, what="one request in flight")
        waiting = client.stream(PROMPT)
        wait_until(lambda: harness.status().router.queued_requests == 1, what="one request queued")
        with pytest.raises(ResourceExhausted, match="router is full: 1 requests running, 1 waiting"):
            client.generate(PROMPT, timeout=5)
        running.close()
        waiting.close()
        wait_until(lambda: len(decode.cancelled) >= 1, what="the hanging decode call to be cancelled")
        wait_until(
            lambda: harness.status().router.in_flight_requests + harness.status().router.queued_requests == 0,
            what="admission to drain",
        )
    assert harness.router.metrics.rejections["resource_exhausted"] == 1


def test_client_deadline_cancels_both_worker_calls(make) -> None:
    harness = make()
    decode, prefill = _pair(harness, prefill_mode="hang")
    harness.start()
    with harness.client() as client, pytest.raises(DeadlineExceeded):
        client.generate(PROMPT, timeout=0.5)
    wait_until(
        lambda: len(decode.cancelled) == 1 and len(prefill.cancelled) == 1, what="both calls cancelled"
    )
    assert prefill.requests[0].request_id in prefill.cancelled


def test_router_default_deadline_applies_when_the_client_sets_none(make) -> None:
    harness = make(request_timeout_s=0.5)
    decode, prefill = _pair(harness, prefill_mode="hang")
    harness.start()
    with harness.client(timeout=None) as client, pytest.raises(DeadlineExceeded) as info:
        client.generate(PROMPT)
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "deadline passed before the first token" in info.value.details
    wait_until(
        lambda: len(decode.cancelled) == 1 and len(prefill.cancelled) == 1, what="both calls cancelled"
    )
    wait_until(lambda: harness.router.metrics.outcomes["deadline_exceeded"] == 1, what="the outcome recorded")


def test_client_cancel_after_the_first_token_cancels_both_worker_calls(make) -> None:
    harness = make()
    decode, prefill = _pair(harness, prefill_mode="hold")  # first token sent, KV never shipped
    harness.start()
    with harness.client() as client:
        stream = client.stream(PROMPT)
        first = next(stream)
        assert first.token_ids == (harness.script.tokens[0],)  # type: ignore[union-attr]
        stream.close()
    wait_until(
        lambda: len(decode.cancelled) == 1 and len(prefill.cancelled) == 1, what="both calls cancelled"
    )
    wait_until(lambda: harness.router.metrics.outcomes["cancelled"] == 1, what="the outcome recorded")


def test_a_worker_taken_out_of_the_membership_fails_its_calls_over_at_once(make) -> None:
    # The controller replaces a worker whose node is gone; the process there may be stopped, not dead, so its
    # stream stays open and silent (here: still streaming, 0.3 s a token). Leaving the membership must end the
    # request's call on it at once rather than when the stream ends. worker_retries=0: the failure shows.
    harness = make(batch=1, step_s=0.3, worker_retries=0)
    decode, prefill = _pair(harness)
    harness.start()
    seen: list[int] = []
    with harness.client() as client:
        stream = client.stream(PROMPT, max_tokens=64)
        seen += next(stream).token_ids  # type: ignore[union-attr]
        wait_until(lambda: decode.active == 1, what="the decode call to be open")

        async def replace_decode() -> None:
            harness.router.set_workers([prefill.endpoint()])

        harness.loop.run(replace_decode())
        removed = time.monotonic()
        with pytest.raises(Unavailable, match="decode worker d0 failed: UNAVAILABLE: left the membership"):
            for event in stream:
                seen += event.token_ids  # type: ignore[union-attr]
        assert time.monotonic() - removed < 1.0, "the call was given up only when its stream ended"
    assert seen == harness.script.tokens[: len(seen)]
    wait_until(lambda: decode.cancelled == [decode.requests[0].request_id], what="the decode call cancelled")
