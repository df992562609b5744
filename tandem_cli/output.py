"""What `tandem` prints and writes: one JSON line per request, atomic result files, the status table."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from tandem_client.types import ClusterStatus, GenerationResult, PoolInfo, TokenLogprob


@dataclass(frozen=True)
class OutputRecord:
    """One request's outcome as `tandem generate --json` reports it, whichever way it was produced."""

    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    # Only when --logprobs was given: one entry per output token.
    logprobs: tuple[TokenLogprob, ...] | None = None
    # Only when --prompt-logprobs was given: one entry per prompt token after the first.
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None

    @classmethod
    def from_result(
        cls, result: GenerationResult, with_logprobs: bool, with_prompt_logprobs: bool = False
    ) -> OutputRecord:
        return cls(
            prompt_token_ids=result.prompt_token_ids,
            token_ids=result.token_ids,
            text=result.text,
            finish_reason=str(result.finish_reason),
            logprobs=result.logprobs if with_logprobs else None,
            prompt_logprobs=result.prompt_logprobs if with_prompt_logprobs else None,
        )

    def to_json(self) -> str:
        """{"prompt_token_ids", "token_ids", "text", "finish_reason"[, "logprobs"][, "prompt_logprobs"]} on one
        line."""
        record: dict[str, object] = {
            "prompt_token_ids": list(self.prompt_token_ids),
            "token_ids": list(self.token_ids),
            "text": self.text,
            "finish_reason": self.finish_reason,
        }
        if self.logprobs is not None:
            record["logprobs"] = [asdict(lp) for lp in self.logprobs]
        if self.prompt_logprobs is not None:
            record["prompt_logprobs"] = [asdict(lp) for lp in self.prompt_logprobs]
        return json.dumps(record, ensure_ascii=False)


def write_atomic(path: str, lines: Iterable[str]) -> None:
    """Write lines to path via a temp file in the same directory and a rename: readers see the old file or
    the whole new one, and an error leaves no partial file behind."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for line in lines:
                f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


_COLUMNS = (
    "WORKER", "ROLE", "STATE", "ADDRESS", "DEVICES", "KV BLOCKS", "RUNNING", "WAITING", "LEASES", "HEARTBEAT", "NODE",
    "KV VIA",
)  # fmt: skip
NODE_CHARS = 12  # a Ray node id has 56 hex digits; its first 12 tell a cluster's nodes apart (--json has all)


def status_table(status: ClusterStatus) -> str:
    """A plain-text table, one row per worker, plus the router's queue line."""
    rows = [
        (
            w.worker_id,
            str(w.role),
            str(w.state),
            w.address,
            str(w.devices or "-"),
            f"{w.kv_blocks_used}/{w.kv_blocks_total}",
            str(w.running_requests),
            str(w.waiting_requests),
            str(w.active_leases),
            f"{w.last_heartbeat_age_seconds:.1f}s",
            w.node_id[:NODE_CHARS] or "-",
            ",".join(w.kv_transports) or "-",
        )
        for w in status.workers
    ]
    widths = [max(len(cell) for cell in column) for column in zip(_COLUMNS, *rows)]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in [_COLUMNS, *rows]
    ]
    if not rows:
        lines.append("(no workers)")
    router = status.router
    lines.append(f"router: {router.queued_requests} queued, {router.in_flight_requests} in flight")
    for pair in router.active_pairs:
        nodes = {"same": "one node", "cross": "two nodes"}.get(pair.nodes, "nodes unknown")
        lines.append(
            f"  {pair.prefill_worker_id} -> {pair.decode_worker_id}: KV via {pair.kv_transport or 'unknown'}, "
            f"{nodes}, {pair.requests} request{'s' if pair.requests != 1 else ''}"
        )
    if status.pools:
        lines += ["", pools_table(status.pools)]
    if status.autoscaler:
        lines.append(f"autoscaler: {status.autoscaler}")
    return "\n".join(lines)


_POOL_COLUMNS = ("POOL", "TARGET", "READY", "STARTING", "DRAINING")


def pools_table(pools: Iterable[PoolInfo]) -> str:
    """One row per pool: the size asked for (`tandem scale`) and where its workers are; below the table, why
    workers that start are not placed yet."""
    pools = list(pools)
    rows = [(str(p.role), str(p.target), str(p.ready), str(p.starting), str(p.draining)) for p in pools]
    widths = [max(len(cell) for cell in column) for column in zip(_POOL_COLUMNS, *rows)]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
        for row in [_POOL_COLUMNS, *rows]
    ]
    lines += [f"{p.role} not placed: {p.waiting}" for p in pools if p.waiting]
    return "\n".join(lines)


def status_json(status: ClusterStatus) -> str:
    """The status as one JSON object (enums as their lowercase names)."""
    return json.dumps(asdict(status))
