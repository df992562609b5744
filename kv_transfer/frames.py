"""The wire: length-prefixed KVFrame protobufs and raw data chunks on one TCP socket (TLS-wrapped or not).

    frame:  | "TKV1" | u32 length (big-endian) | KVFrame bytes |
    chunk:  | u32 length | length raw bytes |          (length 0: a KVAbort frame follows instead of data)

Every blocking call wakes each poll interval to run `Watch.check()`, so a deadline, an abort or a closing
owner ends the call within one interval: nothing waits on a dead or stalled peer forever. A connection is used
by one thread at a time (the session that owns it), so it needs no lock.

Frames cost a handoff's critical path a system call (and, behind a busy engine loop, a wait for the interpreter
lock) each, so they are batched both ways: a writer may defer a frame (defer_frame) to go out with the next one
it sends, and a reader takes whatever the socket holds (up to READ_AHEAD bytes) into a buffer that the next
frames, and a tcp part's first data bytes, are read from.
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import struct
import time
from collections.abc import Callable

from google.protobuf.message import DecodeError

from kv_transfer.contracts import FailureReason, TransferFailed
from tandem_api.tandem.v1 import kv_pb2

MAGIC = b"TKV1"
FRAME_HEADER = struct.Struct(">4sI")
CHUNK_HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 4 * 2**20  # a frame is control data; the largest (cuda_ipc block ids) is far below this
READ_AHEAD = 64 * 2**10  # what one read of a frame may take from the socket beyond it


def failure_to_proto(reason: FailureReason) -> kv_pb2.KVFailure:
    code: kv_pb2.KVFailure = getattr(kv_pb2, "KV_FAILURE_" + reason.name)
    return code


def failure_from_proto(code: int) -> FailureReason:
    try:
        return FailureReason[kv_pb2.KVFailure.Name(code).removeprefix("KV_FAILURE_")]
    except (ValueError, KeyError):
        return FailureReason.PROTOCOL_ERROR


def encode_frame(frame: kv_pb2.KVFrame) -> bytes:
    payload = frame.SerializeToString()
    if len(payload) > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {len(payload)} bytes exceeds MAX_FRAME_BYTES={MAX_FRAME_BYTES}")
    return FRAME_HEADER.pack(MAGIC, len(payload)) + payload


def decode_frame_length(header: bytes) -> int:
    magic, length = FRAME_HEADER.unpack(header)
    if magic != MAGIC:
        raise TransferFailed(FailureReason.PROTOCOL_ERROR, f"bad frame magic {magic!r} (not a KV peer?)")
    if length > MAX_FRAME_BYTES:
        raise TransferFailed(FailureReason.PROTOCOL_ERROR, f"frame length {length} exceeds {MAX_FRAME_BYTES}")
    return length


def decode_frame(payload: bytes) -> kv_pb2.KVFrame:
    frame = kv_pb2.KVFrame()
    try:
        frame.ParseFromString(payload)
    except DecodeError as exc:
        raise TransferFailed(FailureReason.PROTOCOL_ERROR, f"undecodable frame: {exc}") from None
    if frame.WhichOneof("body") is None:
        raise TransferFailed(FailureReason.PROTOCOL_ERROR, "frame has no body")
    return frame


def error_frame(reason: FailureReason, message: str, drained: bool = False) -> kv_pb2.KVFrame:
    error = kv_pb2.KVError(code=failure_to_proto(reason), message=message, drained=drained)
    return kv_pb2.KVFrame(error=error)


def abort_frame(reason: FailureReason, message: str) -> kv_pb2.KVFrame:
    return kv_pb2.KVFrame(abort=kv_pb2.KVAbort(reason=failure_to_proto(reason), message=message))


def frame_failure(frame: kv_pb2.KVFrame, default: FailureReason) -> TransferFailed | None:
    """The failure a peer's KVError / KVAbort frame reports, or None for any other frame."""
    kind = frame.WhichOneof("body")
    if kind == "error":
        return TransferFailed(
            failure_from_proto(frame.error.code) if frame.error.code else default,
            f"peer: {frame.error.message}",
            drained=frame.error.drained,
        )
    if kind == "abort":
        return TransferFailed(
            failure_from_proto(frame.abort.reason) if frame.abort.reason else default,
            f"peer aborted: {frame.abort.message}",
        )
    return None


