"""Relaying one attempt: the worker streams' events in, the client's Delta messages out.

    prefill stream   FirstToken ........................ TransferDone   (EOF)
    decode stream            (reserved, read earlier)  TokenBatch ... DecodeFinished   (EOF)

The two streams are not ordered with each other: a decode event that overtakes the prefill's first token is
held until that token has been sent, so the client always sees tokens in order. A failed stream raises
WorkerCallError, except a prefill stream failing once the KV has landed (the decode stream carries on).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from router.pool import Charge
from router.responses import ResponseBuilder
from router.streams import StreamItem, StreamMerger, WorkerStream
from tandem_api.tandem.v1 import generate_pb2

Write = Callable[[generate_pb2.GenerateResponse], Awaitable[None]]

_FINISH_REASONS = (
    generate_pb2.FINISH_REASON_STOP,
    generate_pb2.FINISH_REASON_LENGTH,
    generate_pb2.FINISH_REASON_ABORT,
)
# How long a finished request waits for worker streams that are ending anyway (Relay.await_streams_end).
FINISH_GRACE_S = 0.2
# TokenBatches one Delta may carry when the relay fell behind its decode stream (Relay._tokens_ready).
MAX_COALESCED = 64


class Relay:
    def __init__(
        self,
        out: ResponseBuilder,
        write: Write,
        decode: WorkerStream,
        prefill: WorkerStream | None = None,
        prefill_charge: Charge | None = None,
        stream_interval: int = 1,
    ) -> None:
        self.out = out
        # RouterConfig.stream_interval: decode tokens are gathered until this many are pending (_on_tokens)
        self._stream_interval = stream_interval
        self._pending: list[Any] = []  # TokenBatches not yet written to the client
        self._pending_tokens = 0
        self._write = write
        self._decode = decode
        # prefill None: colocated, the decode worker's first batch starts with the first token.
        self._prefill = prefill
        self._prefill_charge = prefill_charge
        self._first_token_seen = prefill is None
        self._decode_tokens_seen = False
        self._decode_finished_seen = False
        self._transfer_done = False
        self._first_token_finished = False
        self._held: list[Any] = []  # decode events that overtook the prefill's first token

    async def run(self, merger: StreamMerger) -> None:
        """Relay until the request is finished (by the router's rules or a worker's)."""
        while not self.out.finished:
            item = await merger.get()
            if item.error is not None:
                if item.source is self._prefill and (self._transfer_done or self._decode_tokens_seen):
                    continue  # the KV has landed: the decode stream carries the request from here
                raise item.error
            if item.source is self._decode:
                await self._on_decode(item, merger)
            else:
                await self._on_prefill(item)

    async def _on_prefill(self, item: StreamItem) -> None:
        message: Any = item.message
        kind = None if message is None else message.WhichOneof("kind")
        if kind == "transfer_done":
            self._transfer_done = True
        elif kind == "first_token" and not self._first_token_seen:
            await self._on_first_token(message.first_token, item.source)
        elif kind is not None or not self._first_token_seen:
            what = "closed the stream" if kind is None else f"sent an unexpected {kind!r}"
            raise item.source.error(
                grpc.StatusCode.INTERNAL, f"{what} (protocol: FirstToken, then TransferDone)"
            )

    async def _on_first_token(self, first: Any, source: WorkerStream) -> None:
        if self._prefill_charge is not None:
            self._prefill_charge.release()  # the prompt is computed: no longer queued on that worker
        self._first_token_seen = True
        reason = first.finish_reason
        if reason not in (generate_pb2.FINISH_REASON_UNSPECIFIED, *_FINISH_REASONS):
            raise source.error(grpc.StatusCode.INTERNAL, f"sent a first token with finish reason {reason}")
        self._first_token_finished = reason != generate_pb2.FINISH_REASON_UNSPECIFIED
        out = self.out
        out.cached_prompt_tokens = first.num_cached_tokens
        logprob = [first.logprob] if first.HasField("logprob") else []
        await self._write(out.add([first.token_id], logprob, first.prompt_logprobs))
        if self._first_token_finished and not out.finished:  # the worker's rules ended it, ours did not
            stop = first.stop_token_id if first.HasField("stop_token_id") else None
            await self._write_if(out.end(reason, stop))
        held, self._held = self._held, []
        for message in held:
            if out.finished:
                break
            await self._on_decode_event(message)

    async def _on_decode(self, item: StreamItem, merger: StreamMerger) -> None:
        message = item.message
        if message is None:
            if self._decode_finished_seen:
                return  # its DecodeFinished is held until the first token arrives
            raise self._decode.error(
                grpc.StatusCode.INTERNAL, "closed the stream before the request finished"
            )
        kind = message.WhichOneof("kind")
        self._decode_tokens_seen |= kind == "tokens"
        self._decode_finished_seen |= kind == "finished"
        if not self._first_token_seen:
            self._held.append(message)
            return
        if kind == "tokens":
            await self._on_tokens([message.tokens, *self._tokens_ready(merger)])
            return
        await self._on_decode_event(message)

    def _tokens_ready(self, merger: StreamMerger) -> list[Any]:
        """The decode stream's TokenBatches already queued right behind the one being relayed (never waits;
        stops at anything else, which stays first in line). A relay that keeps up finds none and writes one
        Delta per batch; one that fell behind writes what piled up as one Delta, so that its cost per token
        falls as the load grows instead of its queue growing."""
        batches: list[Any] = []
        while len(batches) < MAX_COALESCED - 1:
            item = merger.ready()
            if item is None:
                break
            message = item.message
            kind = None if message is None else message.WhichOneof("kind")
            if (
                message is None
                or item.source is not self._decode
                or item.error is not None
                or kind != "tokens"
            ):
                merger.give_back(item)
                break
            self._decode_tokens_seen = True
            batches.append(message.tokens)
        return batches

    async def _on_tokens(self, batches: list[Any]) -> None:
        """One Delta for TokenBatches of consecutive steps, once stream_interval tokens are pending (at once
        for the request's first token)."""
        self._pending.extend(batches)
        self._pending_tokens += sum(len(b.token_ids) for b in batches)
        if self._pending_tokens >= self._stream_interval or not self.out.token_ids:
            await self._flush()

    async def _flush(self) -> None:
        """Write the pending TokenBatches as one Delta (nothing when none are pending)."""
        batches, self._pending, self._pending_tokens = self._pending, [], 0
        if not batches:
            return
        if self._prefill is None:  # this worker computed the prompt: its engine's prefix-cache hit
            self.out.cached_prompt_tokens = batches[0].num_cached_tokens
        if len(batches) == 1:
            token_ids, logprobs = batches[0].token_ids, batches[0].logprobs
        else:
            token_ids = [t for b in batches for t in b.token_ids]
            logprobs = [lp for b in batches for lp in b.logprobs]
        await self._write(self.out.add(token_ids, logprobs, batches[0].prompt_logprobs))

    async def _on_decode_event(self, message: Any) -> None:
        kind = message.WhichOneof("kind")
        if kind == "tokens":
            await self._on_tokens([message.tokens])
            return
        done = message.finished
        await self._flush()  # the tokens before the end, whatever their number
        if self.out.finished:
            return  # the router's own rules ended it within those tokens
        if kind != "finished" or done.finish_reason not in _FINISH_REASONS:
            problem = f"finish reason {done.finish_reason}" if kind == "finished" else f"event {kind!r}"
            raise self._decode.error(grpc.StatusCode.INTERNAL, f"sent an unexpected {problem}")
        stop = done.stop_token_id if done.HasField("stop_token_id") else None
        await self._write_if(self.out.end(done.finish_reason, stop))

    async def _write_if(self, response: generate_pb2.GenerateResponse | None) -> None:
        if response is not None:
            await self._write(response)

    async def await_streams_end(self, merger: StreamMerger) -> None:
        """Once the request is finished, let worker streams that are ending anyway end on their own (a cancel
        reaching a worker that is wrapping up makes it log an abort for nothing); the caller cancels whatever is
        still open after this short, bounded wait."""
        pending = {s for s in self._ending_streams() if not s.ended}
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(FINISH_GRACE_S):
                while pending:
                    item = await merger.get()
                    if item.error is not None or item.message is None:
                        pending.discard(item.source)

    def _ending_streams(self) -> list[WorkerStream]:
        """The streams that end by themselves now: none after a stop string (workers do not know it); the
        decode stream once it generated (it stops on the same token rules); the prefill stream once it shipped
        the KV or said its first token was the last."""
        if self.out.stopped_by_string:
            return []
        streams = []
        if self._prefill is None or self._decode_tokens_seen:
            streams.append(self._decode)
        if self._prefill is not None and (self._transfer_done or self._first_token_finished):
            streams.append(self._prefill)
        return streams
