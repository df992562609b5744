"""One request's life on the workers: place it, run it, relay its tokens, recover from what can be recovered.

Disaggregated (a prefill/decode pair):

    router -> decode   Decode(local_prefill=False)   first event: reserved(KVTarget)    [no room: next worker]
    router -> prefill  Prefill(target)                FirstToken -> Delta at once (TTFT does not wait for KV)
    decode stream      TokenBatch... -> one Delta each; DecodeFinished -> Final

Colocated: one Decode(local_prefill=True) call whose first batch starts with the first token.

Recovery: "no room" (RESOURCE_EXHAUSTED) moves to the next decode worker, then waits with backoff until the
deadline. A worker failing before the client saw a token is retried once on other workers; after tokens were
sent the client gets ABORTED (generate.proto). `_Attempt.worker_input` is where a resume (re-prefill prompt + the
tokens sent so far, with output_offset) would go. Every exit path cancels the worker calls it opened.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

import grpc

from router.config import RouterConfig
from router.errors import RouterError
from router.metrics import RouterMetrics
from router.placement import Placement, place
from router.pool import Charge, WorkerHandle, WorkerPool
from router.relay import Relay, Write
from router.responses import ResponseBuilder
from router.streams import StreamMerger, WorkerCallError, WorkerStream
from router.validation import ValidatedRequest, engine_sampling
from tandem_api.tandem.v1 import worker_pb2

log = logging.getLogger(__name__)

_BACKOFF_FIRST_S = 0.02
_BACKOFF_MAX_S = 0.5
_DEADLINE_SLACK_S = 0.05


@dataclass
class _Attempt:
    """One try at running the request on one placement."""

    id: str  # the request id the workers see: unique per attempt, since a KV lease is bound to it
    request: ValidatedRequest
    out: ResponseBuilder
    deadline: float  # loop time
    write: Write
    decode_charge: Charge

    def time_left(self) -> float:
        return max(0.001, self.deadline - asyncio.get_running_loop().time())

    def worker_input(self) -> tuple[list[int], int]:
        """(prompt ids, output_offset) for the workers. A resume would send prompt + out.token_ids with
        output_offset len(out.token_ids) (and max_tokens reduced by as much); today attempts start fresh."""
        return list(self.request.prompt_token_ids), 0


class Dispatcher:
    def __init__(self, pool: WorkerPool, config: RouterConfig, metrics: RouterMetrics) -> None:
        self._pool = pool
        self._config = config
        self._metrics = metrics
        self._turns = itertools.count()
        self._attempt_ids = itertools.count(1)

    async def run(
        self, request: ValidatedRequest, out: ResponseBuilder, deadline: float, write: Write
    ) -> None:
        """Stream the request's Deltas and its Final through `write`; raise RouterError on failure.
        The caller bounds the whole call by `deadline` (loop time); worker calls get the time that is left."""
        failed: dict[str, WorkerCallError] = {}  # never retried on for this request
        full: set[str] = set()  # no room: skipped until the next backoff round
        delay = _BACKOFF_FIRST_S
        while True:
            placement = place(self._pool.loads(), failed.keys() | full, next(self._turns))
            if placement is None:
                if not full:
                    raise _no_worker(failed)
                await asyncio.sleep(delay)
                delay, full = min(2 * delay, _BACKOFF_MAX_S), set()
                continue
            try:
                await self._attempt(placement, request, out, deadline, write)
                return
            except WorkerCallError as exc:
                if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED and _passed(deadline):
                    raise RouterError(
                        exc.code, f"the deadline passed while {exc.worker} had the request"
                    ) from None
                self._note_failure(exc, out, failed, full)

    def _note_failure(
        self, exc: WorkerCallError, out: ResponseBuilder, failed: dict[str, WorkerCallError], full: set[str]
    ) -> None:
        """Record a failed attempt, or raise the client's error when the request cannot go on."""
        log.info("request %s: %s", out.request.request_id, exc)
        if exc.no_room and not out.token_ids:
            full.add(exc.worker_id)
            self._metrics.request_retried("no_room")
            return
        if exc.rejected:
            raise RouterError(exc.code, f"{exc.worker} rejected the request: {exc.details}")
        self._metrics.worker_failed(exc.worker_id, exc.code.name.lower())
        if exc.unreachable:
            self._pool.report_unreachable(exc.worker_id)
        if out.token_ids:
            raise RouterError(
                grpc.StatusCode.ABORTED,
                f"{exc} after {len(out.token_ids)} tokens were sent; the request cannot be resumed",
            )
        if failed:
            first = next(iter(failed.values()))
            raise RouterError(grpc.StatusCode.UNAVAILABLE, f"{first}; the retry failed too: {exc}")
        failed[exc.worker_id] = exc
        self._metrics.request_retried("worker_failed")

    async def _attempt(
        self,
        placement: Placement,
        request: ValidatedRequest,
        out: ResponseBuilder,
        deadline: float,
        write: Write,
    ) -> None:
        decode = self._handle(placement.decode)
        prefill = None if placement.prefill is None else self._handle(placement.prefill)
        attempt = _Attempt(
            id=f"{request.request_id}#{next(self._attempt_ids)}",
            request=request,
            out=out,
            deadline=deadline,
            write=write,
            decode_charge=self._pool.charge(decode.worker_id, running=1),
        )
        with contextlib.ExitStack() as stack:
            stack.callback(attempt.decode_charge.release)
            for handle in (decode, prefill):
                if handle is not None:
                    stack.enter_context(handle.in_use())
            if prefill is None:
                await self._run_colocated(decode, attempt)
            else:
                await self._run_disaggregated(decode, prefill, attempt)

    def _handle(self, worker_id: str) -> WorkerHandle:
        handle = self._pool.get(worker_id)
        if handle is None:  # placement read this membership a moment ago, with no await in between
            raise RuntimeError(f"worker {worker_id} left the membership during placement")
        return handle

    async def _run_colocated(self, handle: WorkerHandle, attempt: _Attempt) -> None:
        decode = self._open_decode(handle, attempt, local_prefill=True)
        attempt.out.clock.started = time.monotonic()
        merger = StreamMerger()
        try:
            merger.add(decode)
            relay = Relay(attempt.out, attempt.write, decode)
            await relay.run(merger)
            await relay.await_streams_end(merger)
            await attempt.write(attempt.out.final())
        finally:
            merger.close()
            decode.cancel()

    async def _run_disaggregated(
        self, decode_handle: WorkerHandle, prefill_handle: WorkerHandle, attempt: _Attempt
    ) -> None:
        decode = self._open_decode(decode_handle, attempt, local_prefill=False)
        prefill: WorkerStream | None = None
        prefill_charge = None
        merger = StreamMerger()
        try:
            target = await self._reserved(decode)
            attempt.decode_charge.kv_blocks = target.num_blocks
            attempt.out.clock.started = time.monotonic()
            prefill = self._open_prefill(prefill_handle, attempt, target)
            prompt_tokens = len(attempt.request.prompt_token_ids)
            prefill_charge = self._pool.charge(prefill_handle.worker_id, prefill_tokens=prompt_tokens)
            merger.add(prefill)
            merger.add(decode)
            relay = Relay(attempt.out, attempt.write, decode, prefill, prefill_charge)
            await relay.run(merger)
            await relay.await_streams_end(merger)
            await attempt.write(attempt.out.final())
        finally:
            merger.close()
            decode.cancel()
            if prefill is not None:
                prefill.cancel()
            if prefill_charge is not None:
                prefill_charge.release()

    # --- worker calls ---------------------------------------------------------------------------------
    def _open_decode(self, handle: WorkerHandle, attempt: _Attempt, local_prefill: bool) -> WorkerStream:
        prompt, offset = attempt.worker_input()
        message = worker_pb2.DecodeRequest(
            request_id=attempt.id,
            prompt_token_ids=prompt,
            sampling=engine_sampling(attempt.request.sampling),
            local_prefill=local_prefill,
            lease_ttl_ms=int(self._config.lease_ttl_s * 1000),
            output_offset=offset,
        )
        call = handle.stub.Decode(message, timeout=attempt.time_left())
        kind = "colocated" if local_prefill else "decode"
        return WorkerStream(handle.worker_id, f"{kind} worker {handle.worker_id}", call)

    def _open_prefill(self, handle: WorkerHandle, attempt: _Attempt, target: Any) -> WorkerStream:
        prompt, offset = attempt.worker_input()
        message = worker_pb2.PrefillRequest(
            request_id=attempt.id,
            prompt_token_ids=prompt,
            sampling=engine_sampling(attempt.request.sampling),
            target=target,
            output_offset=offset,
        )
        call = handle.stub.Prefill(message, timeout=attempt.time_left())
        return WorkerStream(handle.worker_id, f"prefill worker {handle.worker_id}", call)

    async def _reserved(self, decode: WorkerStream) -> Any:
        """The decode worker's KVTarget: its first event, due within worker_rpc_timeout_s."""
        limit = self._config.worker_rpc_timeout_s
        try:
            event = await asyncio.wait_for(decode.read(), limit)
        except TimeoutError:
            raise decode.error(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"no KV reservation within {limit:g} s"
            ) from None
        if event is None or event.WhichOneof("kind") != "reserved":
            what = "closed the stream" if event is None else f"sent {event.WhichOneof('kind')}"
            raise decode.error(grpc.StatusCode.INTERNAL, f"{what} instead of reserving KV blocks")
        return event.reserved


def _passed(deadline: float) -> bool:
    """True once the request's deadline is (within a hair) reached: a worker call that timed out then did so
    because the request's time ran out, not because the worker failed."""
    return asyncio.get_running_loop().time() >= deadline - _DEADLINE_SLACK_S


def _no_worker(failed: dict[str, WorkerCallError]) -> RouterError:
    reason = "no worker can take the request now (it needs a READY prefill and decode worker, or a READY "
    reason += "colocated worker)"
    if failed:
        reason += f"; {next(iter(failed.values()))}"
    return RouterError(grpc.StatusCode.UNAVAILABLE, reason)
