"""The decode worker's gRPC service: reserve KV room, admit requests whose KV landed, stream their tokens.

One Decode call is one request's whole life on this worker:

    remote prefill:  reserve blocks (lease) -> yield `reserved` (KVTarget) -> wait for the KV to land
                     -> admit into continuous batching with prefill's first token -> yield token batches
    local prefill:   add the prompt to the engine (colocated mode, recovery) -> yield token batches

However the call ends (finished, client cancel, deadline, router decision, failure) the request's blocks and
its lease are released: the `finally` below is the single exit path.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass

import grpc

from kv_transfer import KVReceiver, Lease, NoRoom, TransferResult
from kv_transfer.pairing import TRANSPORT_FROM_PROTO
from model_runtime.engine import Engine, InvalidRequest, StepOutput
from model_runtime.engine_loop import EngineLoop
from model_runtime.request import SamplingError, SamplingParams
from tandem_api.tandem.v1 import admin_pb2, kv_pb2, worker_pb2, worker_pb2_grpc
from worker_host.convert import (
    FINISH_REASONS,
    logprob_proto,
    priority_from_proto,
    prompt_logprobs_proto,
    sampling_from_proto,
)
from worker_host.host import OpenCalls, take_blocks
from worker_host.node import WorkerNode
from worker_host.rank_agents import ShardedReceiver
from worker_host.rpc import CallEnded, wait_for, worker_info

log = logging.getLogger(__name__)
# Step outputs of one request that one TokenBatch may carry when its stream fell behind (coalesce).
MAX_COALESCED = 64


def token_batch(out: StepOutput, prompt: list[int]) -> worker_pb2.TokenBatch:
    lps = [logprob_proto(t, lp) for t, lp in zip(out.token_ids, out.logprobs or [])]
    return worker_pb2.TokenBatch(
        token_ids=out.token_ids,
        logprobs=lps,
        num_cached_tokens=out.num_cached_tokens,
        prompt_logprobs=prompt_logprobs_proto(prompt, out.prompt_logprobs),
    )


def finished_event(out: StepOutput) -> worker_pb2.DecodeEvent:
    """`num_cached_tokens`: the prompt tokens this engine took from its prefix cache (local prefill)."""
    done = worker_pb2.DecodeFinished(
        finish_reason=FINISH_REASONS[out.finish_reason or "abort"], num_cached_tokens=out.num_cached_tokens
    )
    if isinstance(out.stop_reason, int):
        done.stop_token_id = out.stop_reason
    return worker_pb2.DecodeEvent(finished=done)


def coalesce(out: StepOutput, outputs: queue.Queue, limit: int = MAX_COALESCED) -> StepOutput:
    """`out` and the outputs of later steps already waiting in `outputs`, as one output (at most `limit` steps).

    A stream that keeps up sends one TokenBatch a step; one that falls behind (the router reads slowly, or this
    handler thread waited for the interpreter lock) sends what piled up in one message instead of one each, so
    that its per-message cost shrinks as the load grows instead of holding tokens back further."""
    if out.finish_reason is not None:
        return out
    merged = [out]
    while len(merged) < limit:
        try:
            later = outputs.get_nowait()
        except queue.Empty:
            break
        merged.append(later)
        if later.finish_reason is not None:  # the request's last output: nothing follows it
            break
    if len(merged) == 1:
        return out
    last = merged[-1]
    logprobs = None if out.logprobs is None else [lp for o in merged for lp in o.logprobs or []]
    return dataclasses.replace(
        last,
        token_ids=[t for o in merged for t in o.token_ids],
        text="".join(o.text for o in merged),
        logprobs=logprobs,
        prompt_logprobs=out.prompt_logprobs,  # the first output's: later ones have none
    )


Admitted = tuple[float, StepOutput | None]  # when the engine took the request; its output if that ended it


@dataclass
class KVWait:
    """A Decode call waiting for its KV, as the receiver's callback sees it. `admit(engine, result)` (set before
    the lease is handed out) admits the request from its landed blocks: the receive thread queues it on the
    engine loop itself, so the engine takes the request at its next step boundary without waiting for this
    call's thread to wake up first. `results` gets (transfer result, admission) pairs."""

    results: queue.Queue[tuple[TransferResult, Future[Admitted] | None]]
    admit: Callable[[Engine, TransferResult], Admitted] | None = None
    admitted_at: float = 0.0  # time.monotonic() when the engine held the request (0: not admitted from KV)
    first_output_at: float = 0.0  # when the engine emitted the request's first output (its subscriber)


def timed_subscriber(put: Callable[[StepOutput], None], wait: KVWait) -> Callable[[StepOutput], None]:
    """`put`, noting when the first output came (on the engine thread), for the first_step phase."""

    def deliver(out: StepOutput) -> None:
        if not wait.first_output_at:
            wait.first_output_at = time.monotonic()
        put(out)

    return deliver


