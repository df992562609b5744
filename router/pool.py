"""The router's view of its workers: membership, one gRPC channel each, and a background Status poller.

Membership comes from outside (the controller through RouterControl.SetWorkers, or `RouterServer.set_workers`
in-process); this module never invents workers. Each worker's state as placement sees it:

    marked draining by the controller    DRAINING  (skipped; its requests finish there)
    never answered a poll            STARTING  (skipped)
    answered                         what it reported (only READY takes requests)
    failed `dead_after` polls in a row   DEAD  (skipped until a poll succeeds again)
    a request's call found it unreachable    suspect: skipped until its next successful poll

Loads are the last poll corrected by `Charge`s: the router's own placements since that poll. Each worker's
prefix-cache block hashes (router.prefix) are kept from the last poll that brought new ones; a poll tells the
worker which version it holds, so an unchanged cache costs nothing on the wire.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio

from model_runtime.roles import WorkerRole
from router.errors import invalid
from router.metrics import RouterMetrics
from router.pairs import ActivePairs
from router.placement import WorkerLoad
from router.prefix import PromptHashes, cached_prefix_tokens
from router.transport_choice import pair_end
from tandem_api.tandem.v1 import admin_pb2, worker_pb2, worker_pb2_grpc
from tandem_client.tls import TLSFiles

log = logging.getLogger(__name__)

_RETIRED_CLOSE_CHECK_S = 0.5


@dataclass(frozen=True)
class Endpoint:
    worker_id: str
    role: WorkerRole
    address: str
    draining: bool = False  # leaving its pool: nothing new is placed on it

    @property
    def identity(self) -> tuple[str, WorkerRole, str]:
        """What makes it the same worker: a change of `draining` alone keeps its channel and history."""
        return (self.worker_id, self.role, self.address)


def endpoints_from_proto(workers: Sequence[worker_pb2.WorkerEndpoint]) -> list[Endpoint]:
    """Checked endpoints; a bad entry raises INVALID_ARGUMENT naming it ("workers[2].address: ...")."""
    seen: set[str] = set()
    result = []
    for i, w in enumerate(workers):
        if not w.worker_id:
            raise invalid(f"workers[{i}].worker_id", "must not be empty")
        if w.worker_id in seen:
            raise invalid(f"workers[{i}].worker_id", f"{w.worker_id!r} appears twice")
        try:
            role = WorkerRole.from_wire(w.role)
        except ValueError as exc:
            raise invalid(f"workers[{i}].role", str(exc)) from None
        host, _, port = w.address.rpartition(":")
        if not host or not port.isdigit():
            raise invalid(f"workers[{i}].address", f"must be host:port, got {w.address!r}")
        seen.add(w.worker_id)
        result.append(Endpoint(w.worker_id, role, w.address, w.draining))
    return result


@dataclass
class Charge:
    """Load the router put on a worker since `created_at` (monotonic). Dropped when the request no longer holds
    it (`release`) or when a poll that started later has reported the worker's own numbers."""

    running: int = 0
    kv_blocks: int = 0
    prefill_tokens: int = 0
    created_at: float = 0.0
    released: bool = False

    def release(self) -> None:
        self.released = True


