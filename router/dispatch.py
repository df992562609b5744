"""One request's life on the workers: place it, run it, relay its tokens, recover from what can be recovered.

Disaggregated (a prefill/decode pair):

    router -> decode   Decode(local_prefill=False)   first event: reserved(KVTarget)    [no room: next worker]
    router -> prefill  Prefill(target)                FirstToken -> Delta at once (TTFT does not wait for KV)
    decode stream      TokenBatch... -> one Delta each; DecodeFinished -> Final

Colocated: one Decode(local_prefill=True) call whose first batch starts with the first token.

Recovery: "no room" (RESOURCE_EXHAUSTED) moves to the next decode worker, then waits with backoff until the
deadline. A worker failing the request moves it to other workers, up to `worker_retries` times: before the
first token it starts afresh; after, it resumes (`_Attempt.worker_input`): the new pair re-prefills prompt + the
tokens the client already has and samples from output index len(sent) on (seeded sampling draws by output index,
so the stream continues exactly), so the client sees no gap and no duplicate. Past the budget: UNAVAILABLE.
Every exit path cancels the worker calls it opened.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from model_runtime.roles import WorkerRole
from router.config import RouterConfig
from router.errors import RouterError
from router.metrics import RouterMetrics
from router.pairs import pair_of
from router.placement import (
    LOCAL_CACHED,
    LOCAL_SHORT,
    LOCAL_SPILL,
    Placement,
    Placer,
    PromptWork,
    WorkerLoad,
    placer_for,
)
from router.pool import Charge, WorkerHandle, WorkerPool
from router.prefix import PromptHashes
from router.relay import Relay, Write
from router.responses import ResponseBuilder
from router.streams import StreamMerger, WorkerCallError, WorkerStream
from router.transport_choice import transport_number
from router.validation import WORKER_PRIORITY, ValidatedRequest, engine_sampling
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
    charges: list[Charge]  # the load this attempt put on its workers, until a poll or the attempt's end
    sent: int = 0  # tokens the client had when this attempt began (> 0: a resume)

    def time_left(self) -> float:
        return max(0.001, self.deadline - asyncio.get_running_loop().time())

    def worker_input(self) -> tuple[list[int], int]:
        """(prompt ids, output_offset) for the workers: a resume sends prompt + the tokens already sent and
        asks for output index `sent` next."""
        return [*self.request.prompt_token_ids, *self.out.token_ids[: self.sent]], self.sent

    def sampling(self) -> worker_pb2.EngineSampling:
        message = engine_sampling(self.request.sampling)
        message.max_tokens -= self.sent  # the tokens already sent count against the request's max_tokens
        if self.sent:  # the prompt's scores went out with the first tokens
            message.ClearField("prompt_logprobs")
        return message


@dataclass
class _Failures:
    """The worker failures of one request so far, and the workers of the attempts they ended."""

    budget: int  # retries allowed (RouterConfig.worker_retries)
    errors: list[WorkerCallError] = field(default_factory=list)
    avoid: dict[str, WorkerRole] = field(default_factory=dict)
    first_at: float | None = None  # loop time of the first failure

    def add(self, exc: WorkerCallError, placement: Placement) -> None:
        # Both workers of the failed pair: which one was at fault is not always knowable (a stalled transfer
        # fails the prefill stream when the decode worker stopped); placement falls back as needed.
        self.errors.append(exc)
        self.avoid[placement.decode] = WorkerRole.DECODE
        if placement.prefill is not None:
            self.avoid[placement.prefill] = WorkerRole.PREFILL
        if self.first_at is None:
            self.first_at = asyncio.get_running_loop().time()

    @property
    def exhausted(self) -> bool:
        return len(self.errors) > self.budget

    def summary(self, sent: int) -> str:
        first, last = self.errors[0], self.errors[-1]
        text = str(first)
        if len(self.errors) > 1:
            text += f"; the retry failed too ({len(self.errors) - 1} retries): {last}"
        text += f"; gave up after {len(self.errors)} attempts (router worker_retries={self.budget})"
        return text + (f", {sent} tokens had been sent" if sent else "")


class Dispatcher:
    def __init__(
        self, pool: WorkerPool, config: RouterConfig, metrics: RouterMetrics, placer: Placer | None = None
    ) -> None:
        self._pool = pool
        self._config = config
        self._metrics = metrics
        self._placer = placer or placer_for(config)
        self._turns = itertools.count()
        self._attempt_ids = itertools.count(1)

    async def run(
        self, request: ValidatedRequest, out: ResponseBuilder, deadline: float, write: Write
    ) -> None:
        """Stream the request's Deltas and its Final through `write`; raise RouterError on failure.
        The caller bounds the whole call by `deadline` (loop time); worker calls get the time that is left."""
        failures = _Failures(self._config.worker_retries)
        full: set[str] = set()  # no room: skipped until the next backoff round
        delay = _BACKOFF_FIRST_S
        prompt = PromptHashes(request.prompt_token_ids)
        while True:
            if len(prompt.token_ids) != len(request.prompt_token_ids) + len(out.token_ids):
                prompt = PromptHashes([*request.prompt_token_ids, *out.token_ids])  # a resume
            # a request that scores its prompt (before its first token) takes nothing from any prefix cache
            work = self._work(
                prompt, cacheable=request.sampling.prompt_logprobs is None or bool(out.token_ids)
            )
            placement, loads = self._place(failures.avoid, full, work)
            if placement is None:
                if not full and not self._may_wait_for_recovery(failures):
                    raise _no_worker(failures.errors, self._placer.unpaired_reason(list(loads.values())))
                await asyncio.sleep(delay)
                delay, full = min(2 * delay, _BACKOFF_MAX_S), set()
                continue
            try:
                await self._attempt(placement, work, loads, request, out, deadline, write)
                return
            except WorkerCallError as exc:
                if exc.code == grpc.StatusCode.CANCELLED:
                    # Only a cancel of ours (the client left, or we stopped) ends a worker call this way:
                    # resuming would start work nobody waits for.
                    raise RouterError(exc.code, f"{exc.worker}: the call was cancelled") from None
                if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED and _passed(deadline):
                    raise RouterError(
                        exc.code, f"the deadline passed while {exc.worker} had the request"
                    ) from None
                self._note_failure(exc, placement, out, failures, full)

    def _work(self, prompt: PromptHashes, cacheable: bool = True) -> PromptWork:
        """The prompt the workers would compute now, and how much of it each worker's prefix cache holds (none
        when not `cacheable`: the engine reads no cache for a request scoring its prompt)."""
        return PromptWork(len(prompt.token_ids), self._pool.cached_tokens(prompt) if cacheable else {})

    def _place(
        self, avoid: dict[str, WorkerRole], full: set[str], work: PromptWork
    ) -> tuple[Placement | None, dict[str, WorkerLoad]]:
        """Placement that prefers workers this request has not failed on: first neither worker of a failed
        pair, then keeping its prefill worker (a decode fault), then its decode worker (a prefill fault), then
        any. Workers that are really gone are not READY (suspect or DEAD) and never placed on. Also returns the
        loads it placed by."""
        loads, turn = self._pool.loads(), next(self._turns)
        by_id = {w.worker_id: w for w in loads}
        decodes = {w for w, role in avoid.items() if role is not WorkerRole.PREFILL}
        prefills = avoid.keys() - decodes
        for exclude in (decodes | prefills, decodes, prefills, set()):
            placement = self._placer.place(loads, work, exclude | full, turn)
            if placement is not None:
                return placement, by_id
        return None, by_id

    def _charge(self, placement: Placement, work: PromptWork, loads: dict[str, WorkerLoad]) -> list[Charge]:
        """Charge the placed work to its workers at once, so the next placement (before the next poll) sees
        it: a running sequence and the prompt's blocks on the decode worker, and the prompt tokens still to
        compute on whichever worker prefills."""
        decode = loads[placement.decode]
        local = placement.prefill is None
        charges = [
            self._pool.charge(
                decode.worker_id,
                running=1,
                kv_blocks=decode.blocks_for(work.num_tokens),
                prefill_tokens=work.uncached_on(decode.worker_id) if local else 0,
            )
        ]
        if placement.prefill is not None:
            tokens = work.uncached_on(placement.prefill)
            charges.append(self._pool.charge(placement.prefill, prefill_tokens=tokens))
        return charges

    def _may_wait_for_recovery(self, failures: _Failures) -> bool:
        """After a failure no pair may be READY for a moment (the failed worker is suspect until its next poll,
        the controller is replacing a dead one): wait up to worker_rpc_timeout_s from the first failure."""
        if failures.first_at is None:
            return False
        return asyncio.get_running_loop().time() < failures.first_at + self._config.worker_rpc_timeout_s

    def _note_failure(
        self,
        exc: WorkerCallError,
        placement: Placement,
        out: ResponseBuilder,
        failures: _Failures,
        full: set[str],
    ) -> None:
        """Record a failed attempt, or raise the client's error when the request cannot go on."""
        log.info("request %s: %s", out.request.request_id, exc)
        if exc.no_room:
            full.add(exc.worker_id)
            self._metrics.request_retried("no_room")
            return
        if exc.rejected:
            raise RouterError(exc.code, f"{exc.worker} rejected the request: {exc.details}")
        self._metrics.worker_failed(exc.worker_id, exc.code.name.lower())
        if exc.unreachable:
            self._pool.report_unreachable(exc.worker_id)
        failures.add(exc, placement)
        if failures.exhausted:
            raise RouterError(grpc.StatusCode.UNAVAILABLE, failures.summary(len(out.token_ids)))
        if out.token_ids:
            log.warning(
                "request %s: resuming after %d tokens: %s", out.request.request_id, len(out.token_ids), exc
            )
        self._metrics.request_retried("resumed" if out.token_ids else "worker_failed")

    async def _attempt(
        self,
        placement: Placement,
        work: PromptWork,
        loads: dict[str, WorkerLoad],
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
            charges=self._charge(placement, work, loads),
            sent=len(out.token_ids),
        )
        self._metrics.placed(placement.reason)
        if placement.reason in (LOCAL_SHORT, LOCAL_CACHED, LOCAL_SPILL):
            log.info(
                "request %s: local prefill on decode worker %s (%s: %d of %d prompt tokens to compute there)",
                attempt.id,
                placement.decode,
                placement.reason,
                work.uncached_on(placement.decode),
                work.num_tokens,
            )
        log.info(
            "attempt %s: decode %s prefill %s, %d tokens sent, ~%d of %d prompt tokens cached there",
            attempt.id,
            placement.decode,
            placement.prefill,
            attempt.sent,
            work.cached_on(placement.prefill or placement.decode),
            work.num_tokens,
        )
        with contextlib.ExitStack() as stack:
            for charge in attempt.charges:
                stack.callback(charge.release)
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
            merger.fail_when(decode, handle.dead, handle.dead_reason)
            relay = Relay(attempt.out, attempt.write, decode, stream_interval=self._config.stream_interval)
            await relay.run(merger)
            await relay.await_streams_end(merger)
            await attempt.write(attempt.out.final())
        finally:
            merger.close()
            decode.cancel()

    async def _run_disaggregated(
        self, decode_handle: WorkerHandle, prefill_handle: WorkerHandle, attempt: _Attempt
    ) -> None:
        pair = pair_of(
            prefill_handle.worker_id,
            decode_handle.worker_id,
            prefill_handle.info,
            decode_handle.info,
            self._placer.transfer_kinds,
        )
        self._metrics.paired(pair.transport, pair.nodes)
        with self._pool.pairs.running(pair):
            await self._disaggregated(decode_handle, prefill_handle, attempt, pair.transport)

    async def _disaggregated(
        self, decode_handle: WorkerHandle, prefill_handle: WorkerHandle, attempt: _Attempt, transport: str
    ) -> None:
        sender_id, p_info, d_info = b"", prefill_handle.info, decode_handle.info
        one_rank_each = p_info is not None and d_info is not None and max(p_info.devices, d_info.devices) <= 1
        if transport == "cuda_ipc" and one_rank_each:  # the decode worker may arm the lease for this sender
            assert p_info is not None
            sender_id = p_info.kv_sender_id
        decode = self._open_decode(
            decode_handle, attempt, local_prefill=False, transport=transport, sender_id=sender_id
        )
        prefill: WorkerStream | None = None
        decode_charge, prefill_charge = attempt.charges
        merger = StreamMerger()
        try:
            target = await self._reserved(decode)
            decode_charge.kv_blocks = target.num_blocks
            attempt.out.clock.started = time.monotonic()
            prefill = self._open_prefill(prefill_handle, attempt, target)
            merger.add(prefill)
            merger.add(decode)
            merger.fail_when(prefill, prefill_handle.dead, prefill_handle.dead_reason)
            merger.fail_when(decode, decode_handle.dead, decode_handle.dead_reason)
            relay = Relay(
                attempt.out, attempt.write, decode, prefill, prefill_charge, self._config.stream_interval
            )
            await relay.run(merger)
            await relay.await_streams_end(merger)
            await attempt.write(attempt.out.final())
        finally:
            merger.close()
            decode.cancel()
            if prefill is not None:
                prefill.cancel()
            prefill_charge.release()

    # --- worker calls ---------------------------------------------------------------------------------
    def _open_decode(
        self,
        handle: WorkerHandle,
        attempt: _Attempt,
        local_prefill: bool,
        transport: str = "",
        sender_id: bytes = b"",
    ) -> WorkerStream:
        """`transport`: the pair's KV transport (router.pairs; "" when the router cannot tell). `sender_id`: the
        prefill worker's KVSender (cuda_ipc pairs of one device each: the decode worker may arm the lease)."""
        prompt, offset = attempt.worker_input()
        message = worker_pb2.DecodeRequest(
            kv_sender_id=sender_id,
            kv_transport=transport_number(transport),
            request_id=attempt.id,
            prompt_token_ids=prompt,
            sampling=attempt.sampling(),
            local_prefill=local_prefill,
            lease_ttl_ms=int(self._config.lease_ttl_s * 1000),
            output_offset=offset,
            priority=WORKER_PRIORITY[attempt.request.priority],
        )
        call = handle.stub.Decode(message, timeout=attempt.time_left())
        kind = "colocated" if local_prefill else "decode"
        return WorkerStream(handle.worker_id, f"{kind} worker {handle.worker_id}", call)

    def _open_prefill(self, handle: WorkerHandle, attempt: _Attempt, target: Any) -> WorkerStream:
        prompt, offset = attempt.worker_input()
        message = worker_pb2.PrefillRequest(
            request_id=attempt.id,
            prompt_token_ids=prompt,
            sampling=attempt.sampling(),
            target=target,
            output_offset=offset,
            priority=WORKER_PRIORITY[attempt.request.priority],
        )
        call = handle.stub.Prefill(message, timeout=attempt.time_left())
        return WorkerStream(handle.worker_id, f"prefill worker {handle.worker_id}", call)

    async def _reserved(self, decode: WorkerStream) -> Any:
        """The decode worker's KVTarget: its first event, due within worker_rpc_timeout_s."""
        limit = self._config.worker_rpc_timeout_s
        try:
            async with asyncio.timeout(limit):  # not wait_for: on 3.11 it can drop a cancel (see pool.py)
                event = await decode.read()
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


def _no_worker(failed: list[WorkerCallError], unpaired: str | None = None) -> RouterError:
    reason = "no worker can take the request now (it needs a READY prefill and decode worker, or a READY "
    reason += "colocated worker)"
    if unpaired:
        reason += f"; no prefill/decode pair has a KV transport in common: {unpaired}"
    if failed:
        reason += f"; {failed[-1]}"
    return RouterError(grpc.StatusCode.UNAVAILABLE, reason)
