"""`AuthGate`: API keys and per-key quotas at the router's front doors (on when config.api_keys_file is set).

    gate = AuthGate(path, reload_interval_s=2.0)
    gate.load()                                   # at start: a bad file is a start-up error (KeyFileError)
    await gate.start()                            # polls the file's mtime; a good new version replaces the keys
    key = gate.authenticate("Bearer tk-...")      # or UNAUTHENTICATED (Unauthenticated.reason: missing, ...)
    grant = gate.quotas.acquire(key)              # or RESOURCE_EXHAUSTED with a retry delay (QuotaExceeded)

A reload that fails (unreadable, invalid) keeps the keys in force and logs why: a typo must not lock every
client out. Logs name keys by name, never by secret. Everything runs on the router's event loop (the file is
read in a thread).
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import grpc

from router.auth.keys import ApiKey, KeyFileError, KeyRing, parse_key_file
from router.auth.quotas import Quotas
from router.errors import RouterError

log = logging.getLogger(__name__)

BEARER = "bearer"


class Unauthenticated(RouterError):
    """UNAUTHENTICATED; `reason` (missing, invalid, revoked, not_admin) is the metrics' label."""

    def __init__(self, reason: str, details: str) -> None:
        super().__init__(grpc.StatusCode.UNAUTHENTICATED, details)
        self.reason = reason


class AuthGate:
    def __init__(self, path: str, reload_interval_s: float = 2.0) -> None:
        self.path = Path(path)
        self.reload_interval_s = reload_interval_s
        self.quotas = Quotas()
        self._ring = KeyRing(())
        self._signature: tuple[int, int, int] | None = None
        self._task: asyncio.Task[None] | None = None
        self._last_error = ""

    @property
    def keys(self) -> tuple[ApiKey, ...]:
        return self._ring.keys

    def load(self) -> None:
        """Read the key file now; raises KeyFileError (the file and the field) when it cannot be used."""
        signature = self._stat()
        self._ring = self._read()
        self._signature = signature
        log.info("API keys: %d loaded from %s (%s)", len(self.keys), self.path, _names(self.keys))

    async def start(self) -> None:
        """Load the file unless load() did, and start polling it."""
        if self._signature is None:
            self.load()
        if self._task is None:
            self._task = asyncio.create_task(self._watch(), name="router-api-keys")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            # asyncio.wait, not suppress(CancelledError) around `await task`: that would swallow our caller's cancel.
            await asyncio.wait([task])

    def authenticate(self, authorization: str | None) -> ApiKey:
        """The key an `authorization` value ("Bearer <secret>") names; Unauthenticated when it names none."""
        scheme, _, secret = (authorization or "").strip().partition(" ")
        secret = secret.strip()
        if not authorization:
            raise Unauthenticated(
                "missing", "this router requires an API key: send `authorization: Bearer <key>`"
            )
        if scheme.lower() != BEARER or not secret:
            raise Unauthenticated("invalid", "the authorization must read `Bearer <key>`")
        key = self._ring.find(secret)
        if key is None:
            raise Unauthenticated("invalid", "invalid API key")
        if key.revoked:
            raise Unauthenticated("revoked", f"API key {key.name!r} was revoked")
        return key

    def authenticate_admin(self, authorization: str | None) -> ApiKey:
        key = self.authenticate(authorization)
        if not key.admin:
            raise Unauthenticated("not_admin", f"API key {key.name!r} is not an admin key (admin: true)")
        return key

    # --- reloading ------------------------------------------------------------------------------------
    def _stat(self) -> tuple[int, int, int]:
        try:
            st = os.stat(self.path)  # follows symlinks: a Kubernetes Secret volume swaps a link on update
        except OSError as exc:
            raise KeyFileError(f"{self.path}: cannot read the API key file ({exc.strerror})") from None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def _read(self) -> KeyRing:
        try:
            text = self.path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise KeyFileError(f"{self.path}: cannot read the API key file ({exc})") from None
        return parse_key_file(text, str(self.path))

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.reload_interval_s)
            try:
                await self.reload_if_changed()
            except Exception:  # a bug here must not end the polling, nor the router
                log.exception("API keys: checking %s failed", self.path)

    async def reload_if_changed(self) -> bool:
        """Reload when the file's mtime, size or inode changed; True when a new version is in force."""
        try:
            signature = self._stat()
            if signature == self._signature:
                return False
            ring = await asyncio.to_thread(self._read)
        except KeyFileError as exc:
            if str(exc) != self._last_error:  # once per bad version, not every poll
                self._last_error = str(exc)
                log.error("API keys: keeping the %d keys in force: %s", len(self.keys), exc)
            return False
        self._last_error = ""
        self._ring, self._signature = ring, signature
        log.info("API keys: reloaded %d from %s (%s)", len(self.keys), self.path, _names(self.keys))
        return True


def _names(keys: tuple[ApiKey, ...]) -> str:
    shown = [f"{k.name}{' (revoked)' if k.revoked else ''}" for k in keys[:20]]
    return ", ".join(shown) + (f", ... {len(keys) - 20} more" if len(keys) > 20 else "")
