"""The prefill worker's gRPC service: compute the prompt, stream the first token at once, ship the KV.

One Prefill call:
    add the prompt to the engine (batched with other prompts, chunked under the token budget)
    -> during the step that completes the prompt, ship each group of layers as soon as it is written
       (transfer.layer_groups > 0: LayerSend; the transfer overlaps the rest of the forward pass)
    -> first token sampled: finish the transfer with it on the engine thread, in the same pass that emits it
       (LayerSend.first_token: KVDone leaves while this call's thread is still waking up), then yield
       FirstToken (time to first token does not wait for the transfer). With layer_groups 0, or when no layer
       was streamed, this call hands all the blocks to the sender first and then yields the token. The sender
       frees what it holds on ack, abort or deadline
    -> yield TransferDone, or fail the call with the transfer's reason

Block ownership: engine (prompt running) -> this call (first token sampled, blocks detached) -> KV sender
(send started) -> free. A transfer that starts during the prompt's last step holds its own reference on the
blocks (taken by the engine, given back by the sender's on_release), so this call keeps and frees its own.
The `finally` releases whatever this call still owns, however it ends.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from kv_transfer import FirstToken, KVSender, SendHandle
from kv_transfer.sharded import splits
from model_runtime.engine import Engine, InvalidRequest, StepOutput
from model_runtime.engine_loop import EngineLoop
from model_runtime.request import SamplingError
from model_runtime.scheduler import RequestRejected
from tandem_api.tandem.v1 import admin_pb2, kv_pb2, worker_pb2, worker_pb2_grpc
from worker_host.convert import (
    FINISH_REASONS,
    logprob_proto,
    priority_from_proto,
    prompt_logprobs_proto,
    sampling_from_proto,
)
from worker_host.host import OpenCalls
from worker_host.node import WorkerNode
from worker_host.rank_agents import ShardedSender, ShardedSendHandle
from worker_host.rpc import POLL_S, CallEnded, wait_for, worker_info

log = logging.getLogger(__name__)


class PrefillService(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(
        self,
        worker_id: str,
        loop: EngineLoop,
        sender: KVSender | ShardedSender,
        prefill_timeout_s: float = 600.0,
        layer_groups: int = 0,
        split: ShardedSender | None = None,
    ) -> None:
        """`split`: how a worker of one rank sends to a decode worker that holds other heads (one of several
        ranks): a transfer per decode rank, after the prompt's step (kv_transfer.sharded.splits)."""
        self.worker_id = worker_id
        self.loop = loop
        self.sender = sender
        self.split = split
        self.prefill_timeout_s = prefill_timeout_s
        self.layer_groups = layer_groups  # transfer.layer_groups: 0 ships the KV after the first token
        self.address = ""
        self.node: WorkerNode | None = None  # where it runs, its KV transports: set by start() before serving
        self.draining = threading.Event()
        self.open_calls = OpenCalls()  # drain waits until none is open

    def Prefill(self, request: worker_pb2.PrefillRequest, context: grpc.ServicerContext) -> Iterator:
        with self.open_calls.track():
            yield from self._prefill(request, context)

    def _prefill(self, request: worker_pb2.PrefillRequest, context: grpc.ServicerContext) -> Iterator:
        rid = request.request_id
        if self.draining.is_set():
            context.abort(grpc.StatusCode.UNAVAILABLE, f"prefill worker {self.worker_id} is draining")
        prompt = list(request.prompt_token_ids)
        try:
            sampling = sampling_from_proto(request.sampling)
        except SamplingError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        outputs: queue.Queue[StepOutput] = queue.Queue()
        held: tuple[int, ...] = ()  # blocks this call owns (between the first token and the send)
        sender = self.sender
        if (
            self.split is not None
            and request.HasField("target")
            and splits(request.target, self.split.layout)
        ):
            sender = self.split  # one transfer per decode rank; no layer streaming
        streams = self.layer_groups if sender is not self.split else 0
        streamed = LayerSend(sender, request.target) if request.HasField("target") else None
        self.loop.subscribe(rid, outputs.put if streamed is None else streamed.deliver_to(outputs.put))
        try:
            try:
                offset, priority = request.output_offset, priority_from_proto(request.priority)
                arrived = time.monotonic()  # the wait for the engine thread counts as waiting time

                def add(engine: Engine) -> None:
                    engine.add_request(rid, prompt, sampling, offset, priority, arrived)
                    if streamed is not None and streams:
                        engine.stream_layers(rid, streamed, streams)

                self.loop.call(add)
            except (InvalidRequest, RequestRejected, SamplingError) as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            out = wait_for(
                outputs, context, self.loop, time.monotonic() + self.prefill_timeout_s, "the prompt"
            )
            held = out.kv_block_ids
            handle: SendHandle | ShardedSendHandle | None = None
            if out.finish_reason is None and streamed is not None:
                handle = streamed.handle
                if handle is None:  # nothing streamed: all the blocks go now, before the token's own write
                    handle = sender.send(request.target, held, out.num_prompt_tokens, _kv_first_token(out))
                    held = ()  # the sender owns them now and frees them through on_release
                elif not streamed.finished:  # the engine thread could not finish it: say why here
                    handle.finish(_kv_first_token(out))
            yield worker_pb2.PrefillEvent(first_token=self._first_token(out, prompt))
            if handle is None:
                return
            yield from self._await_transfer(handle, context)
        except CallEnded:
            return
        finally:
            self.loop.end(rid)  # from here the engine no longer calls `streamed`
            if streamed is not None and streamed.handle is not None and not streamed.handle.done():
                streamed.handle.abort("the prefill call ended before the transfer")  # no-op once finished
            # The call may end right after the engine detached the prompt's blocks and queued its output,
            # before this handler read it: those blocks are ours too.
            while not outputs.empty():
                held += outputs.get_nowait().kv_block_ids
            if held:
                self.loop.call(lambda e: e.release_blocks(held))

    def _first_token(self, out: StepOutput, prompt: list[int]) -> worker_pb2.FirstToken:
        token = out.token_ids[0]
        msg = worker_pb2.FirstToken(
            token_id=token,
            num_cached_tokens=out.num_cached_tokens,
            prompt_logprobs=prompt_logprobs_proto(prompt, out.prompt_logprobs),
        )
        if out.finish_reason is not None:
            msg.finish_reason = FINISH_REASONS[out.finish_reason]
            if isinstance(out.stop_reason, int):
                msg.stop_token_id = out.stop_reason
        if out.logprobs:
            msg.logprob.CopyFrom(logprob_proto(token, out.logprobs[0]))
        return msg

    def _await_transfer(
        self, handle: SendHandle | ShardedSendHandle, context: grpc.ServicerContext
    ) -> Iterator:
        while not handle.done():
            if not context.is_active():
                handle.abort("the prefill call was cancelled")
                raise CallEnded()
            try:
                handle.result(timeout=POLL_S)
            except TimeoutError:
                continue
        result = handle.result()
        if not result.ok:
            reason = result.failure.name if result.failure else "UNKNOWN"
            context.abort(grpc.StatusCode.UNAVAILABLE, f"KV transfer failed: {reason}: {result.message}")
        yield worker_pb2.PrefillEvent(
            transfer_done=worker_pb2.TransferDone(num_bytes=result.num_bytes, seconds=result.seconds)
        )

    def Status(self, request, context) -> admin_pb2.WorkerInfo:
        leases = self.sender.stats().active_transfers
        return worker_info(
            self.loop,
            worker_id=self.worker_id,
            role=admin_pb2.WORKER_ROLE_PREFILL,
            address=self.address,
            draining=self.draining.is_set(),
            active_leases=leases,
            known_prefix_version=request.known_prefix_version,
            node=self.node,
        )


