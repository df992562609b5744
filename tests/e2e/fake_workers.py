"""Fake prefill and decode workers for the router's end-to-end tests (test_router_grpc, test_router_dispatch).

The router under test is the real RouterServer on 127.0.0.1 with the real SmolLM2 tokenizer, reached through the
real SDK. What stands in for the Ray workers are minimal gRPC DecodeWorker / PrefillWorker servicers that follow
worker.proto: decode reserves (a fake KVTarget), waits until "its" prefill worker has shipped the KV (an
in-process event), then streams a scripted token sequence; prefill streams the first token, then TransferDone.
Both stop on the same token rules as the engine (EOS, stop ids, max_tokens) and record every call and every
cancellation they see, which is what the tests assert on.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import grpc.aio

from router.config import RouterConfig
from router.model import ServedModel
from router.server import RouterServer
from tandem_api.tandem.v1 import admin_pb2, generate_pb2, kv_pb2, worker_pb2, worker_pb2_grpc
from tandem_client import Client
from tests.polling import wait_until

T = TypeVar("T")
LAYOUT = "fp-test"
FOREVER_S = 3600.0


class LoopThread:
    """An asyncio loop on a background thread: the router and fake workers live there, the blocking SDK here."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="router-test-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@dataclass
class Script:
    """What a fake "model" generates: `tokens` in order (first one from prefill), `batch` per decode event."""

    tokens: list[int]
    batch: int = 2
    step_s: float = 0.0
    num_cached_tokens: int = 0


def planned(
    script: Script, sampling: worker_pb2.EngineSampling, eos: tuple[int, ...]
) -> tuple[list[int], generate_pb2.FinishReason, int | None]:
    """(tokens, finish reason, stop token) under the engine's token rules."""
    out: list[int] = []
    for token in script.tokens[: sampling.max_tokens]:
        out.append(token)
        if token in sampling.stop_token_ids or (not sampling.ignore_eos and token in eos):
            return out, generate_pb2.FINISH_REASON_STOP, token
    return out, generate_pb2.FINISH_REASON_LENGTH, None


def logprob(token: int, sampling: worker_pb2.EngineSampling) -> generate_pb2.TokenLogprob | None:
    if not sampling.HasField("logprobs"):
        return None
    top = [
        generate_pb2.TopLogprob(token_id=token + i, logprob=-0.1 * (i + 1)) for i in range(sampling.logprobs)
    ]
    return generate_pb2.TokenLogprob(token_id=token, logprob=-0.25, top=top)


@dataclass
class Landings:
    """The KV "transfer" between the fakes: prefill sets the event of the attempt id, decode waits on it."""

    events: dict[str, asyncio.Event] = field(default_factory=dict)

    def event(self, request_id: str) -> asyncio.Event:
        return self.events.setdefault(request_id, asyncio.Event())


