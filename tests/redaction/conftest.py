"""The redactor's tests choose their sieve: the finders unless a test builds the heads sieve
(`prepare(..., sieve=True)`), never one that a background thread finishes mid-test."""

from __future__ import annotations

import pytest

from addon.redaction import redact


@pytest.fixture(autouse=True)
def _no_background_sieve(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(redact, "_later", lambda compiled: None)
