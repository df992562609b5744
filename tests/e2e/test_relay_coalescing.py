"""The router's relay under load (router.relay): TokenBatches that piled up behind the one being relayed leave as
one Delta, with the same tokens, text, logprobs and finish as one Delta each; a relay that keeps up writes one
Delta per batch; nothing past a stop is sent. Real ResponseBuilder (SmolLM2's tokenizer), real StreamMerger,
the decode worker's stream replaced by a call object that yields scripted worker.proto messages."""

from __future__ import annotations

import asyncio
import time

import grpc.aio
import pytest

from model_runtime.request import SamplingParams
from router.model import ServedModel
from router.relay import Relay
from router.responses import RequestClock, ResponseBuilder
from router.streams import StreamMerger, WorkerStream
from router.validation import ValidatedRequest
from tandem_api.tandem.v1 import generate_pb2, worker_pb2

pytestmark = pytest.mark.e2e
EOS = 2  # SmolLM2's <|im_end|>


class ScriptedCall:
    """A server-streaming call whose messages are all there at once (`gap_s` None) or one every `gap_s`."""

    def __init__(self, messages: list[worker_pb2.DecodeEvent], gap_s: float | None) -> None:
        self._messages = list(messages)
        self._gap_s = gap_s

    async def read(self) -> object:
        if self._gap_s is not None:
            await asyncio.sleep(self._gap_s)
        return self._messages.pop(0) if self._messages else grpc.aio.EOF

    def cancel(self) -> None:
        self._messages.clear()


def decode_events(tokens: list[int], per_batch: int, finish: int) -> list[worker_pb2.DecodeEvent]:
    events = []
    for i in range(0, len(tokens), per_batch):
        ids = tokens[i : i + per_batch]
        lps = [generate_pb2.TokenLogprob(token_id=t, logprob=-0.01 * t) for t in ids]
        events.append(
            worker_pb2.DecodeEvent(
                tokens=worker_pb2.TokenBatch(token_ids=ids, logprobs=lps, num_cached_tokens=4)
            )
        )
    events.append(worker_pb2.DecodeEvent(finished=worker_pb2.DecodeFinished(finish_reason=finish)))
    return events


def relay(
    model: ServedModel,
    events: list[worker_pb2.DecodeEvent],
    gap_s: float | None,
    ignore_eos: bool = True,
    stream_interval: int = 1,
) -> tuple[list[generate_pb2.GenerateResponse], ResponseBuilder]:
    """Relay a colocated decode stream to the end; returns every response written and the builder."""
    sampling = SamplingParams(temperature=0, max_tokens=200, ignore_eos=ignore_eos)
    request = ValidatedRequest("r", tuple(model.tokenizer.encode("Tell me about foxes.")), sampling)
    out = ResponseBuilder(request, model, RequestClock(arrival=time.monotonic()))
    written: list[generate_pb2.GenerateResponse] = []

    async def write(response: generate_pb2.GenerateResponse) -> None:
        written.append(response)

    async def run() -> None:
        stream = WorkerStream("d0", "decode worker d0", ScriptedCall(events, gap_s))
        merger = StreamMerger()
        merger.add(stream)
        if gap_s is None:
            await asyncio.sleep(0.01)  # the reader queues every message before the relay starts
        try:
            await Relay(out, write, stream, stream_interval=stream_interval).run(merger)
        finally:
            merger.close()

    asyncio.run(run())
    return written, out


def deltas(written: list[generate_pb2.GenerateResponse]) -> list[generate_pb2.Delta]:
    return [r.delta for r in written if r.WhichOneof("kind") == "delta"]


def test_batches_that_piled_up_leave_as_one_delta_with_the_same_tokens_text_and_logprobs(
    served_model: ServedModel,
) -> None:
    tokens = served_model.tokenizer.encode(
        " The quick brown fox jumps over the lazy dog again and again.", False
    )
    events = decode_events(tokens, 2, generate_pb2.FINISH_REASON_LENGTH)
    piled, out_piled = relay(served_model, events, gap_s=None)
    kept_up, out_kept = relay(served_model, events, gap_s=0.02)
    assert len(deltas(kept_up)) == len(events) - 1  # one Delta per TokenBatch when the relay keeps up
    assert len(deltas(piled)) == 1  # every batch was waiting: one Delta
    for written in (piled, kept_up):
        assert [t for d in deltas(written) for t in d.token_ids] == tokens
        assert [lp.token_id for d in deltas(written) for lp in d.logprobs] == tokens
    assert "".join(d.text for d in deltas(piled)) == "".join(d.text for d in deltas(kept_up))
    assert out_piled.token_ids == out_kept.token_ids == tokens
    assert out_piled.cached_prompt_tokens == out_kept.cached_prompt_tokens == 4
    assert out_piled.finished and out_kept.finished


def test_a_stop_inside_a_coalesced_run_sends_nothing_after_it(served_model: ServedModel) -> None:
    words = served_model.tokenizer.encode(" one two three", False)
    tokens = [
        *words,
        EOS,
        *words,
    ]  # the engine would stop at EOS; tokens after it must never reach the client
    events = decode_events(tokens, 1, generate_pb2.FINISH_REASON_STOP)
    piled, out = relay(served_model, events, gap_s=None, ignore_eos=False)
    sent = [t for d in deltas(piled) for t in d.token_ids]
    assert sent == [*words, EOS] and out.token_ids == sent
    assert out.finished and out.finish_reason == generate_pb2.FINISH_REASON_STOP


def test_a_stream_interval_gathers_tokens_but_sends_the_first_and_the_last_at_once(
    served_model: ServedModel,
) -> None:
    """RouterConfig.stream_interval 4, one token a step arriving as the steps run: the first token leaves alone
    (time to first token unchanged), then Deltas of 4, then the 2 left over with the finish, and the tokens,
    text and logprobs are those of a relay writing every step."""
    tokens = served_model.tokenizer.encode(
        " The quick brown fox jumps over the lazy dog again and again.", False
    )[:11]
    assert len(tokens) == 11
    events = decode_events(tokens, 1, generate_pb2.FINISH_REASON_LENGTH)
    gathered, out = relay(served_model, events, gap_s=0.005, stream_interval=4)
    every, out_every = relay(served_model, events, gap_s=0.005)
    assert [len(d.token_ids) for d in deltas(gathered)] == [1, 4, 4, 2]
    assert len(deltas(every)) == 11
    assert [t for d in deltas(gathered) for t in d.token_ids] == tokens == out.token_ids
    assert [lp.token_id for d in deltas(gathered) for lp in d.logprobs] == tokens
    assert "".join(d.text for d in deltas(gathered)) == "".join(d.text for d in deltas(every))
    assert out.finished and out.finish_reason == out_every.finish_reason == generate_pb2.FINISH_REASON_LENGTH


def test_a_stop_inside_gathered_tokens_sends_nothing_after_it(served_model: ServedModel) -> None:
    words = served_model.tokenizer.encode(" one two three", False)
    tokens = [*words, EOS, *words]
    events = decode_events(tokens, 1, generate_pb2.FINISH_REASON_STOP)
    gathered, out = relay(served_model, events, gap_s=0.005, ignore_eos=False, stream_interval=3)
    sent = [t for d in deltas(gathered) for t in d.token_ids]
    assert sent == [*words, EOS] and out.token_ids == sent
    assert out.finished and out.finish_reason == generate_pb2.FINISH_REASON_STOP