class LayerSend:
    """The engine's layer listener for one Prefill call (model_runtime.layer_stream): opens the transfer at
    the first group written and queues each group with the event behind its kernels, then finishes it with
    the first token as the engine emits it. Runs on the engine thread and never blocks: open(), send_layers()
    and finish() only queue work for a sender thread."""

    def __init__(self, sender: KVSender | ShardedSender, target: kv_pb2.KVTarget) -> None:
        self.sender = sender
        self.target = target
        self.handle: SendHandle | None = None
        self.finished = False  # finish() was queued on the engine thread

    def deliver_to(self, put: Callable[[StepOutput], None]) -> Callable[[StepOutput], None]:
        """The call's subscriber: its first output finishes the transfer before it is queued for the call's
        thread, so the KVDone frame does not wait for that thread to wake up and write the first token."""

        def deliver(out: StepOutput) -> None:
            if not self.finished and self.handle is not None and out.finish_reason is None:
                self.first_token(out)
            put(out)

        return deliver

    def first_token(self, out: StepOutput) -> None:
        assert self.handle is not None
        try:
            self.handle.finish(_kv_first_token(out))
        except (ValueError, TypeError) as exc:  # layers missing (a group failed to queue): the call says so
            log.warning("request %r: the transfer could not be finished on the engine thread: %s",
                        self.target.request_id, exc)  # fmt: skip
            return
        self.finished = True

    def layers_written(
        self, block_ids: tuple[int, ...], num_tokens: int, layer_begin: int, layer_end: int, ready: Any
    ) -> bool:
        try:
            if self.handle is None:
                self.handle = self.sender.open(self.target, block_ids, num_tokens)
            self.handle.send_layers(layer_begin, layer_end, ready)
        except (ValueError, TypeError, RuntimeError) as exc:  # a closing sender, a target it refuses
            log.warning("request %r: KV not sent while the prompt runs: %s", self.target.request_id, exc)
            if self.handle is not None:
                self.handle.abort(f"queueing layers failed: {exc}")
            return self.handle is not None  # an open handle holds (and will give back) its reference
        return True


def _kv_first_token(out: StepOutput) -> FirstToken:
    token = out.token_ids[0]
    if not out.logprobs:
        return FirstToken(token)
    chosen, top = out.logprobs[0]
    return FirstToken(token, chosen, tuple(top))
