"""The prefill/decode pairs that requests run on now, and the KV transport of each (`tandem status`, metrics).

A disaggregated attempt opens its pair for as long as it runs (dispatch); the router's status lists every pair
with requests on it. The transport is the one router.transport_choice picks for the two workers' advertised
nodes and transports from the deployment's allowed list; the router cannot tell it (""), and says so, when a
worker advertises neither or when no list was given and the workers could use several.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from router.transport_choice import NoCommonTransport, pair_end, pair_transport
from tandem_api.tandem.v1 import admin_pb2


@dataclass(frozen=True)
class Pair:
    prefill: str
    decode: str
    transport: str  # "" when the router cannot tell
    nodes: str  # "same" | "cross" | "unknown"


def pair_of(
    prefill_id: str,
    decode_id: str,
    prefill: admin_pb2.WorkerInfo | None,
    decode: admin_pb2.WorkerInfo | None,
    allowed: Sequence[str],
) -> Pair:
    """The pair of two workers as their last polled status describes them (None: not polled yet)."""
    if prefill is None or decode is None or not prefill.node_id or not decode.node_id:
        nodes = "unknown"
    else:
        nodes = "same" if prefill.node_id == decode.node_id else "cross"
    transport = ""
    if prefill is not None and decode is not None and allowed:
        with contextlib.suppress(NoCommonTransport):  # placement never pairs them then; "" if it ever did
            transport = pair_transport(allowed, pair_end(prefill), pair_end(decode))
    return Pair(prefill_id, decode_id, transport, nodes)


class ActivePairs:
    """Pairs with requests on them now; used from the router's event loop only."""

    def __init__(self) -> None:
        self._open: Counter[Pair] = Counter()

    @contextlib.contextmanager
    def running(self, pair: Pair) -> Iterator[None]:
        self._open[pair] += 1
        try:
            yield
        finally:
            self._open[pair] -= 1
            if self._open[pair] <= 0:
                del self._open[pair]

    def to_proto(self) -> list[admin_pb2.ActivePair]:
        return [
            admin_pb2.ActivePair(
                prefill_worker_id=pair.prefill,
                decode_worker_id=pair.decode,
                kv_transport=pair.transport,
                nodes=pair.nodes,
                requests=count,
            )
            for pair, count in sorted(self._open.items(), key=lambda item: (item[0].prefill, item[0].decode))
        ]