class WorkerHandle:
    """One member: its endpoint, channel and stub, and what the last polls said."""

    def __init__(self, endpoint: Endpoint, channel: grpc.aio.Channel) -> None:
        self.endpoint = endpoint
        self.channel = channel
        # Decode and colocated workers serve DecodeWorker (Decode + Status), prefill workers PrefillWorker.
        self.stub: Any = (
            worker_pb2_grpc.PrefillWorkerStub(self.channel)
            if endpoint.role is WorkerRole.PREFILL
            else worker_pb2_grpc.DecodeWorkerStub(self.channel)
        )
        self.info: admin_pb2.WorkerInfo | None = None
        self.added_at = time.monotonic()
        self.last_ok: float | None = None
        self.failed_polls = 0
        self.suspect = False
        self.active_calls = 0
        self.charges: list[Charge] = []
        self.prefix_version = 0  # the worker's prefix_cache_version that prefix_hashes reflect
        self.prefix_hashes: frozenset[bytes] = frozenset()
        # Set while the worker is DEAD (dead_after polls failed in a row), or once the controller took it out of
        # the membership without draining it (it replaced the worker: its process or its node is gone): calls in
        # flight on it give up then and resume elsewhere, since a hung process or an unreachable node keeps its
        # streams open but silent.
        self.dead = asyncio.Event()
        self.removed = False

    def dead_reason(self) -> str:
        """Why calls in flight on the worker were given up (the failure their request resumes after)."""
        if self.removed:
            return "left the membership while it had the request (the controller replaced it)"
        return "stopped answering status polls (DEAD) while it had the request"

    @property
    def worker_id(self) -> str:
        return self.endpoint.worker_id

    def state(self, dead_after: int) -> int:
        if self.failed_polls >= dead_after:
            return admin_pb2.WORKER_STATE_DEAD
        if self.endpoint.draining:
            return admin_pb2.WORKER_STATE_DRAINING
        if self.info is None:
            return admin_pb2.WORKER_STATE_STARTING
        return int(self.info.state)

    def load(self, dead_after: int) -> WorkerLoad:
        info = self.info or admin_pb2.WorkerInfo()
        self.charges = [c for c in self.charges if not c.released]
        ready = self.state(dead_after) == admin_pb2.WORKER_STATE_READY and not self.suspect
        return WorkerLoad(
            worker_id=self.worker_id,
            role=self.endpoint.role,
            ready=ready,
            free_kv_blocks=max(0, info.kv_blocks_total - info.kv_blocks_used),
            running_requests=info.running_requests,
            queued_prefill_tokens=info.queued_prefill_tokens,
            layout_fingerprint=info.layout_fingerprint,
            kv_blocks_total=info.kv_blocks_total,
            kv_block_size=info.kv_block_size,
            pair_end=pair_end(info) if info.kv_transports else None,
        ).charged(
            running=sum(c.running for c in self.charges),
            kv_blocks=sum(c.kv_blocks for c in self.charges),
            prefill_tokens=sum(c.prefill_tokens for c in self.charges),
        )

    def poll_succeeded(self, info: admin_pb2.WorkerInfo, started_at: float) -> None:
        if info.prefix_cache_version != self.prefix_version:
            self.prefix_version = info.prefix_cache_version
            self.prefix_hashes = frozenset(info.cached_block_hashes)
        info.ClearField(
            "cached_block_hashes"
        )  # kept once, above; status and `tandem status` never carry them
        self.info = info
        self.last_ok = time.monotonic()
        self.failed_polls = 0
        self.suspect = False
        self.dead.clear()
        # The worker's numbers now include every placement made before this poll was sent.
        self.charges = [c for c in self.charges if not c.released and c.created_at >= started_at]

    @contextlib.contextmanager
    def in_use(self) -> Iterator[WorkerHandle]:
        """Held around a call so a worker removed from the membership keeps its channel until the call ends."""
        self.active_calls += 1
        try:
            yield self
        finally:
            self.active_calls -= 1


