"""The sender's control connections, kept open and reused: a warm handoff is one round trip.

A channel is one TCP connection to one receiver, past its handshake (KVHello both ways, pair setup when the
transport needs one). It carries one transfer at a time; after a transfer that ended with the receiver's KVAck
it goes back to the pool, after any failure it is closed (a failed transfer never shares a connection with the
next, so a half-read stream cannot confuse the two). Pools are keyed by the receiver's address, its instance id
and the transport (a worker may hold several; a connection has one): a restarted receiver is a new key.

An exclusive transport (nccl) carries one transfer at a time per pair, so that the receiver posts its receives
in the order the sender posted its sends. To one receiver it opens at most transfer.nccl_lanes channels, each
on its own lane: the hello names the lane, and both sides key the pair (communicator, staging ring) by the
peer's instance id and the lane (pairing.pair_key), so each lane keeps its own communicator across reconnects.
A transfer takes an idle channel, else opens one on the lowest free lane, else waits for a lane to come back.
The others open as many channels as transfers run at once, all on lane 0 (one mapping per pair). A channel
idle for longer than half the receiver's idle timeout is not reused (the receiver may be closing it at that
moment).
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from kv_transfer.config import TransferConfig
from kv_transfer.contracts import FailureReason, TransferFailed
from kv_transfer.frames import FrameConnection, Watch, expect
from kv_transfer.pairing import check_hello, make_hello, pair_key
from kv_transfer.transport import SenderTransport
from model_runtime.kv_layout import KVLayout
from tandem_api.tandem.v1 import kv_pb2

Key = tuple[str, int, bytes, str]  # the receiver's host, port and instance id; the transport


@dataclass
class Channel:
    key: Key
    conn: FrameConnection
    peer_id: bytes  # the key of the pair's transport state: the receiver's instance id and the lane
    reuse_within_s: float  # half the receiver's idle timeout
    lane: int = 0
    released_at: float = field(default_factory=time.monotonic)
    transfers: int = 0  # completed on this channel; 0 while the first runs (a cold handoff)

    def fresh(self, now: float) -> bool:
        """Reusable: not idle too long, and the receiver has not closed it or spoken (it only would to go)."""
        return now - self.released_at < self.reuse_within_s and not self.conn.frame_waiting()


class ChannelPool:
    def __init__(
        self,
        layout: KVLayout,
        config: TransferConfig,
        transports: Mapping[str, SenderTransport],
        instance_id: bytes,
        device_uuid: str,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self._layout = layout
        self._tls = tls
        self._config = config
        self._transports = transports
        self._instance_id = instance_id
        self._device_uuid = device_uuid
        self._cond = threading.Condition()
        self._idle: dict[Key, list[Channel]] = {}
        self._busy: dict[Key, int] = {}
        self._lanes: dict[Key, set[int]] = {}  # lanes of an exclusive transport's open channels, busy or idle
        self._closed = False

    def acquire(self, target: kv_pb2.KVTarget, kind: str, watch: Watch, since: float) -> Channel:
        """An idle channel of transport `kind` (held) to the target's receiver, or a new one (connect, handshake,
        pair setup). Waits for its turn on an exclusive transport. `since`: when the transfer started (see
        ensure_pair)."""
        key = (target.host, target.port, bytes(target.receiver_id), kind)
        transport = self._transports[kind]
        lanes = self._config.nccl_lanes if transport.exclusive else 0
        stale: list[Channel] = []
        try:
            with self._cond:
                while True:
                    if self._closed:
                        raise TransferFailed(FailureReason.SHUTDOWN, "the sender is closing")
                    idle, now = self._idle.get(key, []), time.monotonic()
                    while idle:
                        channel = idle.pop()
                        if channel.fresh(now):
                            self._busy[key] = self._busy.get(key, 0) + 1
                            return channel
                        stale.append(channel)
                        self._free_lane(key, channel.lane)
                    lane = self._take_lane(key, lanes)
                    if lane is not None:
                        self._busy[key] = self._busy.get(key, 0) + 1
                        break
                    self._cond.wait(self._config.poll_interval_s)
                    watch.check()
        finally:
            for channel in stale:
                channel.conn.close()
        try:
            return self._open(key, lane, target, watch, since)
        except BaseException:
            self._done(key, lane)
            raise

    def release(self, channel: Channel, reusable: bool) -> None:
        """Back to the pool after a transfer that ended with KVAck, else closed."""
        with self._cond:
            keep = reusable and not self._closed
            if keep:
                channel.transfers += 1
                channel.released_at = time.monotonic()
                self._idle.setdefault(channel.key, []).append(channel)
            else:
                self._free_lane(channel.key, channel.lane)
            self._busy[channel.key] -= 1
            self._cond.notify_all()
        if not keep:
            channel.conn.close()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            channels = [c for idle in self._idle.values() for c in idle]
            self._idle = {}
            for channel in channels:
                self._free_lane(channel.key, channel.lane)
            self._cond.notify_all()
        for channel in channels:
            channel.conn.close()

    def _done(self, key: Key, lane: int) -> None:
        """A channel that was never opened gives back its turn and its lane."""
        with self._cond:
            self._busy[key] -= 1
            self._free_lane(key, lane)
            self._cond.notify_all()

    def _take_lane(self, key: Key, lanes: int) -> int | None:
        """Under the lock: a lane for a new channel (0 for a non-exclusive transport), or None while all
        `lanes` of an exclusive one are held by open channels."""
        if not lanes:
            return 0
        held = self._lanes.setdefault(key, set())
        lane = next((n for n in range(lanes) if n not in held), None)
        if lane is not None:
            held.add(lane)
        return lane

    def _free_lane(self, key: Key, lane: int) -> None:
        """Under the lock: a closing (or never opened) channel's lane is free for the next one."""
        self._lanes.get(key, set()).discard(lane)

    def _open(self, key: Key, lane: int, target: kv_pb2.KVTarget, watch: Watch, since: float) -> Channel:
        config = self._config
        deadline = min(watch.deadline, time.monotonic() + config.connect_timeout_s)
        handshake = Watch(deadline, FailureReason.DEADLINE_EXCEEDED, "KV handshake", cancelled=watch.failure)
        timeout = max(0.001, handshake.remaining())
        try:
            sock = socket.create_connection((target.host, target.port), timeout=timeout)
        except OSError as exc:
            raise TransferFailed(
                FailureReason.CONNECT_FAILED, f"{target.host}:{target.port}: {exc}"
            ) from None
        if self._tls is not None:
            try:  # the handshake runs under the connect timeout set above
                sock = self._tls.wrap_socket(sock)
            except (OSError, ValueError) as exc:
                sock.close()
                raise TransferFailed(
                    FailureReason.CONNECT_FAILED,
                    f"TLS handshake with the KV receiver at {target.host}:{target.port} failed: {exc}",
                ) from None
        conn = FrameConnection(sock, config.poll_interval_s)
        try:
            hello = self._handshake(conn, target, key[3], lane, handshake)
            peer_id = pair_key(bytes(hello.instance_id), lane)
            self._transports[key[3]].ensure_pair(peer_id, hello.pair_ready, conn, watch, since)
        except BaseException:
            conn.close()
            raise
        idle_s = hello.idle_timeout_ms / 1000 if hello.idle_timeout_ms else config.idle_timeout_s
        return Channel(key, conn, peer_id, reuse_within_s=idle_s / 2, lane=lane)

    def _handshake(
        self, conn: FrameConnection, target: kv_pb2.KVTarget, kind: str, lane: int, watch: Watch
    ) -> kv_pb2.KVHello:
        layout = self._layout
        conn.send_frame(make_hello(layout, self._instance_id, kind, self._device_uuid, lane=lane), watch)
        try:
            reply = conn.read_frame(watch)
        except TransferFailed as exc:
            if exc.reason is not FailureReason.CONNECTION_LOST or self._tls is not None:
                raise
            raise TransferFailed(
                FailureReason.CONNECTION_LOST,
                f"the KV receiver at {target.host}:{target.port} closed the connection at the handshake "
                "(does it require TLS? the deploy config's tls.cluster)",
            ) from None
        hello = expect(reply, "hello", FailureReason.PROTOCOL_ERROR).hello
        check_hello(layout, (kind,), self._device_uuid, hello)
        if hello.instance_id != target.receiver_id:
            raise TransferFailed(
                FailureReason.UNKNOWN_HANDLE,
                f"the receiver at {target.host}:{target.port} restarted since it issued the lease",
            )
        return hello