def expect(frame: kv_pb2.KVFrame, kind: str, peer_failure: FailureReason) -> kv_pb2.KVFrame:
    """The frame if its body is `kind`; a peer's error or abort raises what it reports, anything else is a
    protocol error."""
    got = frame.WhichOneof("body")
    if got == kind:
        return frame
    failure = frame_failure(frame, peer_failure)
    if failure is not None:
        raise failure
    raise TransferFailed(FailureReason.PROTOCOL_ERROR, f"expected a {kind} frame, got {got}")


class Watch:
    """A deadline and an optional cancellation probe that every blocking loop checks each poll interval."""

    def __init__(
        self,
        deadline: float,
        expired: FailureReason,
        what: str,
        cancelled: Callable[[], TransferFailed | None] | None = None,
    ) -> None:
        self.deadline = deadline
        self._expired = expired
        self._what = what
        self._cancelled = cancelled

    def check(self) -> None:
        if self._cancelled is not None:
            failure = self._cancelled()
            if failure is not None:
                raise failure
        if time.monotonic() > self.deadline:
            raise TransferFailed(self._expired, f"{self._what}: deadline passed")

    def failure(self) -> TransferFailed | None:
        """What check() would raise, as a value (lets one watch serve as another's cancellation probe)."""
        try:
            self.check()
        except TransferFailed as failure:
            return failure
        return None

    def remaining(self) -> float:
        return self.deadline - time.monotonic()