class WorkerPool:
    def __init__(
        self,
        *,
        poll_interval_s: float,
        poll_timeout_s: float,
        dead_after_failed_polls: int,
        max_message_bytes: int,
        metrics: RouterMetrics,
        on_change: Callable[[], None] = lambda: None,
        tls: TLSFiles | None = None,
    ) -> None:
        self._interval = poll_interval_s
        self._poll_timeout = poll_timeout_s
        self.dead_after = dead_after_failed_polls
        self._options: list[tuple[str, int | str]] = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
        # Mutual TLS to the workers (tls.cluster): the files are read once, at the first channel.
        self._tls = tls
        self._credentials: grpc.ChannelCredentials | None = None
        self._metrics = metrics
        self._on_change = on_change
        self._workers: dict[str, WorkerHandle] = {}
        self._wake = asyncio.Event()
        self._poller: asyncio.Task[None] | None = None
        self._closed = False
        self._closers: dict[asyncio.Task[None], WorkerHandle] = {}  # retired members, closed once idle
        self.pairs = ActivePairs()  # prefill/decode pairs with requests on them now (dispatch opens them)

    # --- membership ----------------------------------------------------------------------------------
    def replace(self, endpoints: Sequence[Endpoint]) -> None:
        """Make `endpoints` the membership. Unchanged members keep their channel and poll history."""
        current = self._workers
        before = set(current)
        self._workers, retired = {}, []
        changed = False
        for ep in endpoints:
            old = current.pop(ep.worker_id, None)
            if old is not None and old.endpoint.identity == ep.identity:
                changed |= old.endpoint != ep  # it started (or stopped) draining
                old.endpoint = ep
                self._workers[ep.worker_id] = old
                continue
            if old is not None:  # same id, new address or role: a new worker as far as we know
                retired.append(old)
            self._workers[ep.worker_id] = WorkerHandle(ep, self._open_channel(ep.address))
        for handle in [*retired, *current.values()]:
            if not handle.endpoint.draining:  # a drained worker finishes its calls; a replaced one never will
                handle.removed = True
                handle.dead.set()
            task = asyncio.create_task(self._close_when_idle(handle))
            self._closers[task] = handle
            task.add_done_callback(lambda done: self._closers.pop(done, None))
        if changed or retired or current or set(self._workers) != before:  # unchanged sets are resent
            names = ", ".join(
                f"{e.worker_id}({e.role.value}{', draining' if e.draining else ''})" for e in endpoints
            )
            log.info("membership: %s", names or "empty")
            self._wake.set()  # poll the new members now rather than at the next tick
            self._on_change()

    def _open_channel(self, address: str) -> grpc.aio.Channel:
        if self._tls is None:
            return grpc.aio.insecure_channel(address, options=self._options)
        if self._credentials is None:
            self._credentials = self._tls.channel_credentials()
        options = self._options + list(self._tls.channel_options())
        return grpc.aio.secure_channel(address, self._credentials, options=options)

    async def _close_when_idle(self, handle: WorkerHandle) -> None:
        while handle.active_calls:
            await asyncio.sleep(_RETIRED_CLOSE_CHECK_S)
        await handle.channel.close()

    def get(self, worker_id: str) -> WorkerHandle | None:
        return self._workers.get(worker_id)

    def handles(self) -> list[WorkerHandle]:
        return list(self._workers.values())

    def loads(self) -> list[WorkerLoad]:
        return [h.load(self.dead_after) for h in self._workers.values()]

    def cached_tokens(self, prompt: PromptHashes) -> dict[str, int]:
        """Per worker with a known prefix cache: the prompt tokens it would take from that cache (estimate)."""
        result = {}
        for handle in self._workers.values():
            block_size = handle.info.kv_block_size if handle.info is not None else 0
            if handle.prefix_hashes and block_size > 0:
                hashes = prompt.matchable(block_size)
                result[handle.worker_id] = cached_prefix_tokens(hashes, handle.prefix_hashes, block_size)
        return result

    def status(self) -> list[admin_pb2.WorkerInfo]:
        """Every member as last polled, identity from the membership, state and heartbeat age from the router."""
        now = time.monotonic()
        result = []
        for handle in list(self._workers.values()):  # a copy: the autoscaler's thread reads it too
            info = admin_pb2.WorkerInfo()
            if handle.info is not None:
                info.CopyFrom(handle.info)
            info.worker_id = handle.worker_id
            info.role = handle.endpoint.role.wire
            info.address = handle.endpoint.address
            info.state = handle.state(self.dead_after)  # type: ignore[assignment]
            info.last_heartbeat_age_seconds = now - (handle.last_ok or handle.added_at)
            info.indexed_prefix_blocks = len(handle.prefix_hashes)
            result.append(info)
        return result

    def charge(self, worker_id: str, running: int = 0, kv_blocks: int = 0, prefill_tokens: int = 0) -> Charge:
        charge = Charge(running, kv_blocks, prefill_tokens, created_at=time.monotonic())
        handle = self._workers.get(worker_id)
        if handle is not None:
            handle.charges.append(charge)
        return charge

    def report_unreachable(self, worker_id: str) -> None:
        """A request's call could not reach the worker: stop placing on it until a poll succeeds."""
        handle = self._workers.get(worker_id)
        if handle is not None and not handle.suspect:
            handle.suspect = True
            self._wake.set()
            self._on_change()

    # --- polling -------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._poller is None:
            self._poller = asyncio.create_task(self._poll_forever(), name="router-worker-poller")

    async def close(self) -> None:
        self._closed = True
        if self._poller is not None:
            self._poller.cancel()
            # asyncio.wait, not `await task` under suppress(CancelledError): that would also swallow a cancel of
            # the caller itself (a stop under a deadline then never learns its time ran out).
            await asyncio.wait([self._poller])
            self._poller = None
        retired = list(self._closers.items())
        for task, _ in retired:
            task.cancel()
        # A retired member's channel is closed here too: a closer cancelled before (or while) it closed would
        # leave the channel, and the calls open on it, to the worker (whose own stop then waits for them).
        for handle in [*self._workers.values(), *(h for _, h in retired)]:
            await handle.channel.close()
        self._workers = {}

    async def _poll_forever(self) -> None:
        # The loop ends on the flag as well as on the cancel: close() must not wait forever on a poller that one
        # lost cancellation left running. asyncio.timeout, not wait_for: on Python 3.11 wait_for returns the
        # result, dropping the cancel, when the wake-up and the cancel land in the same loop turn (CPython
        # bpo-42130; 3.12 rebuilt wait_for on asyncio.timeout). That hung a router's stop in CI on a busy box.
        while not self._closed:
            self._wake.clear()
            await self.poll_once()
            self._on_change()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._interval):
                    await self._wake.wait()

    async def poll_once(self) -> None:
        # return_exceptions: one poll's unexpected error must not end the poller (every worker would then stay
        # as last seen forever, and new members STARTING).
        handles = self.handles()
        results = await asyncio.gather(*(self._poll(h) for h in handles), return_exceptions=True)
        for handle, result in zip(handles, results):
            if isinstance(result, Exception):
                log.error("polling worker %s failed unexpectedly: %r", handle.worker_id, result)

    async def _poll(self, handle: WorkerHandle) -> None:
        started = time.monotonic()
        if self._workers.get(handle.worker_id) is not handle:
            return  # it left the membership since this round began (its channel may be closed already)
        try:
            request = worker_pb2.WorkerStatusRequest(known_prefix_version=handle.prefix_version)
            info = await handle.stub.Status(request, timeout=self._poll_timeout)
        except grpc.aio.UsageError:
            return  # its channel was closed under the call: it left the membership meanwhile
        except grpc.RpcError as exc:
            handle.failed_polls += 1
            code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else grpc.StatusCode.UNKNOWN
            self._metrics.worker_failed(handle.worker_id, f"poll_{code.name.lower()}")
            if handle.failed_polls == self.dead_after:
                handle.dead.set()
                log.warning(
                    "worker %s is DEAD: %d polls failed (last: %s)",
                    handle.worker_id,
                    handle.failed_polls,
                    code.name,
                )
            return
        handle.poll_succeeded(info, started)
