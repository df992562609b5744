"""Per-key quotas (router.auth.quotas) on a clock the test moves: token buckets for requests and tokens, the
concurrency cap, retry delays, and limits changed by a reload keeping what a key has used."""

from __future__ import annotations

from dataclasses import replace

import grpc
import pytest

from router.auth import ApiKey, KeyLimits, QuotaExceeded, Quotas, TokenBucket
from router.auth.keys import digest
from tests.fake_clock import ManualClock

pytestmark = pytest.mark.unit


def key(name: str = "a", **limits: object) -> ApiKey:
    return ApiKey(name=name, digest=digest(f"secret-of-{name}-0123456789"), limits=KeyLimits(**limits))  # type: ignore[arg-type]


def test_a_bucket_refills_at_its_rate_up_to_its_depth() -> None:
    bucket = TokenBucket(rate=2.0, depth=3.0, now=0.0)
    assert bucket.wait_s(0.0) == 0.0
    bucket.charge(3.0, 0.0)
    assert bucket.wait_s(0.0) == pytest.approx(0.5)  # one unit at 2/s
    assert bucket.wait_s(0.25) == pytest.approx(0.25)
    assert bucket.wait_s(100.0) == 0.0 and bucket.level == 3.0  # never above its depth
    bucket.charge(10.0, 100.0)  # a debt: tokens are charged after the fact
    assert bucket.wait_s(100.0) == pytest.approx((1.0 + 7.0) / 2.0)


def test_requests_per_second_refuses_with_the_delay_until_the_next_one_passes() -> None:
    clock = ManualClock()
    quotas = Quotas(clock)
    k = key(requests_per_s=2, requests_burst=2)
    grants = [quotas.acquire(k), quotas.acquire(k)]
    with pytest.raises(QuotaExceeded) as info:
        quotas.acquire(k)
    err = info.value
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.quota and err.reason == "requests"
    assert err.retry_after_s == pytest.approx(0.5)
    assert err.trailing_metadata() == (("retry-after-ms", "500"),)
    assert "'a'" in err.details and "requests_per_s 2" in err.details
    clock.now += 0.5
    grants.append(quotas.acquire(k))
    assert all(g.key is k for g in grants)


def test_other_keys_have_their_own_buckets() -> None:
    quotas = Quotas(ManualClock())
    slow, other = key("slow", requests_per_s=1), key("other", requests_per_s=1)
    quotas.acquire(slow)
    with pytest.raises(QuotaExceeded):
        quotas.acquire(slow)
    quotas.acquire(other)


def test_tokens_are_charged_after_the_fact_and_the_debt_delays_the_next_request() -> None:
    clock = ManualClock()
    quotas = Quotas(clock)
    k = key(tokens_per_s=100, tokens_burst=100)
    grant = quotas.acquire(k)
    grant.charge_prompt(150)  # total: prompt tokens count
    grant.charge_output(50)
    grant.release()
    with pytest.raises(QuotaExceeded) as info:
        quotas.acquire(k)
    assert info.value.reason == "tokens" and info.value.retry_after_s == pytest.approx(1.01)
    clock.now += 1.01
    quotas.acquire(k)


def test_output_counting_ignores_the_prompt() -> None:
    quotas = Quotas(ManualClock())
    k = key(tokens_per_s=10, tokens_counted="output")
    grant = quotas.acquire(k)
    grant.charge_prompt(1000)
    quotas.acquire(k)  # the prompt cost nothing
    grant.charge_output(20)
    with pytest.raises(QuotaExceeded):
        quotas.acquire(k)


def test_the_concurrency_cap_counts_open_requests_and_release_is_idempotent() -> None:
    quotas = Quotas(ManualClock())
    k = key(max_concurrent=2)
    first, _second = quotas.acquire(k), quotas.acquire(k)
    with pytest.raises(QuotaExceeded) as info:
        quotas.acquire(k)
    assert info.value.reason == "concurrency" and info.value.retry_after_s == 1.0
    first.release()
    first.release()  # twice gives back one place, not two
    quotas.acquire(k)
    with pytest.raises(QuotaExceeded):
        quotas.acquire(k)


def test_a_key_with_no_limits_is_never_refused() -> None:
    quotas = Quotas(ManualClock())
    k = key()
    for _ in range(1000):
        quotas.acquire(k)


def test_new_limits_from_a_reload_keep_what_the_key_used() -> None:
    clock = ManualClock()
    quotas = Quotas(clock)
    k = key(requests_per_s=1, requests_burst=5, max_concurrent=3)
    open_grants = [quotas.acquire(k) for _ in range(3)]
    reloaded = replace(k, limits=KeyLimits(requests_per_s=1, requests_burst=2, max_concurrent=4))
    quotas.acquire(reloaded)  # the 4th place the new cap gives: the 3 open ones still count
    with pytest.raises(QuotaExceeded) as info:
        quotas.acquire(reloaded)
    assert info.value.reason == "concurrency"
    for grant in open_grants:
        grant.release()
    quotas.acquire(
        reloaded
    )  # the bucket kept its level: 5 - 3 = 2, capped at the new depth 2, minus 1: one left
    with pytest.raises(QuotaExceeded) as info:
        quotas.acquire(reloaded)
    assert info.value.reason == "requests"