class DecodeService(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(
        self,
        worker_id: str,
        loop: EngineLoop,
        receiver: KVReceiver | ShardedReceiver | None,
        role: admin_pb2.WorkerRole,
        kv_wait_timeout_s: float = 60.0,
    ) -> None:
        self.worker_id = worker_id
        self.loop = loop
        self.receiver = receiver
        self.role = role
        self.kv_wait_timeout_s = kv_wait_timeout_s
        self.address = ""
        self.node: WorkerNode | None = None  # where it runs, its KV transports: set by start() before serving
        self.draining = threading.Event()
        self.open_calls = OpenCalls()  # drain waits until none is open
        self._landed: dict[str, KVWait] = {}
        self._lock = threading.Lock()

    # --- kv_transfer callback (receiver thread) --------------------------------------------------------
    def on_transfer_result(self, result: TransferResult) -> None:
        admitted = None
        with self._lock:  # atomic with _cleanup's pop: an admission queued here is ahead of the call's end()
            waiter = self._landed.get(result.request_id)
            if waiter is not None and result.ok and waiter.admit is not None:
                admit = waiter.admit
                admitted = self.loop.submit(lambda engine: admit(engine, result))
        if waiter is not None:
            waiter.results.put((result, admitted))
        elif result.ok:  # nobody waits any more (the call ended): the landed blocks are ours to free
            self._release(result.lease.block_ids)

    # --- RPCs ------------------------------------------------------------------------------------------
    def Decode(self, request: worker_pb2.DecodeRequest, context: grpc.ServicerContext) -> Iterator:
        with self.open_calls.track():
            yield from self._decode(request, context)

    def _decode(self, request: worker_pb2.DecodeRequest, context: grpc.ServicerContext) -> Iterator:
        rid = request.request_id
        if self.draining.is_set():
            context.abort(grpc.StatusCode.UNAVAILABLE, f"decode worker {self.worker_id} is draining")
        try:
            sampling = sampling_from_proto(request.sampling)
        except SamplingError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        prompt = list(request.prompt_token_ids)
        outputs: queue.Queue[StepOutput] = queue.Queue()
        landed = KVWait(queue.Queue())
        self.loop.subscribe(
            rid, outputs.put if request.local_prefill else timed_subscriber(outputs.put, landed)
        )
        with self._lock:
            self._landed[rid] = landed
        try:
            if request.local_prefill:
                self._add_local(rid, prompt, sampling, request, context)
            else:
                finished = yield from self._receive_kv(request, prompt, sampling, landed, context)
                if finished is not None:
                    yield worker_pb2.DecodeEvent(finished=finished)
                    return
            yield from self._stream(rid, prompt, outputs, context, landed)
        except CallEnded:
            return
        finally:
            self._cleanup(rid)

    def _receive_kv(self, request, prompt, sampling, landed, context):
        """Reserve, hand out the target, wait for the KV, admit the request. Returns DecodeFinished when the
        first token already ended it, else None."""
        rid = request.request_id
        assert self.receiver is not None, "remote prefill needs a KV receiver"
        held = self.receiver.transports
        wanted = request.kv_transport
        transport = None  # unspecified (a router without transfer.kinds): the receiver's first
        if wanted != kv_pb2.KV_TRANSPORT_UNSPECIFIED:
            transport = TRANSPORT_FROM_PROTO.get(wanted, f"transport {wanted}")
            if transport not in held:
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"kv_transport: the router chose {transport} for this pair; decode worker "
                    f"{self.worker_id}'s KV receiver holds {', '.join(held)} (do the router's and the workers' "
                    "transfer.kinds differ?)",
                )
        ttl = request.lease_ttl_ms / 1000 if request.lease_ttl_ms else None
        landed.admit = self._admission(request, prompt, sampling, landed)
        try:
            lease = self._reserve(rid, prompt, sampling, ttl, transport, bytes(request.kv_sender_id))
        except NoRoom as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"decode worker {self.worker_id}: {exc}")
        except ValueError as exc:  # InvalidRequest (the engine's rules) or the lease table's own checks
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        yield worker_pb2.DecodeEvent(reserved=self.receiver.target(lease))
        # The lease is renewed while this call waits (prefill may be queued for a while); kv_wait_timeout_s
        # bounds the whole wait, and a transfer that began but stalls still ends within one lease TTL.
        deadline = time.monotonic() + max(ttl or 0.0, self.kv_wait_timeout_s) + 5.0
        receiver = self.receiver
        result, admitted = wait_for(
            landed.results, context, self.loop, deadline, "the KV handoff", lambda: receiver.renew(rid)
        )
        if not result.ok:
            context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"KV transfer for {rid} failed: {result.failure.name if result.failure else '?'}: "
                f"{result.message}",
            )
        assert admitted is not None, "a landed result comes with its admission"
        taken_at, done = self.loop.wait(admitted)
        receiver.record_phase("admit", taken_at - (result.landed_at or taken_at))  # landed -> in the engine
        receiver.record_phase("admit_cpu", landed.admitted_at - taken_at)  # Engine.add_prefilled itself
        return finished_event(done).finished if done is not None else None

    def _admission(
        self,
        request: worker_pb2.DecodeRequest,
        prompt: list[int],
        sampling: SamplingParams,
        wait: KVWait,
    ) -> Callable[[Engine, TransferResult], Admitted]:
        """For KVWait.admit: on the engine thread, between two steps, admit the request from a landed result
        with prefill's first token. Its blocks are the engine's from then on; if the admission fails they go
        back to the pool at once. Sets wait.admitted_at once the engine holds the request."""
        rid, offset = request.request_id, request.output_offset
        priority = priority_from_proto(request.priority)

        def admit(engine: Engine, result: TransferResult) -> Admitted:
            taken_at = time.monotonic()
            ft = result.first_token
            assert ft is not None
            first_lp = (ft.logprob, list(ft.top_logprobs)) if ft.logprob is not None else None
            blocks = result.lease.block_ids
            try:
                done = engine.add_prefilled(
                    rid, prompt, sampling, blocks, ft.token_id, first_lp, offset, priority
                )
            except BaseException:
                engine.release_blocks(blocks)
                raise
            wait.admitted_at = time.monotonic()
            return taken_at, done

        return admit

    def _reserve(
        self,
        rid: str,
        prompt: list[int],
        sampling: SamplingParams,
        ttl: float | None,
        transport: str | None = None,
        sender: bytes = b"",
    ) -> Lease:
        """The request checked and its blocks taken in one call onto the engine thread (each call may wait a
        step). Not inside EngineLoop.call itself: the receiver's reserve() takes the lease table first (lock
        order: receiver, then engine)."""
        assert self.receiver is not None, "remote prefill needs a KV receiver"
        loop = self.loop

        def allocate(num_blocks: int) -> list[int] | None:
            def check_and_take(engine: Engine) -> list[int] | None:
                engine.validate(prompt, sampling)
                return take_blocks(engine, num_blocks)

            return loop.call(check_and_take)

        if sender and isinstance(self.receiver, KVReceiver):  # one rank: the lease may be armed
            return self.receiver.reserve(rid, len(prompt), ttl, allocate, transport, sender=sender)
        return self.receiver.reserve(rid, len(prompt), ttl, allocate, transport)

    def _add_local(
        self,
        rid: str,
        prompt: list[int],
        sampling: SamplingParams,
        request: worker_pb2.DecodeRequest,
        context: grpc.ServicerContext,
    ) -> None:
        """Colocated: check and queue the prompt in one engine-thread call."""
        offset, priority = request.output_offset, priority_from_proto(request.priority)
        arrived = time.monotonic()  # the wait for the engine thread counts as the prompt's waiting time
        try:
            self.loop.call(lambda e: e.add_request(rid, prompt, sampling, offset, priority, arrived))
        except InvalidRequest as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    def _stream(
        self, rid: str, prompt: list[int], outputs: queue.Queue, context: grpc.ServicerContext, landed: KVWait
    ) -> Iterator:
        while True:
            out = coalesce(wait_for(outputs, context, self.loop, float("inf"), "tokens"), outputs)
            if not context.is_active():  # tokens keep coming while the caller is gone: stop at once
                raise CallEnded()
            if landed.admitted_at and self.receiver is not None:
                self._record_first_output(landed)
            yield worker_pb2.DecodeEvent(tokens=token_batch(out, prompt))
            if out.finish_reason is not None:
                yield finished_event(out)
                return

    def _record_first_output(self, landed: KVWait) -> None:
        """A request admitted from landed KV sends its first tokens: first_step (admitted -> the engine
        emitted its first output) and first_out (emitted -> this thread sends it), the parts of a client's
        first-to-second token gap after `admit` and `admit_cpu`."""
        assert self.receiver is not None
        now = time.monotonic()
        emitted = landed.first_output_at or now
        self.receiver.record_phase("first_step", emitted - landed.admitted_at)
        self.receiver.record_phase("first_out", now - emitted)
        landed.admitted_at = 0.0  # once

    def _cleanup(self, rid: str) -> None:
        """The one exit path: forget the waiters, abort the request, release a lease that never landed."""
        with self._lock:
            waiter = self._landed.pop(rid, None)
        # After the pop: an admission the receive thread queued before it runs before this end() and is
        # aborted by it (its blocks go back with the request); KV landing later finds no waiter and is freed.
        self.loop.end(rid)
        while waiter is not None and not waiter.results.empty():  # landed after the handler stopped listening
            late, admitted = waiter.results.get()
            if late.ok and admitted is None:
                self._release(late.lease.block_ids)
        if self.receiver is not None:
            self.receiver.abort(rid, "the decode call ended")

    def _release(self, block_ids: tuple[int, ...]) -> None:
        self.loop.call(lambda e: e.release_blocks(block_ids))

    def Status(self, request, context) -> admin_pb2.WorkerInfo:
        leases = self.receiver.stats().active_leases if self.receiver is not None else 0
        return worker_info(
            self.loop,
            worker_id=self.worker_id,
            role=self.role,
            address=self.address,
            draining=self.draining.is_set(),
            active_leases=leases,
            known_prefix_version=request.known_prefix_version,
            node=self.node,
        )