class FakeWorker:
    """Common parts: identity, Status answers, the calls and cancellations seen."""

    role: admin_pb2.WorkerRole = admin_pb2.WORKER_ROLE_DECODE

    def __init__(
        self,
        worker_id: str,
        script: Script,
        landings: Landings,
        eos: tuple[int, ...],
        *,
        mode: str = "ok",
        free_blocks: int = 100,
        queued_prefill_tokens: int = 0,
    ) -> None:
        self.worker_id = worker_id
        self.queued_prefill_tokens = queued_prefill_tokens  # what Status reports (placement's queue signal)
        self.script = script
        self.landings = landings
        self.eos = eos
        self.mode = mode
        self.free_blocks = free_blocks
        self.state = admin_pb2.WORKER_STATE_READY
        self.requests: list[Any] = []
        self.cancelled: list[str] = []
        self.active = 0
        self.server: grpc.aio.Server | None = None
        self.address = ""

    async def Status(self, request: Any, context: Any) -> admin_pb2.WorkerInfo:
        return admin_pb2.WorkerInfo(
            worker_id=self.worker_id,
            role=self.role,
            state=self.state,
            kv_blocks_total=self.free_blocks + 7,
            kv_blocks_used=7,
            running_requests=self.active,
            queued_prefill_tokens=self.queued_prefill_tokens,
            layout_fingerprint=LAYOUT,
            model="smollm2",
        )

    async def serve(self) -> str:
        self.server = grpc.aio.server()
        self.register(self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.address = f"127.0.0.1:{port}"
        return self.address

    def register(self, server: grpc.aio.Server) -> None:
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(self, server)

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(None)

    def endpoint(self) -> worker_pb2.WorkerEndpoint:
        return worker_pb2.WorkerEndpoint(worker_id=self.worker_id, role=self.role, address=self.address)


class FakeDecode(FakeWorker, worker_pb2_grpc.DecodeWorkerServicer):
    """mode: ok | no_room (RESOURCE_EXHAUSTED) | down (UNAVAILABLE) | hang (never answers) | fail_after
    (UNAVAILABLE after its first token batch)."""

    async def Decode(self, request: worker_pb2.DecodeRequest, context: Any) -> Any:
        self.requests.append(request)
        self.active += 1
        try:
            async for event in self._events(request, context):
                yield event
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise
        finally:
            self.active -= 1

    async def _events(self, request: worker_pb2.DecodeRequest, context: Any) -> Any:
        if self.mode == "no_room":
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no room: 0 free KV blocks")
        if self.mode == "down":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is shutting down")
        if self.mode == "hang":
            await asyncio.sleep(FOREVER_S)
        tokens, reason, stop_id = planned(self.script, request.sampling, self.eos)
        if not request.local_prefill:
            yield worker_pb2.DecodeEvent(
                reserved=kv_pb2.KVTarget(
                    host="127.0.0.1",
                    port=1,
                    handle=b"h" * 16,
                    request_id=request.request_id,
                    num_blocks=3,
                    num_tokens=len(request.prompt_token_ids),
                    layout_fingerprint=LAYOUT,
                )
            )
            async with asyncio.timeout(
                request.lease_ttl_ms / 1000
            ):  # not wait_for: it can drop a cancel on 3.11
                await self.landings.event(request.request_id).wait()
            tokens = tokens[1:]  # the first token travelled with the KV; the router has it from prefill
        for i in range(0, len(tokens), self.script.batch):
            await asyncio.sleep(self.script.step_s)
            if self.mode == "fail_after" and i > 0:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "decode worker lost its GPU")
            chunk = tokens[i : i + self.script.batch]
            lps = [lp for t in chunk if (lp := logprob(t, request.sampling)) is not None]
            batch = worker_pb2.TokenBatch(
                token_ids=chunk, logprobs=lps, num_cached_tokens=self.script.num_cached_tokens
            )
            yield worker_pb2.DecodeEvent(tokens=batch)
        finished = worker_pb2.DecodeFinished(
            finish_reason=reason, num_cached_tokens=self.script.num_cached_tokens
        )
        if stop_id is not None:
            finished.stop_token_id = stop_id
        yield worker_pb2.DecodeEvent(finished=finished)


class FakeColocated(FakeDecode):
    role = admin_pb2.WORKER_ROLE_COLOCATED


