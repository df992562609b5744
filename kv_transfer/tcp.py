"""tcp transport: a part's bytes travel as chunks on the control socket.

The sender gathers one layer at a time, `cache[l, :, src_ids]` (index_select on the block dimension), into a
contiguous staging tensor and writes its bytes through a uint8 view, so any dtype (bfloat16 included) travels
bit-exact. The receiver reads each layer into its own staging tensor (recv_into) and scatters it into its own
block ids with index_copy_. Layer by layer keeps staging memory at one layer of one request, and the byte order
is exactly that of `cache[l0:l1, :, ids]` (KVLayout.staging_shape). CUDA caches work too (staged through host
memory), which is slow but keeps every transport's protocol runnable without NCCL.
"""

from __future__ import annotations

import torch

from kv_transfer.config import TransferConfig
from kv_transfer.contracts import FailureReason, TransferFailed
from kv_transfer.frames import frame_failure
from kv_transfer.transport import PartJob, ReceiverTransport, SenderTransport, part_frame
from model_runtime.kv_layout import KVLayout


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable and zero-copy, whatever its dtype."""
    return tensor.view(torch.uint8).reshape(-1).numpy().data


def _heads(layers: torch.Tensor, heads: tuple[int, int] | None) -> torch.Tensor:
    """A view of `heads` (begin, count) of cache layers [L, 2, N, B, H, D]; the layers themselves for None."""
    if heads is None:
        return layers
    begin, count = heads
    return layers[:, :, :, :, begin : begin + count]


class TcpSenderTransport(SenderTransport):
    def __init__(self, layout: KVLayout, cache: torch.Tensor, config: TransferConfig) -> None:
        self._layout = layout
        self._cache = cache
        self._chunk_bytes = config.chunk_bytes

    def send_part(self, job: PartJob) -> None:
        if job.ready is not None:
            job.ready.synchronize()
        ids = torch.tensor(job.block_ids, dtype=torch.long, device=self._cache.device)
        job.conn.send_frame(part_frame(job), job.watch)
        job.conn.start_data(job.num_bytes)
        sent = 0
        for layer in range(job.layer_begin, job.layer_end):
            cache = _heads(self._cache[layer : layer + 1], job.heads)[0]
            staging = torch.index_select(cache, 1, ids).cpu()  # [2, n, B, H, D] (H: the window's), contiguous
            data = _byte_view(staging)
            for offset in range(0, len(data), self._chunk_bytes):
                self._between_chunks(job)
                chunk = data[offset : offset + self._chunk_bytes]
                job.conn.send_chunk(chunk, job.watch)
                sent += len(chunk)
                if job.progress is not None:
                    job.progress(sent)

    @staticmethod
    def _between_chunks(job: PartJob) -> None:
        """Stop on our own deadline or abort, and on anything the receiver said (it only speaks to refuse or
        abort while we stream)."""
        job.watch.check()
        if job.conn.frame_waiting():
            frame = job.conn.read_frame(job.watch)
            failure = frame_failure(frame, FailureReason.RECEIVER_ABORTED)
            raise failure or TransferFailed(
                FailureReason.PROTOCOL_ERROR, f"unexpected {frame.WhichOneof('body')} frame while streaming"
            )


class TcpReceiverTransport(ReceiverTransport):
    def __init__(self, layout: KVLayout, cache: torch.Tensor, config: TransferConfig) -> None:
        self._layout = layout
        self._cache = cache

    def receive_part(self, job: PartJob) -> None:
        ids = torch.tensor(job.block_ids, dtype=torch.long, device=self._cache.device)
        one_layer = job.layout(self._layout).staging_shape(len(job.block_ids), (0, 1))
        staging = torch.empty(one_layer, dtype=self._cache.dtype)
        view = _byte_view(staging)
        for layer in range(job.layer_begin, job.layer_end):
            self._read_layer(job, view)
            job.watch.check()  # a lease cancelled while we read gets no write
            source = staging.to(self._cache.device) if self._cache.device.type != "cpu" else staging
            _heads(self._cache[layer : layer + 1], job.heads).index_copy_(2, ids, source)
        if self._cache.device.type == "cuda":
            torch.cuda.synchronize(self._cache.device)  # the contract: no write pending on return

    @staticmethod
    def _read_layer(job: PartJob, view: memoryview) -> None:
        got = 0
        while got < len(view):
            length = job.conn.read_chunk_length(job.watch)
            if length == 0:  # the sender stopped streaming; its KVAbort frame says why
                frame = job.conn.read_frame(job.watch)
                raise frame_failure(frame, FailureReason.SENDER_ABORTED) or TransferFailed(
                    FailureReason.PROTOCOL_ERROR, "data stream ended without a KVAbort frame"
                )
            if length > len(view) - got:
                raise TransferFailed(
                    FailureReason.PROTOCOL_ERROR,
                    f"chunk of {length} bytes overruns the layer ({len(view) - got} left)",
                )
            job.conn.recv_into(view[got : got + length], job.watch)
            got += length
