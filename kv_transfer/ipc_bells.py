"""The cuda_ipc transport's doorbells, pair by pair: what each side keeps of kv_transfer.doorbell's pages.

    sender    SenderBells: the receiver's page opened and pinned (open), our ids written into an armed slot
              (honor), the slot rung from our GPU behind each layer group's event (ring)
    receiver  ReceiverBells: a page per pair with a stream per slot and the copy kernel loaded (pair), leases
              armed (arm), ended (release) or landed (ArmedSink)

The copies themselves are the transport's (`Pull`: its pull of a layer range from the sender's mapped cache),
so the receiver stays the only writer of its cache.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kv_transfer import doorbell
from kv_transfer.contracts import FailureReason, TransferFailed
from kv_transfer.cuda_events import bind_device
from kv_transfer.doorbell import Armed, Geometry, Page, PinnedPage, SlotTable
from kv_transfer.frames import FrameConnection, Watch
from kv_transfer.gpu_ops import GpuOps
from kv_transfer.transport import PartJob, PartSink
from tandem_api.tandem.v1 import kv_pb2

log = logging.getLogger(__name__)

# Queue on `stream` (the current one) the pull of layers [begin, end) of the sender's blocks src_ids into ours.
Pull = Callable[[int, int, Any, Any, Any], None]  # (begin, end, src_ids, dst_ids, stream)


@dataclass
class _SenderBell:
    page: PinnedPage
    stream: Any  # ours, the driver's (never one of torch's pooled streams)


class SenderBells:
    """The receivers' pages a sender holds, by pair."""

    def __init__(self, device: torch.device, ops: GpuOps) -> None:
        self._device, self._ops = device, ops
        self._lock = threading.Lock()
        self._bells: dict[bytes, _SenderBell] = {}

    def open(self, peer_id: bytes, message: kv_pb2.KVDoorbell) -> None:
        """Pin the receiver's doorbell page; without it (no driver support, a page we cannot open) this pair's
        armed targets are sent as unarmed ones."""
        ops = doorbell.mem_ops()
        if ops is None or not self._ops.raw:
            return
        page = pinned = None
        try:
            bind_device(self._device)
            page = Page.open(message.shm_name, Geometry(message.slots, message.capacity))
            pinned = PinnedPage(page, ops)
            bell = _SenderBell(pinned, ops.new_stream(self._device))
        except Exception as exc:  # a doorbell is an optimization: the pair works without one
            if pinned is not None:
                pinned.close()
            elif page is not None:
                page.close()
            log.warning("KV doorbell of a cuda_ipc pair not usable, sending unarmed: %s", exc)
            return
        with self._lock:
            old = self._bells.pop(peer_id, None)
            self._bells[peer_id] = bell
        if old is not None:
            old.page.close()

    def honor(self, peer_id: bytes, armed: kv_pb2.KVArmed, block_ids: tuple[int, ...]) -> int:
        """Write our block ids into the armed slot of this pair's page: the generation the transfer then rings,
        or 0 when it cannot (no page for this pair, a slot or id count out of its range)."""
        with self._lock:
            bell = self._bells.get(peer_id)
        if bell is None or armed.generation < 1 or armed.generation > doorbell.MAX_GENERATION:
            return 0
        geometry = bell.page.page.geometry
        if armed.slot >= geometry.slots or len(block_ids) > geometry.capacity:
            return 0
        bell.page.page.write_ids(geometry.src(armed.slot), block_ids)
        return armed.generation

    def ring(self, peer_id: bytes, slot: int, generation: int, layer_end: int, ready: Any) -> None:
        """Ring the slot from our GPU once layers [0, layer_end) are written (behind `ready`, a CUDA event, or
        at once for None): no host wait."""
        with self._lock:
            bell = self._bells.get(peer_id)
        ops = doorbell.mem_ops()
        if bell is None or ops is None:
            raise TransferFailed(FailureReason.INTERNAL, "an armed transfer lost its doorbell")
        if ready is not None:
            self._ops.wait(bell.stream, ready)
        address = bell.page.address(bell.page.page.geometry.bell(slot))
        ops.write(bell.stream.cuda_stream, address, doorbell.bell_value(generation, layer_end))

    def close(self) -> None:
        ops = doorbell.mem_ops()
        with self._lock:
            bells, self._bells = list(self._bells.values()), {}
        for bell in bells:  # rings still queued write into the page: let them land first
            bell.stream.synchronize()
            if ops is not None:
                ops.destroy_stream(bell.stream)
            bell.page.close()


