"""Layer streaming: hand a prompt's KV to a listener layer group by layer group while its last step runs.

A prefill worker that ships KV to a decode worker need not wait for the whole forward pass: layer l's KV of a
prompt is final once the step that computes the prompt's last chunk has run layer l. The engine calls a
request's listener during that step, after each group of layers, with a CUDA event recorded behind the group's
kernels (None on CPU, where the kernels already ran), so the transfer of the first groups overlaps the
computation of the last ones.

    engine.stream_layers(request_id, listener, groups=4)   # before the prompt's last step
    listener.layers_written(block_ids, num_tokens, layer_begin, layer_end, ready) -> bool  # engine thread

The first call that returns True makes the listener a reader of the blocks: the engine takes one reference on
each for it (BlockPool.retain), which the listener gives back once it no longer reads them (the prefill
worker: when the transfer ends). A listener that returns False is not called again. Listeners must not block.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from model_runtime.block_pool import BlockPool
from model_runtime.request import SchedulerOutput

log = logging.getLogger(__name__)


class LayerListener(Protocol):
    def layers_written(
        self, block_ids: tuple[int, ...], num_tokens: int, layer_begin: int, layer_end: int, ready: Any
    ) -> bool: ...


def group_ends(num_layers: int, groups: int) -> tuple[int, ...]:
    """The layer counts after which each of `groups` groups ends (the last is num_layers): the last layer alone,
    the others near-equal.

    Why the last layer alone: a group's transfer hides behind the layers computed after it, except the last
    group's, which only starts once the forward pass is over and so adds its whole size to the handoff's tail
    (a quarter of a 2-4k-token prompt's KV, about 100 MiB for Llama-3-8B, with four equal groups). The link
    moves a layer's KV far faster than the engine computes one (12 MiB in about 40 us against milliseconds),
    so the larger earlier groups still finish behind the compute."""
    if num_layers < 1 or groups < 1:
        raise ValueError(f"group_ends: need num_layers >= 1 and groups >= 1, got {num_layers}, {groups}")
    groups = min(groups, num_layers)
    if groups == 1:
        return (num_layers,)
    head = num_layers - 1  # the layers before the last, in groups - 1 near-equal groups
    return tuple(sorted({round(head * (g + 1) / (groups - 1)) for g in range(groups - 1)} | {num_layers}))


@dataclass
class _Stream:
    listener: LayerListener
    groups: int
    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0
    ends: tuple[int, ...] = ()
    sent_to: int = 0  # layers handed over so far
    reading: bool = False  # the listener holds its reference on the blocks


@dataclass
class LayerStreams:
    """The engine's listeners, by request id, until the step that completes each prompt."""

    pool: BlockPool
    num_layers: int
    device: torch.device
    _waiting: dict[str, _Stream] = field(default_factory=dict)

    def add(self, request_id: str, listener: LayerListener, groups: int) -> None:
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
            raise ValueError(f"stream_layers: groups must be an integer >= 1, got {groups!r}")
        self._waiting[request_id] = _Stream(listener, groups)

    def drop(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)

    def hook_for(self, out: SchedulerOutput) -> Callable[[int], None] | None:
        """The layer hook of a step that completes some listened-to prompts (their listeners leave the table:
        one step streams), or None."""
        if not self._waiting:
            return None
        active = []
        for chunk in out.chunks:
            request = chunk.request
            if not chunk.sample or request.num_output_tokens:
                continue
            stream = self._waiting.pop(request.request_id, None)
            if stream is not None:
                stream.block_ids = tuple(request.block_ids)
                stream.num_tokens = request.num_prompt_tokens
                stream.ends = group_ends(self.num_layers, stream.groups)
                active.append(stream)
        if not active:
            return None
        return lambda n: self._after_layer(active, n)

    def _after_layer(self, active: list[_Stream], n: int) -> None:
        due = [s for s in active if n in s.ends and s.sent_to < n]
        if not due:
            return
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        for stream in due:
            begin, stream.sent_to = stream.sent_to, n
            try:
                taken = stream.listener.layers_written(stream.block_ids, stream.num_tokens, begin, n, ready)
            except Exception:  # a listener's bug must not fail the step of every prompt in it
                log.exception("layer listener failed; it gets no more layers (and keeps what it holds)")
                active.remove(stream)
                continue
            if not taken:
                active.remove(stream)
                continue
            if not stream.reading:
                self.pool.retain(stream.block_ids)
                stream.reading = True
