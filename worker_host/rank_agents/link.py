"""The channel between rank 0 and the other ranks' KV agents: framed protobuf messages (rank_agent.proto) over a
Unix socket in the ranks' private rendezvous directory; rank 0's end (AgentHub) listens before they start."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence

from google.protobuf.message import DecodeError

from kv_transfer import (
    FailureReason,
)
from tandem_api.tandem.v1 import rank_agent_pb2 as pb

log = logging.getLogger(__name__)

SOCKET_NAME = "kv-agents.sock"
READY_TIMEOUT_S = 600.0  # the other ranks load their weights meanwhile
REPLY_TIMEOUT_S = 10.0
FOLLOWER_LEASE_TTL_S = (
    3600.0  # a safety net: rank 0 ends every other rank's lease (see worker_host.rank_agents)
)
_LENGTH = struct.Struct(">I")
MAX_MESSAGE = 4 << 20


class AgentLost(RuntimeError):
    """A rank's agent went away (the rank died): the worker is being replaced."""


class Link:
    """One framed protobuf connection (4-byte big-endian length, one AgentMessage)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._lock = threading.Lock()

    def send(self, message: pb.AgentMessage) -> None:
        data = message.SerializeToString()
        with self._lock:
            self.sock.sendall(_LENGTH.pack(len(data)) + data)

    def receive(self) -> pb.AgentMessage | None:
        """The next message, or None once the peer closed."""
        header = self._exactly(_LENGTH.size)
        if header is None:
            return None
        (length,) = _LENGTH.unpack(header)
        if length > MAX_MESSAGE:
            raise ValueError(f"agent message of {length} bytes exceeds {MAX_MESSAGE}")
        body = self._exactly(length)
        if body is None:
            return None
        message = pb.AgentMessage()
        try:
            message.ParseFromString(body)
        except DecodeError as exc:
            raise ValueError(f"an agent message that does not parse: {exc}") from None
        return message

    def _exactly(self, n: int) -> bytes | None:
        chunks, got = [], 0
        while got < n:
            chunk = self.sock.recv(n - got)
            if not chunk:
                return None
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def outcome_message(
    request_id: str, ok: bool, failure: FailureReason | None, message: str, num_bytes: int
) -> pb.AgentMessage:
    outcome = pb.AgentOutcome(request_id=request_id, ok=ok, message=message, num_bytes=num_bytes)
    if failure is not None:
        outcome.failure = failure.value  # type: ignore[assignment]  # KVFailure mirrors FailureReason
    return pb.AgentMessage(outcome=outcome)


def outcome_failure(rank: int, outcome: pb.AgentOutcome) -> tuple[FailureReason, str]:
    """A failed rank's outcome as rank 0 reports it: its reason (INTERNAL when it gave none), and its message
    prefixed with the rank."""
    reason = FailureReason(outcome.failure) if outcome.failure else FailureReason.INTERNAL
    return reason, f"rank {rank}: {outcome.message}"


def lost_outcome(request_id: str) -> pb.AgentOutcome:
    """What rank 0 records for each request a rank still owed when its link went away."""
    return pb.AgentOutcome(request_id=request_id, ok=False, message="rank lost")


# --- rank 0 ---------------------------------------------------------------------------------------------
class AgentHub:
    """Rank 0's end: listens before the other ranks start (they connect whenever their agent is up)."""

    def __init__(self, directory: str, num_followers: int) -> None:
        self.path = os.path.join(directory, SOCKET_NAME)
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(self.path)
        os.chmod(self.path, 0o600)
        self._server.listen(max(1, num_followers))
        self._expected = num_followers
        self._cond = threading.Condition()
        self._links: dict[int, Link] = {}
        self.hellos: dict[int, pb.AgentHello] = {}
        self.lost: set[int] = set()
        self._replies: dict[int, concurrent.futures.Future[str]] = {}
        self._seq = 0
        self._closed = False
        self.on_outcome: Callable[[int, pb.AgentOutcome], None] = lambda rank, outcome: None
        self.on_lost: Callable[[int], None] = lambda rank: None
        # Whether every other rank's process still runs (deploy.ranks.Ranks.alive): a rank that died before its
        # agent connected ends wait_ready at once rather than at its timeout.
        self.ranks_alive: Callable[[], bool] = lambda: True
        threading.Thread(target=self._accept, name="kv-agents-accept", daemon=True).start()

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> list[pb.AgentHello]:
        """Every other rank's hello, by rank (1, 2, ...); raises naming the ranks that never came."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(self.hellos) < self._expected:
                left = deadline - time.monotonic()
                dead = not self.ranks_alive()
                if left <= 0 or self.lost or dead:
                    missing = sorted(set(range(1, self._expected + 1)) - set(self.hellos))
                    why = f"did not report within {timeout_s:.0f} s"
                    if self.lost or dead:
                        gone = f"ranks {sorted(self.lost)}" if self.lost else "a rank's process"
                        why = f"did not report: {gone} went away"
                    raise RuntimeError(f"tensor-parallel ranks {missing}: their KV agents {why}")
                self._cond.wait(min(left, 0.5))
            return [self.hellos[rank] for rank in sorted(self.hellos)]

    def ask(self, requests: dict[int, pb.AgentLease], timeout_s: float = REPLY_TIMEOUT_S) -> dict[int, str]:
        """Send each rank its lease and wait for every reply: rank -> "" (held) or why not."""
        waits: dict[int, concurrent.futures.Future[str]] = {}
        for rank, lease in requests.items():
            with self._cond:
                self._seq += 1
                lease.seq = self._seq
                waits[rank] = self._replies[self._seq] = concurrent.futures.Future()
            try:
                self._link(rank).send(pb.AgentMessage(lease=lease))
            except (OSError, AgentLost) as exc:
                waits[rank].set_result(f"rank {rank}'s KV agent is unreachable: {exc}")
        out = {}
        deadline = time.monotonic() + timeout_s
        for rank, wait in waits.items():
            try:
                out[rank] = wait.result(max(0.0, deadline - time.monotonic()))
            except concurrent.futures.TimeoutError:
                out[rank] = f"rank {rank}'s KV agent did not answer within {timeout_s:.0f} s"
        with self._cond:
            for lease in requests.values():
                self._replies.pop(lease.seq, None)
        return out

    def tell(self, rank: int, message: pb.AgentMessage) -> bool:
        """Send without waiting; False when the rank's agent is gone."""
        try:
            self._link(rank).send(message)
            return True
        except (OSError, AgentLost):
            return False

    def close(self) -> None:
        with self._cond:
            self._closed = True
            links = list(self._links.values())
        for link in links:
            link.close()
        self._server.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    def _link(self, rank: int) -> Link:
        with self._cond:
            link = self._links.get(rank)
            if link is None or rank in self.lost:
                raise AgentLost(f"rank {rank}'s KV agent is not connected")
            return link

    def _accept(self) -> None:
        for _ in range(self._expected):
            try:
                sock, _ = self._server.accept()
            except OSError:
                return  # closed
            threading.Thread(
                target=self._serve, args=(Link(sock),), name="kv-agents-link", daemon=True
            ).start()

    def _serve(self, link: Link) -> None:
        rank = -1
        try:
            first = link.receive()
            if first is None or first.WhichOneof("body") != "hello":
                raise ValueError("a rank's first agent message must be its hello")
            rank = first.hello.rank
            if not 1 <= rank <= self._expected or rank in self.hellos:
                raise ValueError(f"agent hello from rank {rank}: expected one of 1..{self._expected}, once")
            with self._cond:
                self._links[rank] = link
                self.hellos[rank] = first.hello
                self._cond.notify_all()
            while (message := link.receive()) is not None:
                kind = message.WhichOneof("body")
                if kind == "reply":
                    with self._cond:
                        wait = self._replies.get(message.reply.seq)
                    if wait is not None and not wait.done():
                        wait.set_result(message.reply.error)
                elif kind == "outcome":
                    self.on_outcome(rank, message.outcome)
                else:
                    log.warning("rank %d's KV agent sent an unexpected %s message", rank, kind)
        except (OSError, ValueError) as exc:
            if not self._closed:
                log.warning("KV agent link of rank %d failed: %s", rank, exc)
        finally:
            link.close()
            if rank > 0:
                with self._cond:
                    self.lost.add(rank)
                    self._cond.notify_all()
                if not self._closed:
                    log.error("rank %d's KV agent went away: its requests fail", rank)
                    self.on_lost(rank)


def held_by_all(own: Sequence[str], hellos: Sequence[pb.AgentHello]) -> tuple[str, ...]:
    """The transports every rank holds, in rank 0's order of preference."""
    kinds = tuple(k for k in own if all(k in hello.transports for hello in hellos))
    if not kinds:
        raise RuntimeError(f"the ranks hold no KV transport in common (rank 0: {', '.join(own)})")
    return kinds
