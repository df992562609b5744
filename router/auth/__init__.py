"""API keys and per-key quotas at the router's front doors (off unless RouterConfig.api_keys_file is set).

Module map: keys (the key file's format, validation, and the constant-time lookup of a presented secret),
quotas (token buckets for requests/s and tokens/s, a concurrency cap, per key), gate (AuthGate: loads and
reloads the file, authenticates an `authorization` value, holds the quotas). The request pipeline
(router.pipeline) asks the gate before anything else; a key's priority class orders router.admission.
"""

from router.auth.gate import AuthGate, Unauthenticated
from router.auth.keys import ApiKey, KeyFileError, KeyLimits, KeyRing, parse_key_file
from router.auth.quotas import Grant, QuotaExceeded, Quotas, TokenBucket

__all__ = [
    "ApiKey",
    "AuthGate",
    "Grant",
    "KeyFileError",
    "KeyLimits",
    "KeyRing",
    "QuotaExceeded",
    "Quotas",
    "TokenBucket",
    "Unauthenticated",
    "parse_key_file",
]