@dataclass
class _ReceiverBell:
    page: PinnedPage
    slots: SlotTable
    streams: list[Any]  # one per slot, each the driver's own (kv_transfer.doorbell)
    stopped: bool = False  # its sender does not take slots up: arm nothing more (stop_arming)


class ReceiverBells:
    """A receiver's doorbell pages, by pair, and the leases armed on them."""

    def __init__(
        self, device: torch.device, ops: GpuOps, slots: int, capacity: int, group_ends: tuple[int, ...]
    ) -> None:
        self._device, self._ops = device, ops
        self._slots, self._capacity, self._group_ends = slots, capacity, group_ends
        self._lock = threading.Lock()
        self._bells: dict[bytes, _ReceiverBell] = {}
        self._outstanding: dict[tuple[bytes, int], Armed] = {}  # armed and not yet landed or released

    def pair(self, peer_id: bytes, pull: Pull) -> kv_pb2.KVDoorbell | None:
        """This pair's page (made on its first setup) as the sender is told of it; None when doorbells are off
        or cannot work here."""
        with self._lock:
            bell = self._bells.get(peer_id)
        if bell is None:
            bell = self._new_bell(peer_id, pull)
        if bell is None:
            return None
        geometry = bell.page.page.geometry
        return kv_pb2.KVDoorbell(
            shm_name=bell.page.page.name, slots=geometry.slots, capacity=geometry.capacity
        )

    def _new_bell(self, peer_id: bytes, pull: Pull) -> _ReceiverBell | None:
        """The page, its slots' streams, and the copy kernel loaded (its first launch must not come after an
        armed wait: kv_transfer.doorbell)."""
        ops = doorbell.mem_ops()
        if self._slots == 0 or ops is None or not self._ops.raw:
            return None
        page = pinned = None
        streams: list[Any] = []
        try:
            bind_device(self._device)
            page = Page.create(Geometry(self._slots, self._capacity))
            pinned = PinnedPage(page, ops)
            streams = [ops.new_stream(self._device) for _ in range(self._slots)]
            geometry = page.geometry
            with torch.cuda.stream(streams[0]):  # block 0 (padding only) onto our block 0
                pull(
                    0,
                    1,
                    pinned.ids_pointer(geometry.src(0), 1),
                    pinned.ids_pointer(geometry.dst(0), 1),
                    streams[0],
                )
            streams[0].synchronize()
        except Exception as exc:  # a doorbell is an optimization: the pair works without one
            for stream in streams:
                ops.destroy_stream(stream)
            if pinned is not None:
                pinned.close()
            elif page is not None:
                page.close()
            log.warning("KV doorbell for a cuda_ipc pair not set up, leases go unarmed: %s", exc)
            return None
        bell = _ReceiverBell(pinned, SlotTable(self._slots), streams)
        with self._lock:
            self._bells[peer_id] = bell
        return bell

    def arm(self, peer_id: bytes, block_ids: tuple[int, ...], pull: Pull) -> Armed | None:
        """Queue a lease's copies behind a free slot of this pair's page; None when the pair has no page, no
        free slot, or the lease is longer than a slot holds (the lease then goes unarmed)."""
        with self._lock:
            bell = self._bells.get(peer_id)
        ops = doorbell.mem_ops()
        if bell is None or bell.stopped or ops is None:
            return None
        geometry, n = bell.page.page.geometry, len(block_ids)
        if not 0 < n <= geometry.capacity or (taken := bell.slots.take()) is None:
            return None
        slot, generation = taken
        page, stream = bell.page.page, bell.streams[slot]
        page.write_ids(geometry.dst(slot), block_ids)
        page.write_ids(geometry.src(slot), [0] * n)  # until the sender writes its own: block 0, padding
        src_ids = bell.page.ids_pointer(geometry.src(slot), n)
        dst_ids = bell.page.ids_pointer(geometry.dst(slot), n)
        armed = Armed(peer_id, slot, generation, n, bell.page, bell.slots, stream)
        bind_device(self._device)
        try:
            with torch.cuda.stream(stream):
                doorbell.queue_chain(
                    ops,
                    bell.page,
                    stream,
                    slot,
                    generation,
                    self._group_ends,
                    lambda begin, end: pull(begin, end, src_ids, dst_ids, stream),
                )
        except Exception as exc:  # a part of the chain may be queued: end it, and never use the slot again
            page.words[geometry.bell(slot)] = doorbell.bell_value(generation, doorbell.ALL_LAYERS)
            stream.synchronize()
            bell.slots.retire(slot)
            log.warning("arming a KV lease failed, it goes unarmed: %s: %s", type(exc).__name__, exc)
            return None
        with self._lock:
            self._outstanding[(peer_id, slot)] = armed
        return armed

    def stop_arming(self, peer_id: bytes) -> None:
        """The sender left an armed slot unused (it could not open or pin the page): arm nothing more for it, so
        that its transfers are not copied twice (the released chain's copy, then the frames')."""
        with self._lock:
            bell = self._bells.get(peer_id)
            if bell is None or bell.stopped:
                return
            bell.stopped = True
        log.warning("a cuda_ipc sender does not take up its doorbell: its leases go unarmed from now on")

    def release(self, armed: Armed, reusable: bool) -> bool:
        """End an armed lease's chain and wait for its copies (kv_transfer.doorbell.release). The slot is free
        again at once if `reusable` (its sender can no longer write into it), else after a quarantine
        (doorbell.SlotTable). False: the copies did not end (the slot is retired)."""
        ended = doorbell.release(armed)
        slots = self._settle(armed)
        if not ended:
            slots.retire(armed.slot)
        elif reusable:
            slots.put(armed.slot)
        else:
            slots.quarantine(armed.slot)
        return ended

    def landed(self, armed: Armed) -> None:
        self._settle(armed).put(armed.slot)

    def _settle(self, armed: Armed) -> SlotTable:
        with self._lock:
            self._outstanding.pop((armed.peer_id, armed.slot), None)
        return armed.slots

    def sink(self, armed: Armed) -> PartSink:
        return ArmedSink(self, armed)

    def close(self) -> None:
        with self._lock:
            outstanding = list(self._outstanding.values())
        for armed in outstanding:  # no armed wait may outlive its page
            self.release(armed, reusable=False)
        ops = doorbell.mem_ops()
        with self._lock:
            bells, self._bells = list(self._bells.values()), {}
        for bell in bells:
            for stream in bell.streams:
                stream.synchronize()
                if ops is not None:
                    ops.destroy_stream(stream)
            bell.page.close()


class ArmedSink(PartSink):
    """An armed lease's transfer: its copies were queued at reservation and run as the sender rings; the parts'
    frames only account for the layers (the session checks that every layer was announced)."""

    def __init__(self, bells: ReceiverBells, armed: Armed) -> None:
        self._bells, self._armed = bells, armed

    def part(self, job: PartJob) -> None:
        pass

    def finish(self, watch: Watch, conn: FrameConnection) -> None:
        doorbell.wait_landed(self._armed, watch)
        self._bells.landed(self._armed)

    def abandon(self) -> None:
        # The sender claimed the lease, so it wrote its ids before KVBegin: the slot may be armed again.
        if not self._bells.release(self._armed, reusable=True):
            raise TransferFailed(FailureReason.INTERNAL, "an armed KV copy did not end")