class FakePrefill(FakeWorker, worker_pb2_grpc.PrefillWorkerServicer):
    """mode: ok | down (UNAVAILABLE) | hang (no first token) | hold (first token, then never ships the KV) |
    late (ships the KV first and sends the first token 0.2 s later, so decode tokens overtake it)."""

    role = admin_pb2.WORKER_ROLE_PREFILL

    def register(self, server: grpc.aio.Server) -> None:
        worker_pb2_grpc.add_PrefillWorkerServicer_to_server(self, server)

    async def Prefill(self, request: worker_pb2.PrefillRequest, context: Any) -> Any:
        self.requests.append(request)
        self.active += 1
        try:
            async for event in self._events(request, context):
                yield event
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise
        finally:
            self.active -= 1

    async def _events(self, request: worker_pb2.PrefillRequest, context: Any) -> Any:
        if self.mode == "down":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "prefill worker is gone")
        if self.mode == "hang":
            await asyncio.sleep(FOREVER_S)
        tokens, reason, stop = planned(self.script, request.sampling, self.eos)
        if self.mode == "late":
            self.landings.event(request.target.request_id).set()
            await asyncio.sleep(0.2)
        finished = len(tokens) == 1 and (
            reason == generate_pb2.FINISH_REASON_STOP or request.sampling.max_tokens == 1
        )
        first = worker_pb2.FirstToken(token_id=tokens[0], num_cached_tokens=self.script.num_cached_tokens)
        if finished:  # as the prefill worker says it: the reason, and the stop id when one ended it
            first.finish_reason = reason  # type: ignore[assignment]
            if stop is not None:
                first.stop_token_id = stop
        lp = logprob(tokens[0], request.sampling)
        if lp is not None:
            first.logprob.CopyFrom(lp)
        yield worker_pb2.PrefillEvent(first_token=first)
        if finished:
            return
        if self.mode == "hold":
            await asyncio.sleep(FOREVER_S)
        self.landings.event(request.target.request_id).set()
        yield worker_pb2.PrefillEvent(transfer_done=worker_pb2.TransferDone(num_bytes=4096, seconds=0.001))


class RouterHarness:
    """A RouterServer plus fake workers on one background loop. Build workers, then start()."""

    def __init__(self, loop: LoopThread, model: ServedModel, script: Script, **config: Any) -> None:
        self.loop = loop
        self.model = model
        self.script = script
        self.landings = Landings()
        self.workers: list[FakeWorker] = []
        defaults: dict[str, Any] = {
            "host": "127.0.0.1",
            "port": 0,
            "poll_interval_s": 0.05,
            "poll_timeout_s": 0.5,
        }
        self.config = RouterConfig(**{**defaults, **config})
        self.router = RouterServer(self.config, model=model)
        self.address = ""
        self.sdk: Client | None = None

    def add(self, kind: type[FakeWorker], worker_id: str, **kwargs: Any) -> Any:
        worker = kind(
            worker_id, kwargs.pop("script", self.script), self.landings, self.model.eos_token_ids, **kwargs
        )
        self.workers.append(worker)
        return worker

    def start(self, wait_ready: bool = True) -> RouterHarness:
        async def go() -> str:
            for worker in self.workers:
                await worker.serve()
            address = await self.router.start()
            self.router.set_workers([w.endpoint() for w in self.workers])
            return address

        self.address = self.loop.run(go())
        self.sdk = self.client()
        if wait_ready and self.workers:
            wait_until(self.all_ready, what="every worker READY in the router's view", every_s=0.01)
        return self

    def all_ready(self) -> bool:
        status = self.status()
        return len(status.workers) == len(self.workers) and all(w.state == "ready" for w in status.workers)

    def status(self) -> Any:
        if self.sdk is None:
            raise RuntimeError("start() the harness first")
        return self.sdk.status(timeout=5)

    def client(self, **kwargs: Any) -> Client:
        kwargs.setdefault("timeout", 10.0)
        kwargs.setdefault("retries", 0)
        return Client(self.address, **kwargs)

    def close(self) -> None:
        if self.sdk is not None:
            self.sdk.close()

        async def stop() -> None:
            await self.router.stop(grace=0)
            for worker in self.workers:
                await worker.stop()

        # Stopping takes milliseconds. Stops that passed a 30 s bound, and later this 120 s one in CI, were one bug,
        # not a starved box: the router's worker poller lost its cancel and never ended (router/pool.py says how;
        # tests/unit/test_pool_close.py). The bound stays generous for a loaded box; a stop that never ends fails.
        self.loop.run(stop(), timeout=120.0)
