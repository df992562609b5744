"""What a kv_transfer call that must fail failed with (for tests that check the reason, not the message)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kv_transfer import FailureReason, TransferFailed


def reason_of(fn: Callable[[], object]) -> FailureReason:
    with pytest.raises(TransferFailed) as info:
        fn()
    return info.value.reason
