"""bench/disagg_vs_colocated.py's workloads: the length distributions and rates of each, the traces that the
mixed and chat workloads write per point, and --rates (a sweep for every workload or for one)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from tandem_cli.bench import parse_dist


@dataclass(frozen=True)
class Workload:
    input_len: str
    output_len: str
    rates: tuple[float, ...]  # requests/s, swept in order
    mixed: bool = False  # draw each request from prefill-heavy or decode-heavy (a trace written per run)
    shared_prefix: int = 0  # tokens every prompt starts with (one system prompt), before its input_len
    chat: bool = False  # multi-turn conversations (chat_trace): input_len is a user turn, output_len a reply
    concurrency: int = 0  # > 0: one closed-loop run with this many requests in flight instead of a rate sweep


PREFILL_HEAVY = ("uniform:2048:4096", "uniform:128:256")
DECODE_HEAVY = ("256", "512")
WORKLOADS = {
    "prefill-heavy": Workload(*PREFILL_HEAVY, rates=(0.5, 1, 1.5, 2, 3, 4, 5, 6, 8)),
    "decode-heavy": Workload(*DECODE_HEAVY, rates=(1, 2, 4, 6, 8, 10, 12, 16, 20)),
    "mixed": Workload("-", "-", rates=(0.5, 1, 2, 3, 4, 5, 6, 8, 10), mixed=True),
    # A chat application: one 2k-token system prompt, then each user's own 128-512 tokens.
    "shared-prefix": Workload(
        "uniform:128:512", "uniform:64:128", rates=(1, 2, 4, 6, 8, 10, 12), shared_prefix=2048
    ),
    # Conversations behind one 2k-token system prompt: each turn resends the conversation so far plus a new user
    # message (64-256 tokens) and gets a 64-256-token reply; CHAT_TURNS turns, CHAT_SESSIONS at a time.
    "chat": Workload(
        "uniform:64:256", "uniform:64:256", rates=(1, 2, 4, 6, 8, 10, 12, 16), shared_prefix=2048, chat=True
    ),
    # The nightly batch job (issue 20): 200 summaries in flight, closed loop; only output tokens/s counts.
    "batch": Workload("uniform:1536:3072", "uniform:200:400", rates=(), concurrency=200),
}
SMOKE_WORKLOADS = {
    "prefill-heavy": Workload("uniform:96:160", "uniform:4:8", rates=(1, 2)),
    "decode-heavy": Workload("16", "16", rates=(1, 2)),
    "mixed": Workload("-", "-", rates=(1, 2), mixed=True),
    "shared-prefix": Workload("uniform:8:24", "uniform:4:8", rates=(1, 2), shared_prefix=128),
    "chat": Workload("uniform:8:24", "uniform:4:8", rates=(1, 2), shared_prefix=128, chat=True),
    "batch": Workload("uniform:48:96", "uniform:4:8", rates=(), concurrency=4),
}
# Conversations interleaved turn by turn, so a session's next turn comes about CHAT_SESSIONS arrivals later.
CHAT_SESSIONS = 32
CHAT_TURNS = 8  # turns of a conversation; then that session starts a new one
CHAT_IDS = (5000, 40000)  # token ids of chat prompts: inside every served vocabulary's safe range (the dummy
# Llama-3's 128k and the embedded SmolLM2's 49k: bench's safe_id_range keeps the middle 80%)
SMOKE_MIX = (("uniform:96:160", "uniform:4:8"), ("16", "16"))
MAX_RATE = 100.0  # point_seed keeps rate x 100 below 10,000


def mixed_trace(path: Path, count: int, seed: int, mix: tuple = (PREFILL_HEAVY, DECODE_HEAVY)) -> None:
    """count requests, each from the first or the second (input, output) pair of `mix` with probability 1/2."""
    rng = random.Random(f"mixed-{seed}")
    dists = [tuple(parse_dist(t, "--workloads") for t in pair) for pair in mix]
    lines = []
    for _ in range(count):
        n_in, n_out = rng.choice(dists)
        lines.append(json.dumps({"input_len": n_in.sample(rng), "output_len": n_out.sample(rng)}))
    path.write_text("\n".join(lines) + "\n")


def chat_trace(path: Path, count: int, seed: int, workload: Workload) -> None:
    """`count` turns of CHAT_SESSIONS interleaved conversations: turn k of a session sends the system prompt
    (workload.shared_prefix tokens, the same in every run), the session's earlier user messages and replies
    (the replies as stand-in tokens of their output_len: the server's own replies are not known in advance),
    then a new user message. So every turn's prompt starts with its previous turn's whole prompt, which that
    turn left in the prefix cache, as a chat application's does."""
    low, high = CHAT_IDS
    system_rng, rng = random.Random("tandem-bench-chat-system"), random.Random(f"chat-{seed}")
    system = [system_rng.randrange(low, high) for _ in range(workload.shared_prefix)]
    user = parse_dist(workload.input_len, "--workloads")
    reply = parse_dist(workload.output_len, "--workloads")
    history: list[list[int]] = [[] for _ in range(CHAT_SESSIONS)]
    turns = [0] * CHAT_SESSIONS
    lines = []
    for index in range(count):
        s = index % CHAT_SESSIONS
        if turns[s] == CHAT_TURNS:
            history[s], turns[s] = [], 0
        message = [rng.randrange(low, high) for _ in range(user.sample(rng))]
        out = reply.sample(rng)
        lines.append(json.dumps({"prompt_token_ids": system + history[s] + message, "output_len": out}))
        history[s] += message + [rng.randrange(low, high) for _ in range(out)]
        turns[s] += 1
    path.write_text("\n".join(lines) + "\n")


def parse_rates(specs: list[str]) -> dict[str, tuple[float, ...]]:
    """--rates values as {workload: rates}, "*" for a plain list (every workload without its own)."""
    out: dict[str, tuple[float, ...]] = {}
    for spec in specs:
        name, _, values = spec.rpartition("=")
        name = name or "*"
        if name != "*" and name not in WORKLOADS:
            raise ValueError(f"unknown workload {name!r} in {spec!r}; choose from {', '.join(WORKLOADS)}")
        if name in out:
            raise ValueError(f"{'a plain list' if name == '*' else name} given twice")
        try:
            rates = tuple(float(r) for r in values.split(","))
        except ValueError:
            raise ValueError(f"{spec!r} is not a comma list of numbers") from None
        if not all(0 < r < MAX_RATE for r in rates):
            raise ValueError(f"each must be in (0, {MAX_RATE:g}) req/s, got {spec!r}")
        out[name] = rates
    return out
