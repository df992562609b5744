"""API keys (router.auth): the key file's validation, the lookup of a presented secret, and reloading a changed
file without a restart (a real file, the real AuthGate)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
from pathlib import Path

import grpc
import pytest

from router.admission import Priority
from router.auth import AuthGate, KeyFileError, KeyLimits, Unauthenticated, parse_key_file
from router.auth.keys import KeyRing

pytestmark = pytest.mark.unit

SECRET_A = "tk-alpha-0123456789abcdef"
SECRET_B = "tk-bravo-0123456789abcdef"


def keys_yaml(*entries: str) -> str:
    return "keys:\n" + "".join(entries)


def entry(name: str, secret: str, extra: str = "") -> str:
    return f"  - name: {name}\n    secret: {secret}\n{extra}"


def test_a_key_file_parses_names_priorities_limits_and_hashed_secrets() -> None:
    text = keys_yaml(
        entry("team-a", SECRET_A, "    admin: true\n    limits: {requests_per_s: 5, max_concurrent: 2}\n"),
        f"  - name: nightly\n    sha256: {hashlib.sha256(SECRET_B.encode()).hexdigest()}\n"
        "    priority: batch\n    limits: {tokens_per_s: 100, tokens_counted: output}\n",
    )
    ring = parse_key_file(text, "keys.yaml")
    a, b = ring.find(SECRET_A), ring.find(SECRET_B)
    assert a is not None and a.name == "team-a" and a.admin and a.priority is Priority.INTERACTIVE
    assert a.limits == KeyLimits(requests_per_s=5, max_concurrent=2)
    assert a.limits.request_bucket() == (5, 5.0)
    assert b is not None and b.name == "nightly" and b.priority is Priority.BATCH and not b.admin
    assert b.limits.token_bucket() == (100, 100.0) and b.limits.tokens_counted == "output"
    assert ring.find("tk-wrong-0123456789abcdef") is None and ring.find("") is None
    assert SECRET_A not in repr(a) and SECRET_A not in repr(ring.keys)  # only the digest is kept
    assert a.short_id == hashlib.sha256(SECRET_A.encode()).hexdigest()[:8]


def test_json_and_a_bare_list_are_key_files_too() -> None:
    data = [{"name": "a", "secret": SECRET_A, "revoked": True}]
    ring = parse_key_file(json.dumps(data), "keys.json")
    found = ring.find(SECRET_A)
    assert found is not None and found.revoked


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("keys: 3", "keys.yaml: keys: must be a list"),
        ("users: []", "keys.yaml: users: unknown key"),
        (keys_yaml("  - name: a\n"), "keys[0]: give exactly one of secret and sha256"),
        (keys_yaml(entry("a", "short")), "keys[0].secret: must be a printable string of at least 16"),
        (
            keys_yaml(entry("a", SECRET_A, "    priority: urgent\n")),
            "keys[0].priority: must be interactive or batch",
        ),
        (
            keys_yaml(entry("a", SECRET_A, "    limits: {requests_per_s: 0}\n")),
            "keys[0].limits.requests_per_s: must be",
        ),
        (keys_yaml(entry("a", SECRET_A, "    limits: {rps: 1}\n")), "keys[0].limits.rps: unknown field"),
        (
            keys_yaml(entry("a", SECRET_A, "    limits: {tokens_burst: 9}\n")),
            "tokens_burst: needs tokens_per_s",
        ),
        (
            keys_yaml(entry("a", SECRET_A, "    limits: {max_concurrent: 1.5}\n")),
            "max_concurrent: must be an integer",
        ),
        (keys_yaml(entry("a", SECRET_A, "    admin: yes please\n")), "keys[0].admin: must be true or false"),
        (
            keys_yaml(entry("a", SECRET_A), entry("a", SECRET_B)),
            "keys[1].name: 'a' is used by an earlier key",
        ),
        (keys_yaml(entry("a", SECRET_A), entry("b", SECRET_A)), "keys[1]: the same secret as an earlier key"),
        (keys_yaml("  - name: a\n    sha256: xyz\n"), "keys[0].sha256: must be 64 hex digits"),
        ("keys: [", "keys.yaml: not valid YAML"),
    ],
)
def test_a_bad_key_file_names_the_field_and_never_echoes_a_secret(text: str, message: str) -> None:
    with pytest.raises(KeyFileError) as info:
        parse_key_file(text, "keys.yaml")
    assert message in str(info.value)
    assert SECRET_A not in str(info.value) and SECRET_B not in str(info.value)


def test_find_compares_every_digest_even_after_a_match(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lookup is hmac.compare_digest against every key, so its time does not depend on which one matched."""
    ring = parse_key_file(keys_yaml(entry("a", SECRET_A), entry("b", SECRET_B)), "k.yaml")
    import router.auth.keys as keys_module

    calls: list[bytes] = []
    real = keys_module.hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append(a)
        return real(a, b)

    monkeypatch.setattr(keys_module.hmac, "compare_digest", counting)
    assert ring.find(SECRET_A) is not None
    assert len(calls) == 2  # the first key matched; the second was compared all the same
    assert KeyRing(()).find(SECRET_A) is None


