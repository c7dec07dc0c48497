"""The live policy's staleness rule, without a store."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from addon.live import LivePolicy


@pytest.mark.parametrize(
    ("max_stale", "age", "served"),
    [
        pytest.param(30.0, 1.0, True, id="a fresh policy is served"),
        pytest.param(30.0, 31.0, False, id="a policy older than max-stale is not"),
        pytest.param(float("nan"), 0.0, False, id="a NaN limit reads as stale"),
    ],
)
def test_current_fails_closed(max_stale: float, age: float, served: bool) -> None:
    store: Any = SimpleNamespace()
    live = LivePolicy(store, max_stale=max_stale)
    try:
        live.policy = object()  # type: ignore[assignment]
        live.last_ok = time.monotonic() - age
        assert (live.current() is not None) is served
    finally:
        live._executor.shutdown()
