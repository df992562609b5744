"""Closed-loop load for e2e tests: `clients` threads send requests back to back until stopped, every outcome kept.

    with Load(address, clients=4, kind=RequestKind("decode_heavy", max_tokens=32)) as load:
        ...
        load.shift(RequestKind("prefill_heavy", max_tokens=1, prompt_tokens=900))   # the next requests change
    assert load.errors == []

Bounded: each client stops after max_requests requests even if never stopped, each request has a timeout, and
leaving the block joins the clients (each finishes the request it is in).
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass

from tandem_client import Client, GenerationResult


@dataclass(frozen=True)
class RequestKind:
    """What each request asks for: max_tokens tokens (EOS ignored, so exactly that many), after a short text
    prompt, or after prompt_tokens raw token ids (distinct per request, so no prefix cache helps)."""

    name: str
    max_tokens: int
    prompt_tokens: int = 0

    def send(self, client: Client, client_index: int, n: int, timeout_s: float) -> GenerationResult:
        if self.prompt_tokens:
            start = 1000 * client_index + 7 * n
            prompt = None
            token_ids = [100 + (start + 13 * i) % 20000 for i in range(self.prompt_tokens)]
        else:
            prompt, token_ids = (
                f"Client {client_index}, request {n}: list three colours of the rainbow.",
                None,
            )
        return client.generate(
            prompt,
            token_ids=token_ids,
            max_tokens=self.max_tokens,
            ignore_eos=True,
            temperature=0,
            timeout=timeout_s,
        )


SHORT = RequestKind("short", max_tokens=6)


class Load:
    def __init__(
        self,
        address: str,
        clients: int = 3,
        kind: RequestKind = SHORT,
        max_requests: int = 5000,
        timeout_s: float = 120.0,
    ) -> None:
        self.address = address
        self.kind = kind
        self.ok = 0
        self.served: Counter[str] = Counter()  # finished requests by kind name
        self.errors: list[str] = []
        self._max_requests = max_requests
        self._timeout_s = timeout_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(self._timeout_s)

    def shift(self, kind: RequestKind) -> None:
        """Requests started from now on are of `kind`."""
        self.kind = kind

    def _run(self, client_index: int) -> None:
        with Client(self.address) as client:
            for n in range(1, self._max_requests + 1):
                if self._stop.is_set():
                    return
                kind = self.kind
                try:
                    result = kind.send(client, client_index, n, self._timeout_s)
                    assert len(result.token_ids) == kind.max_tokens, result
                except Exception as exc:  # every failure is a lost request: the test reports them all
                    with self._lock:
                        self.errors.append(f"{kind.name}: {exc!r}")
                    continue
                with self._lock:
                    self.ok += 1
                    self.served[kind.name] += 1
