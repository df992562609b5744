"""Per-key quotas: a requests bucket, a tokens bucket and a concurrency cap (router.auth.keys.KeyLimits).

    bucket level  ^ depth ........................................
                  |      refills at `rate` per second, up to depth
                  |   /\\      /
                  0 -/--\\----/-----------  a request needs one whole unit: below 1 it waits (1 - level) / rate
                  |      \\__/               tokens are charged as they are known, so the level may go below 0
                                            (a debt): the key's next request waits until it is paid off

The requests bucket takes one unit when a request is accepted. The tokens bucket cannot know a request's size
in advance: a request is accepted while the level is at least 1, its prompt tokens are charged once tokenized
(tokens_counted: total) and its output tokens when it ends. The concurrency cap counts the key's accepted
requests (queued or running). All of this runs on the router's event loop: no locks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from router.auth.keys import ApiKey, KeyLimits
from router.errors import RouterError

RETRY_AFTER_CONCURRENCY_S = 1.0  # a key at its concurrency cap waits for one of its own requests to end

Clock = Callable[[], float]


class TokenBucket:
    def __init__(self, rate: float, depth: float, now: float) -> None:
        self.rate, self.depth = rate, depth
        self.level = depth
        self._at = now

    def configure(self, rate: float, depth: float, now: float) -> None:
        """New limits from a reloaded key file; what the key has used stays used."""
        self._refill(now)
        self.rate, self.depth = rate, depth
        self.level = min(self.level, depth)

    def _refill(self, now: float) -> None:
        self.level = min(self.depth, self.level + (now - self._at) * self.rate)
        self._at = now

    def wait_s(self, now: float) -> float:
        """Seconds until the level reaches one whole unit (0: it has one now)."""
        self._refill(now)
        return 0.0 if self.level >= 1.0 else (1.0 - self.level) / self.rate

    def charge(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level -= amount


class QuotaExceeded(RouterError):
    """RESOURCE_EXHAUSTED for one key's own limit; `reason` names it (the metrics' label)."""

    def __init__(self, key: ApiKey, reason: str, problem: str, retry_after_s: float) -> None:
        super().__init__(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"API key {key.name!r} is over its quota: {problem}; retry in {retry_after_s:.2f}s",
            retry_after_s,
            quota=True,
        )
        self.reason = reason


@dataclass
class KeyUsage:
    """One key's buckets and its count of accepted requests. Lives across reloads of the key file."""

    limits: KeyLimits
    requests: TokenBucket | None
    tokens: TokenBucket | None
    accepted: int = 0

    def reconfigure(self, limits: KeyLimits, now: float) -> None:
        if limits == self.limits:
            return
        self.limits = limits
        self.requests = _bucket(self.requests, limits.request_bucket(), now)
        self.tokens = _bucket(self.tokens, limits.token_bucket(), now)


def _bucket(old: TokenBucket | None, spec: tuple[float, float] | None, now: float) -> TokenBucket | None:
    if spec is None:
        return None
    if old is None:
        return TokenBucket(*spec, now)
    old.configure(*spec, now)
    return old


class Quotas:
    """Every key's usage, by name (a key whose limits change in the file keeps what it has used)."""

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self._clock = clock
        self._usage: dict[str, KeyUsage] = {}

    def usage(self, key: ApiKey) -> KeyUsage:
        now = self._clock()
        usage = self._usage.get(key.name)
        if usage is None:
            limits = key.limits
            usage = KeyUsage(
                limits, _bucket(None, limits.request_bucket(), now), _bucket(None, limits.token_bucket(), now)
            )
            self._usage[key.name] = usage
        else:
            usage.reconfigure(key.limits, now)
        return usage

    def acquire(self, key: ApiKey) -> Grant:
        """Take one request of `key`'s quota, or raise QuotaExceeded with the delay after which it would pass."""
        usage, now = self.usage(key), self._clock()
        cap = key.limits.max_concurrent
        if cap is not None and usage.accepted >= cap:
            raise QuotaExceeded(
                key,
                "concurrency",
                f"{usage.accepted} requests open, max_concurrent {cap}",
                RETRY_AFTER_CONCURRENCY_S,
            )
        if usage.tokens is not None and (wait := usage.tokens.wait_s(now)) > 0:
            raise QuotaExceeded(key, "tokens", f"tokens_per_s {usage.tokens.rate:g} used up", wait)
        if usage.requests is not None:
            if (wait := usage.requests.wait_s(now)) > 0:
                raise QuotaExceeded(key, "requests", f"requests_per_s {usage.requests.rate:g} used up", wait)
            usage.requests.charge(1.0, now)
        usage.accepted += 1
        return Grant(key, usage, self._clock)


class Grant:
    """One accepted request's hold on its key's quota: charge its tokens, release it once (idempotent)."""

    def __init__(self, key: ApiKey, usage: KeyUsage, clock: Clock) -> None:
        self.key = key
        self._usage = usage
        self._clock = clock
        self._open = True

    def charge_prompt(self, tokens: int) -> None:
        if self._usage.limits.tokens_counted == "total":
            self._charge(tokens)

    def charge_output(self, tokens: int) -> None:
        self._charge(tokens)

    def _charge(self, tokens: int) -> None:
        bucket = self._usage.tokens
        if bucket is not None and tokens > 0:
            bucket.charge(float(tokens), self._clock())

    def release(self) -> None:
        if self._open:
            self._open = False
            self._usage.accepted -= 1
