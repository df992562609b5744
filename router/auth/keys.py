"""API keys: the key file's format, its validation, and the constant-time lookup of a presented secret.

    keys:                                   # YAML or JSON; a bare list of keys works too
      - name: team-a                        # required, unique: the key's name in logs and metrics
        secret: "tk-3f9c..."                # at least 16 characters; or sha256: <64 hex digits of the secret>
        priority: interactive               # or batch (default interactive)
        admin: false                        # may call Admin.Scale (default false)
        revoked: false                      # true: refused with UNAUTHENTICATED, kept for the record
        limits:                             # all optional; a missing limit is no limit
          requests_per_s: 5                 # token bucket of requests: rate ...
          requests_burst: 10                # ... and depth (default: max(1, requests_per_s))
          tokens_per_s: 2000                # token bucket of tokens (default depth: max(1, tokens_per_s))
          tokens_burst: 8000
          tokens_counted: total             # total (prompt + output) or output
          max_concurrent: 4                 # requests of this key accepted at once (queued or running)

Only the SHA-256 digest of each secret is kept in memory. A presented secret is hashed and compared with every
key's digest by hmac.compare_digest, without stopping at a match, so the time taken says nothing about which
key (if any) matched. Secrets never appear in messages or logs; a key is named by `name` (or `short_id`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from router.admission import Priority

MIN_SECRET_CHARS = 16
KEY_FIELDS = ("name", "secret", "sha256", "priority", "admin", "revoked", "limits")
TOKENS_COUNTED = ("total", "output")


class KeyFileError(ValueError):
    """The key file cannot be used; the message names the file and the field (`keys[2].limits.x: ...`)."""


@dataclass(frozen=True)
class KeyLimits:
    """A key's quotas; None is no limit. Rates are per second; bursts are bucket depths."""

    requests_per_s: float | None = None
    requests_burst: float | None = None
    tokens_per_s: float | None = None
    tokens_burst: float | None = None
    tokens_counted: str = "total"
    max_concurrent: int | None = None

    def request_bucket(self) -> tuple[float, float] | None:
        """(rate, depth) of the requests bucket, or None."""
        if self.requests_per_s is None:
            return None
        return self.requests_per_s, self.requests_burst or max(1.0, self.requests_per_s)

    def token_bucket(self) -> tuple[float, float] | None:
        if self.tokens_per_s is None:
            return None
        return self.tokens_per_s, self.tokens_burst or max(1.0, self.tokens_per_s)


@dataclass(frozen=True)
class ApiKey:
    name: str
    digest: bytes = field(repr=False)  # SHA-256 of the secret; never the secret itself
    priority: Priority = Priority.INTERACTIVE
    admin: bool = False
    revoked: bool = False
    limits: KeyLimits = KeyLimits()

    @property
    def short_id(self) -> str:
        """8 hex digits of the secret's digest: names a key in logs without revealing it."""
        return self.digest.hex()[:8]


def digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


class KeyRing:
    """The keys of one version of the key file."""

    def __init__(self, keys: Sequence[ApiKey]) -> None:
        self.keys = tuple(keys)

    def find(self, secret: str) -> ApiKey | None:
        """The key whose secret this is, revoked ones included, or None. Constant time in which key matched."""
        presented = digest(secret)
        found: ApiKey | None = None
        for key in self.keys:
            if hmac.compare_digest(key.digest, presented):
                found = key  # no break: every digest is compared whatever matches
        return found


def parse_key_file(text: str, source: str) -> KeyRing:
    """The text of a key file (YAML, which includes JSON) -> a KeyRing; KeyFileError names what is wrong."""
    try:
        data = json.loads(text) if source.endswith(".json") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise KeyFileError(
            f"{source}: not valid {'JSON' if source.endswith('.json') else 'YAML'}: {exc}"
        ) from None
    if isinstance(data, Mapping):
        extra = sorted(set(data) - {"keys"})
        if extra:
            raise KeyFileError(f"{source}: {extra[0]}: unknown key; the file holds `keys:` (a list)")
        data = data.get("keys")
    if not isinstance(data, list):
        raise KeyFileError(f"{source}: keys: must be a list of keys, got {type(data).__name__}")
    keys = [_parse_key(entry, f"{source}: keys[{i}]") for i, entry in enumerate(data)]
    _check_unique(keys, source)
    return KeyRing(keys)


