"""A stand-in for the router that the SDK tests (test_client_sdk.py) run as a real gRPC server.

It echoes the prompt's token ids (text prompts are tokenized as one token per character, ord(c)) two tokens
per delta, each token's text being chr(id). Some prompts trigger special behaviour: "slow" (0.2 s per token),
"hang" (one delta, then wait for the client to go away), "flaky" (UNAVAILABLE twice per request id, then
normal), "no-final". Admin answers a fixed cluster status.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterator

import grpc

from tandem_api.tandem.v1 import admin_pb2, admin_pb2_grpc, generate_pb2, generate_pb2_grpc, kv_pb2


def _prompt_ids(request: generate_pb2.GenerateRequest) -> list[int]:
    kind = request.WhichOneof("input")
    if kind == "token_ids":
        return list(request.token_ids.ids)
    if kind == "chat":
        return [ord(c) for m in request.chat.messages for c in f"{m.role}:{m.content};"]
    return [ord(c) for c in request.text]


class EchoGeneration(generate_pb2_grpc.GenerationServicer):
    def __init__(self) -> None:
        self.cancel_seen = threading.Event()
        self.attempts: collections.Counter[str] = collections.Counter()
        self.metadata: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0

    def _enter(self) -> None:
        with self.lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def _leave(self) -> None:
        # Called before the Final message goes out: the client cannot start its next request any earlier.
        with self.lock:
            self.in_flight -= 1

    def Generate(self, request, context):
        self.metadata = [(m.key, m.value) for m in context.invocation_metadata()]
        sampling = request.sampling
        if sampling.HasField("temperature") and sampling.temperature < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature: must be >= 0")
        text = request.text if request.WhichOneof("input") == "text" else ""
        if text == "flaky":
            self.attempts[request.request_id] += 1
            if self.attempts[request.request_id] <= 2:
                context.abort(grpc.StatusCode.UNAVAILABLE, "no decode worker yet")
        if text == "hang":
            # The RPC can only end by the client going away; the callback runs when gRPC tears it down (the
            # server may abandon this generator at its yield without resuming it, so no code after it is sure
            # to run).
            context.add_callback(self.cancel_seen.set)
            yield generate_pb2.GenerateResponse(delta=generate_pb2.Delta(token_ids=[1], text="h"))
            while context.is_active():
                time.sleep(0.01)
            return
        yield from self._echo(request, context, text)

    def _echo(self, request, context, text: str) -> Iterator[generate_pb2.GenerateResponse]:
        self._enter()
        prompt = _prompt_ids(request)
        limit = request.sampling.max_tokens if request.sampling.HasField("max_tokens") else 16
        output = prompt[:limit]
        for start in range(0, len(output), 2):
            if text == "slow":
                time.sleep(0.2)
            chunk = output[start : start + 2]
            logprobs = (
                [self._logprob(t, request.sampling) for t in chunk]
                if request.sampling.HasField("logprobs")
                else []
            )
            delta = generate_pb2.Delta(
                token_ids=chunk, text="".join(chr(t) for t in chunk), logprobs=logprobs
            )
            yield generate_pb2.GenerateResponse(delta=delta)
        self._leave()
        if text == "no-final":
            return
        reason = generate_pb2.FINISH_REASON_LENGTH if len(prompt) > limit else generate_pb2.FINISH_REASON_STOP
        final = generate_pb2.Final(
            request_id=request.request_id or "auto-1",
            finish_reason=reason,
            usage=generate_pb2.Usage(
                prompt_tokens=len(prompt), completion_tokens=len(output), cached_prompt_tokens=1
            ),
            timings=generate_pb2.Timings(
                queue_seconds=0.5, time_to_first_token_seconds=0.25, e2e_seconds=1.0
            ),
            prompt_token_ids=prompt,
        )
        if reason == generate_pb2.FINISH_REASON_STOP:
            final.stop_token_id = 2
        yield generate_pb2.GenerateResponse(final=final)

    @staticmethod
    def _logprob(token: int, sampling: generate_pb2.SamplingParams) -> generate_pb2.TokenLogprob:
        top = [
            generate_pb2.TopLogprob(token_id=token + k, logprob=-0.5 * (k + 1))
            for k in range(sampling.logprobs)
        ]
        return generate_pb2.TokenLogprob(token_id=token, logprob=-0.5, top=top)

    def ListModels(self, request, context):
        return generate_pb2.ListModelsResponse(
            models=[generate_pb2.ModelInfo(id="echo", max_model_len=2048, vocab_size=256)]
        )


class FixedAdmin(admin_pb2_grpc.AdminServicer):
    def Status(self, request, context):
        workers = [
            admin_pb2.WorkerInfo(
                worker_id="prefill-0",
                role=admin_pb2.WORKER_ROLE_PREFILL,
                address="10.0.0.1:7001",
                state=admin_pb2.WORKER_STATE_READY,
                kv_blocks_used=3,
                kv_blocks_total=100,
                running_requests=1,
                active_leases=2,
                last_heartbeat_age_seconds=0.25,
                node_id="07beabfa9d9100c00404260e8adaed1fec46b086cd757ee48ce429b0",
                kv_transports=[kv_pb2.KV_TRANSPORT_TCP, kv_pb2.KV_TRANSPORT_CUDA_IPC],
                devices=2,
            ),
            admin_pb2.WorkerInfo(
                worker_id="decode-0", role=admin_pb2.WORKER_ROLE_DECODE, state=admin_pb2.WORKER_STATE_DRAINING
            ),
        ]
        return admin_pb2.ClusterStatus(
            workers=workers, router=admin_pb2.RouterInfo(queued_requests=4, in_flight_requests=5)
        )