def gate_for(path: Path) -> AuthGate:
    gate = AuthGate(str(path), reload_interval_s=0.01)
    gate.load()
    return gate


def test_authenticate_says_why_a_request_has_no_valid_key(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(keys_yaml(entry("a", SECRET_A), entry("old", SECRET_B, "    revoked: true\n")))
    gate = gate_for(path)
    assert gate.authenticate(f"Bearer {SECRET_A}").name == "a"
    assert gate.authenticate(f"bearer   {SECRET_A} ").name == "a"
    for value, reason in (
        (None, "missing"),
        ("", "missing"),
        (SECRET_A, "invalid"),  # no scheme
        (f"Basic {SECRET_A}", "invalid"),
        ("Bearer tk-unknown-0123456789abcdef", "invalid"),
        (f"Bearer {SECRET_B}", "revoked"),
    ):
        with pytest.raises(Unauthenticated) as info:
            gate.authenticate(value)
        assert info.value.reason == reason and info.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert SECRET_A not in info.value.details and SECRET_B not in info.value.details
    with pytest.raises(Unauthenticated) as info:
        gate.authenticate_admin(f"Bearer {SECRET_A}")
    assert info.value.reason == "not_admin"


def test_a_missing_or_bad_file_fails_load_with_its_path(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match="cannot read the API key file"):
        gate_for(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text(keys_yaml(entry("a", "short")))
    with pytest.raises(KeyFileError, match=r"bad.yaml: keys\[0\].secret"):
        gate_for(bad)


def rewrite(path: Path, text: str) -> None:
    """Write and move the mtime on, as a later edit would (file systems with coarse mtimes)."""
    path.write_text(text)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def test_a_changed_file_is_reloaded_and_a_bad_one_keeps_the_keys_in_force(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(keys_yaml(entry("a", SECRET_A)))
    gate = gate_for(path)

    async def scenario() -> None:
        assert not await gate.reload_if_changed()  # unchanged
        rewrite(path, keys_yaml(entry("a", SECRET_A, "    revoked: true\n"), entry("b", SECRET_B)))
        assert await gate.reload_if_changed()
        assert gate.authenticate(f"Bearer {SECRET_B}").name == "b"
        with pytest.raises(Unauthenticated):
            gate.authenticate(f"Bearer {SECRET_A}")
        with caplog.at_level(logging.ERROR, logger="router.auth.gate"):
            rewrite(path, "keys: [")
            assert not await gate.reload_if_changed()
            assert not await gate.reload_if_changed()  # logged once, not every poll
        assert gate.authenticate(f"Bearer {SECRET_B}").name == "b"  # the last good version still holds
        assert len([r for r in caplog.records if "keeping the 2 keys in force" in r.message]) == 1

    asyncio.run(scenario())


def test_the_polling_task_picks_up_a_change(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(keys_yaml(entry("a", SECRET_A)))
    gate = AuthGate(str(path), reload_interval_s=0.01)

    async def scenario() -> None:
        await gate.start()
        try:
            rewrite(path, keys_yaml(entry("b", SECRET_B)))
            for _ in range(500):  # bounded: 5 s at most
                if [k.name for k in gate.keys] == ["b"]:
                    break
                await asyncio.sleep(0.01)
            assert [k.name for k in gate.keys] == ["b"]
        finally:
            await gate.stop()
            await gate.stop()  # idempotent

    asyncio.run(scenario())