def _parse_key(entry: object, where: str) -> ApiKey:
    if not isinstance(entry, Mapping):
        raise KeyFileError(f"{where}: must be a mapping with name and secret, got {type(entry).__name__}")
    unknown = sorted(set(entry) - set(KEY_FIELDS))
    if unknown:
        raise KeyFileError(f"{where}.{unknown[0]}: unknown field; allowed: {', '.join(KEY_FIELDS)}")
    name = entry.get("name")
    if not isinstance(name, str) or not name.strip() or len(name) > 64:
        raise KeyFileError(f"{where}.name: must be a non-empty string of at most 64 characters")
    priority = entry.get("priority", Priority.INTERACTIVE.value)
    if priority not in {p.value for p in Priority}:
        raise KeyFileError(f"{where}.priority: must be interactive or batch, got {priority!r}")
    for flag in ("admin", "revoked"):
        if not isinstance(entry.get(flag, False), bool):
            raise KeyFileError(f"{where}.{flag}: must be true or false")
    return ApiKey(
        name=name,
        digest=_secret_digest(entry, where),
        priority=Priority(priority),
        admin=entry.get("admin", False),
        revoked=entry.get("revoked", False),
        limits=_parse_limits(entry.get("limits") or {}, f"{where}.limits"),
    )


def _secret_digest(entry: Mapping[str, Any], where: str) -> bytes:
    secret, hashed = entry.get("secret"), entry.get("sha256")
    if (secret is None) == (hashed is None):
        raise KeyFileError(f"{where}: give exactly one of secret and sha256 (the hex SHA-256 of the secret)")
    if secret is not None:
        if not isinstance(secret, str) or len(secret) < MIN_SECRET_CHARS or not secret.isprintable():
            # the message must not echo the secret
            raise KeyFileError(
                f"{where}.secret: must be a printable string of at least {MIN_SECRET_CHARS} characters"
            )
        return digest(secret)
    if not isinstance(hashed, str) or len(hashed) != 64:
        raise KeyFileError(f"{where}.sha256: must be 64 hex digits (sha256sum of the secret)")
    try:
        return bytes.fromhex(hashed)
    except ValueError:
        raise KeyFileError(f"{where}.sha256: must be 64 hex digits (sha256sum of the secret)") from None


def _parse_limits(data: object, where: str) -> KeyLimits:
    if not isinstance(data, Mapping):
        raise KeyFileError(f"{where}: must be a mapping, got {type(data).__name__}")
    names = [f for f in KeyLimits.__dataclass_fields__]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise KeyFileError(f"{where}.{unknown[0]}: unknown field; allowed: {', '.join(names)}")
    for name in ("requests_per_s", "requests_burst", "tokens_per_s", "tokens_burst"):
        value = data.get(name)
        if value is not None and not (_is_number(value) and value > 0):
            raise KeyFileError(f"{where}.{name}: must be a number > 0, got {value!r}")
    for bucket in ("requests", "tokens"):
        if data.get(f"{bucket}_burst") is not None and data.get(f"{bucket}_per_s") is None:
            raise KeyFileError(f"{where}.{bucket}_burst: needs {bucket}_per_s")
    concurrent = data.get("max_concurrent")
    if concurrent is not None and not (_is_int(concurrent) and concurrent >= 1):
        raise KeyFileError(f"{where}.max_concurrent: must be an integer >= 1, got {concurrent!r}")
    counted = data.get("tokens_counted", "total")
    if counted not in TOKENS_COUNTED:
        raise KeyFileError(f"{where}.tokens_counted: must be total or output, got {counted!r}")
    return KeyLimits(**dict(data))


def _check_unique(keys: Sequence[ApiKey], source: str) -> None:
    names: set[str] = set()
    digests: set[bytes] = set()
    for i, key in enumerate(keys):
        if key.name in names:
            raise KeyFileError(f"{source}: keys[{i}].name: {key.name!r} is used by an earlier key")
        if key.digest in digests:
            raise KeyFileError(f"{source}: keys[{i}]: the same secret as an earlier key ({key.name!r})")
        names.add(key.name)
        digests.add(key.digest)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(float(value))  # type: ignore[arg-type]
