"""KVReceiver: the decode worker's side of the handoff.

    lease = receiver.reserve(request_id, num_tokens)   # blocks from the allocator, or NoRoom
    target = receiver.target(lease)                     # KVTarget protobuf for the router to pass on
    ... the prefill worker's KVSender connects and ships the blocks ...
    results = receiver.poll()                           # or on_result(result) from a receiver thread

Threads: one accepts control connections (each served by its own session thread, see receive_session), one
reaps expired leases whether or not any traffic comes. Every result (landed or failed) is reported exactly
once, after the blocks changed hands: a landed lease's blocks belong to the caller, a failed lease's blocks are
back in the allocator.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Callable

import torch

from kv_transfer.config import TransferConfig
from kv_transfer.contracts import (
    Allocate,
    BlockAllocator,
    FailureReason,
    Lease,
    TransferFailed,
    TransferResult,
)
from kv_transfer.cuda_ipc import IpcReceiverTransport
from kv_transfer.doorbell import Armed
from kv_transfer.frames import FrameConnection, Watch, error_frame
from kv_transfer.leases import LeaseTable
from kv_transfer.pairing import TRANSPORT_TO_PROTO, format_message
from kv_transfer.receive_session import ReceiverCore, ReceiveSession
from kv_transfer.stats import StatsRecorder, TransferStats
from kv_transfer.transport import device_uuid, make_receiver_transports
from model_runtime.kv_layout import KVLayout
from tandem_api.tandem.v1 import kv_pb2

log = logging.getLogger(__name__)

ResultCallback = Callable[[TransferResult], None]


class KVReceiver:
    """Listens on config.host:config.port from construction until close(); safe to close twice."""

    def __init__(
        self,
        layout: KVLayout,
        cache: torch.Tensor,
        allocator: BlockAllocator,
        config: TransferConfig | None = None,
        *,
        on_result: ResultCallback | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """tls: a server context (the decode worker's cluster certificate, client certificates required):
        every control connection is TLS, and a peer that fails the handshake is refused and counted."""
        self.layout = layout
        self._tls = tls
        self.config = config or TransferConfig()
        self._on_result = on_result
        self._results: collections.deque[TransferResult] = collections.deque()
        self._stats = StatsRecorder()
        self._closing = threading.Event()
        self._closed = False
        self._lock = threading.Lock()
        self._sessions: set[threading.Thread] = set()
        self.receiver_id = secrets.token_bytes(16)
        self._transports = make_receiver_transports(self.config, layout, cache)
        # The transports held, in order of preference (the first is the default): a lease names one of them.
        self.transports: tuple[str, ...] = tuple(self._transports)
        self._armed: dict[bytes, Armed] = {}  # by lease handle: armed and not yet claimed or ended
        self._arm_lock = threading.Lock()
        self._table = LeaseTable(layout, allocator, self._lease_failed, before_free=self._disarm)
        self._core = ReceiverCore(
            layout,
            self.config,
            self._table,
            self._transports,
            self.receiver_id,
            device_uuid(cache),
            self._deliver,
            self._shutdown_failure,
            self._stats.record_refused,
            self._take_armed,
        )
        self._server = self._listen()
        self.port: int = self._server.getsockname()[1]
        self._threads = [
            threading.Thread(target=self._accept_loop, name="kv-recv-accept", daemon=True),
            threading.Thread(target=self._reap_loop, name="kv-recv-reaper", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    # --- the decode worker's API -----------------------------------------------------------------------
    @property
    def endpoint(self) -> tuple[str, int]:
        return self.config.public_host, self.port

    def reserve(
        self,
        request_id: str,
        num_tokens: int,
        ttl_s: float | None = None,
        allocate: Allocate | None = None,
        transport: str | None = None,
        handle: bytes | None = None,
        sender: bytes | None = None,
    ) -> Lease:
        """Reserve blocks for `num_tokens` prompt tokens for ttl_s seconds (default config.lease_ttl_s), to
        arrive over `transport` (one of `transports`; None: the first). Raises NoRoom when the allocator has no
        room, ValueError for a bad or duplicate request or a transport this receiver does not hold.

        `allocate(num_blocks)`, when given, takes this reservation's blocks instead of the allocator (the decode
        worker checks the request and allocates in one call onto its engine thread); its errors propagate and
        no lease is made. The blocks return through the allocator's free() as always. `handle`: the lease's
        credential when rank 0 of a tensor-parallel decode worker chose it for this rank (random otherwise).
        `sender`: the KVSender instance id expected to fill it, when known; a cuda_ipc lease for a sender this
        receiver is paired with is then armed (kv_transfer.doorbell: its copies wait on the GPU for that
        sender's doorbell, and its KVTarget says so)."""
        if self._closing.is_set():
            raise RuntimeError("KVReceiver is closed")
        ttl = self.config.lease_ttl_s if ttl_s is None else ttl_s
        kind = self.transports[0] if transport is None else transport
        if kind not in self._transports:
            raise ValueError(f"transport: this KV receiver holds {', '.join(self.transports)}, not {kind!r}")
        lease = self._table.reserve(request_id, num_tokens, ttl, allocate, kind, handle)
        if sender is not None and kind == "cuda_ipc" and handle is None:
            self._arm(lease, sender)
        return lease

    def _arm(self, lease: Lease, sender: bytes) -> None:
        ipc = self._transports["cuda_ipc"]
        assert isinstance(ipc, IpcReceiverTransport)
        with self._arm_lock:  # against _disarm: a lease that ended already is not armed
            if not self._table.active(lease.handle):
                return
            armed = ipc.arm(sender, lease.block_ids)
            if armed is not None:
                self._armed[lease.handle] = armed

    def _take_armed(self, handle: bytes) -> Armed | None:
        """The claimed lease's armed chain, now its session's to land or release."""
        with self._arm_lock:
            return self._armed.pop(handle, None)

    def _disarm(self, lease: Lease) -> bool:
        """Before an unclaimed lease's blocks are freed: end its armed chain, if any. Its sender may still write
        ids into the slot (it may hold the KVTarget), so the slot rests in quarantine first."""
        armed = self._take_armed(lease.handle)
        if armed is None:
            return True
        ipc = self._transports["cuda_ipc"]
        assert isinstance(ipc, IpcReceiverTransport)
        return ipc.bells.release(armed, reusable=False)

    def target(self, lease: Lease) -> kv_pb2.KVTarget:
        """The KVTarget that tells a sender where and under which handle to ship this lease's blocks."""
        host, port = self.endpoint
        with self._arm_lock:
            armed = self._armed.get(lease.handle)
        message = None
        if armed is not None:
            message = kv_pb2.KVArmed(sender_id=armed.peer_id, slot=armed.slot, generation=armed.generation)
        return kv_pb2.KVTarget(
            armed=message,
            host=host,
            port=port,
            handle=lease.handle,
            request_id=lease.request_id,
            layout_fingerprint=self.layout.fingerprint(),
            format=format_message(self.layout),
            num_blocks=len(lease.block_ids),
            num_tokens=lease.num_tokens,
            transport=TRANSPORT_TO_PROTO[lease.transport],
            receiver_id=self.receiver_id,
            lease_ttl_ms=int((lease.expires_at - lease.reserved_at) * 1000),
        )

    def renew(self, request_id: str) -> bool:
        """Keep an unclaimed lease alive for another TTL (its holder still waits). False when it has none,
        a sender claimed it, or it already ended."""
        return self._table.renew(request_id)

    def abort(self, key: str | bytes, message: str = "") -> bool:
        """Cancel the lease of a request id (str) or handle (bytes). Its blocks return to the allocator once no
        write into them can happen (at once if no sender has claimed it). False if no such lease is active."""
        failure = TransferFailed(FailureReason.RECEIVER_ABORTED, message or "aborted by the decode worker")
        return self._table.cancel(key, failure)

    def poll(self) -> list[TransferResult]:
        """Results since the last poll (only when no on_result callback was given)."""
        out = []
        while self._results:
            out.append(self._results.popleft())
        return out

    def stats(self) -> TransferStats:
        return self._stats.snapshot(active_leases=len(self._table))

    def record_phase(self, name: str, seconds: float) -> None:
        """Count a phase the caller timed after landing (the decode worker's "admit") with the transfer's own."""
        self._stats.record_phase(name, seconds)

    def close(self) -> None:
        """Refuse new work, fail every lease (SHUTDOWN), wait for sessions to stop writing, release the pairs."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._closing.set()
        self._table.cancel_all(TransferFailed(FailureReason.SHUTDOWN, "the receiver is closing"))
        self._server.close()
        for thread in self._threads:
            thread.join()
        with self._lock:
            sessions = list(self._sessions)
        for thread in sessions:
            thread.join(timeout=self.config.connect_timeout_s + 2.0)
        for transport in self._transports.values():
            transport.close()

    def __enter__(self) -> KVReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- threads ---------------------------------------------------------------------------------------
    def _listen(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
        server = socket.create_server((self.config.host, self.config.port), family=family, backlog=128)
        server.settimeout(self.config.poll_interval_s)
        return server

    def _accept_loop(self) -> None:
        while not self._closing.is_set():
            try:
                sock, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                if not self._closing.is_set():
                    log.exception("KV receiver accept failed")
                    time.sleep(self.config.poll_interval_s)
                continue
            self._start_session(sock)

    def _start_session(self, sock: socket.socket) -> None:
        with self._lock:
            busy = len(self._sessions) >= self.config.max_connections
            if not busy:
                thread = threading.Thread(
                    target=self._run_session, args=(sock,), name="kv-recv-session", daemon=True
                )
                self._sessions.add(thread)
        if busy:
            if self._tls is None:  # over TLS nothing can be said before a handshake: just close
                conn = FrameConnection(sock, self.config.poll_interval_s)
                notice = Watch(time.monotonic() + 0.2, FailureReason.DEADLINE_EXCEEDED, "busy notice")
                with contextlib.suppress(TransferFailed):
                    conn.send_frame(
                        error_frame(FailureReason.RECEIVER_BUSY, "too many KV connections"), notice
                    )
            sock.close()
            return
        thread.start()

    def _run_session(self, sock: socket.socket) -> None:
        try:
            if self._tls is not None:
                try:
                    sock = self._handshake(sock)
                except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
                    self._stats.record_refused("tls_handshake")
                    log.warning("KV connection refused: TLS handshake failed: %s", exc)
                    with contextlib.suppress(OSError):
                        sock.close()
                    return
            ReceiveSession(self._core, FrameConnection(sock, self.config.poll_interval_s)).run()
        finally:
            with self._lock:
                self._sessions.discard(threading.current_thread())

    def _handshake(self, sock: socket.socket) -> socket.socket:
        """The TLS handshake on this session's own thread (a slow or silent peer never stalls accept)."""
        assert self._tls is not None
        sock.settimeout(self.config.connect_timeout_s)
        return self._tls.wrap_socket(sock, server_side=True)

    def _reap_loop(self) -> None:
        while not self._closing.wait(self.config.poll_interval_s):
            try:
                self._table.expire()
            except Exception:  # keep reaping: a dead reaper would leak every later lease
                log.exception("KV lease reaper failed")

    # --- results ---------------------------------------------------------------------------------------
    def _shutdown_failure(self) -> TransferFailed | None:
        if self._closing.is_set():
            return TransferFailed(FailureReason.SHUTDOWN, "the receiver is closing")
        return None

    def _lease_failed(self, lease: Lease, failure: TransferFailed, claimed_at: float) -> None:
        seconds = time.monotonic() - claimed_at if claimed_at else 0.0
        self._deliver(TransferResult(lease, False, failure.reason, failure.message, seconds=seconds))

    def _deliver(self, result: TransferResult) -> None:
        if self._on_result is not None:
            try:  # before the counts: the decode worker admits a landed request from here
                self._on_result(result)
            except Exception:  # the callback is the decode worker's; log it and keep serving other leases
                log.exception("on_result callback failed for request %r", result.request_id)
        if result.ok:
            self._stats.record_ok(result.num_bytes, result.seconds, result.phases, result.armed)
        else:
            assert result.failure is not None
            self._stats.record_failure(result.failure)
        if self._on_result is None:  # after the counts: a poll() that returns it finds them updated
            self._results.append(result)