class FrameConnection:
    def __init__(self, sock: socket.socket, poll_interval_s: float) -> None:
        self.sock = sock
        sock.settimeout(poll_interval_s)
        with contextlib.suppress(OSError):  # not a TCP socket (e.g. a socketpair in tests)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._chunk = bytearray(CHUNK_HEADER.size)
        self._data_left = 0  # bytes of the current tcp part still to send
        self._chunk_open = False  # a chunk is partly written: only closing can end the stream now
        self._deferred: list[bytes] = []  # encoded frames that go out with the next send
        self._rbuf = bytearray(READ_AHEAD)  # bytes read off the socket and not taken yet: [_rstart, _rend)
        self._rstart = self._rend = 0

    # --- frames ----------------------------------------------------------------------------------------
    def send_frame(self, frame: kv_pb2.KVFrame, watch: Watch) -> None:
        self.send_bytes(memoryview(encode_frame(frame)), watch)

    def defer_frame(self, frame: kv_pb2.KVFrame) -> None:
        """Queue `frame` to go out, in order, with the next send (a frame, a chunk, or flush())."""
        self._deferred.append(encode_frame(frame))

    def flush(self, watch: Watch) -> None:
        """Write the deferred frames now (before waiting on anything the peer would do after reading them)."""
        if self._deferred:
            self.send_bytes(memoryview(b""), watch)

    def read_frame(self, watch: Watch) -> kv_pb2.KVFrame:
        length = decode_frame_length(self._take(FRAME_HEADER.size, watch))
        return decode_frame(self._take(length, watch))

    def frame_waiting(self) -> bool:
        """True when the peer sent something (or closed): the sender checks this between data chunks."""
        if self._rend > self._rstart:
            return True  # already read off the socket
        if isinstance(self.sock, ssl.SSLSocket) and self.sock.pending():
            return True  # decrypted bytes already read off the socket: poll() would not see them
        poller = select.poll()
        poller.register(self.sock, select.POLLIN | select.POLLERR | select.POLLHUP)
        return bool(poller.poll(0))

    def send_abort(self, failure: TransferFailed, watch: Watch) -> bool:
        """Tell the peer why we stop, if the stream allows: at a frame boundary a KVAbort frame; inside a
        part's data (between chunks) a zero-length chunk first. False when a chunk is half written (the
        caller just closes) or the peer does not take the frame before `watch` ends."""
        if self._chunk_open:
            return False
        try:
            if self._data_left:
                self.send_bytes(memoryview(CHUNK_HEADER.pack(0)), watch)
                self._data_left = 0
            self.send_frame(abort_frame(failure.reason, failure.message), watch)
        except TransferFailed:
            return False
        return True

    # --- data chunks -----------------------------------------------------------------------------------
    def start_data(self, num_bytes: int) -> None:
        """A part's raw bytes follow on this connection (tcp)."""
        self._data_left = num_bytes

    def send_chunk(self, data: memoryview, watch: Watch) -> None:
        if not 0 < len(data) <= self._data_left:
            raise ValueError(f"chunk of {len(data)} bytes with {self._data_left} bytes of the part left")
        self._chunk_open = True
        self.send_bytes(memoryview(CHUNK_HEADER.pack(len(data))), watch)
        self.send_bytes(data, watch)
        self._chunk_open = False
        self._data_left -= len(data)

    def read_chunk_length(self, watch: Watch) -> int:
        self.recv_into(memoryview(self._chunk), watch)
        (length,) = CHUNK_HEADER.unpack(self._chunk)
        return int(length)

    # --- raw bytes -------------------------------------------------------------------------------------
    def send_bytes(self, data: memoryview, watch: Watch) -> None:
        if self._deferred:  # the deferred frames go first, in the same write when the data is small
            head = b"".join(self._deferred)
            self._deferred.clear()
            if len(data) <= READ_AHEAD:
                data = memoryview(head + data)
            else:
                self.send_bytes(memoryview(head), watch)
        sent = 0
        while sent < len(data):
            try:
                sent += self.sock.send(data[sent:])
            except TimeoutError:
                watch.check()
            except OSError as exc:
                raise TransferFailed(FailureReason.CONNECTION_LOST, f"send failed: {exc}") from None

    def recv_into(self, view: memoryview, watch: Watch) -> None:
        """Fill `view`: first from what earlier reads took off the socket, then straight from the socket."""
        got = min(len(view), self._rend - self._rstart)
        if got:
            view[:got] = self._rbuf[self._rstart : self._rstart + got]
            self._rstart += got
        while got < len(view):
            got += self._recv(view[got:], watch)

    def _take(self, n: int, watch: Watch) -> bytes:
        """The next n bytes, read through the buffer: one read brings in whatever else the peer sent."""
        have = self._rend - self._rstart
        if have < n:
            if self._rstart:  # keep what is left at the front
                self._rbuf[:have] = self._rbuf[self._rstart : self._rend]
                self._rstart, self._rend = 0, have
            if len(self._rbuf) < n:
                self._rbuf.extend(bytes(n - len(self._rbuf)))
            while self._rend < n:
                self._rend += self._recv(memoryview(self._rbuf)[self._rend :], watch)
            if len(self._rbuf) > READ_AHEAD and self._rend <= READ_AHEAD:
                del self._rbuf[READ_AHEAD:]  # a large frame passed: give its room back
        out = bytes(self._rbuf[self._rstart : self._rstart + n])
        self._rstart += n
        if self._rstart == self._rend:
            self._rstart = self._rend = 0
        return out

    def _recv(self, view: memoryview, watch: Watch) -> int:
        while True:
            try:
                n = self.sock.recv_into(view)
            except TimeoutError:
                watch.check()
                continue
            except OSError as exc:
                raise TransferFailed(FailureReason.CONNECTION_LOST, f"receive failed: {exc}") from None
            if n == 0:
                raise TransferFailed(FailureReason.CONNECTION_LOST, "peer closed the connection")
            return n

    def close(self, grace_s: float = 0.0) -> None:
        """Close; with a grace period, first stop writing and discard what the peer still sends (until it
        closes or the grace ends), so our last frame is not lost to a TCP reset."""
        if grace_s > 0:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_WR)
                end = time.monotonic() + grace_s
                while time.monotonic() < end:
                    try:
                        if not self.sock.recv(1 << 16):
                            break
                    except TimeoutError:
                        continue
        with contextlib.suppress(OSError):
            self.sock.close()
