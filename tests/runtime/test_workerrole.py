"""A worker's role, as its supervisor hands it over in the environment."""

from __future__ import annotations

import pytest

from addon.runtime.workerrole import WORKER_ENV, Role
from store.errors import InvalidInput


def test_a_role_survives_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    role = Role(2, 8443, "/run/w-2.sock", (("127.0.0.1", 9000),))
    monkeypatch.setenv(WORKER_ENV, role.to_env())
    assert Role.from_env() == role


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("not json", id="refuse a role that is not JSON"),
        pytest.param('{"index": 1}', id="refuse a role with fields missing"),
        pytest.param(
            '{"index": "x", "port": 1, "admin": "a", "avoid": []}', id="refuse a bad index"
        ),
    ],
)
def test_a_broken_role_is_one_error(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setenv(WORKER_ENV, text)
    with pytest.raises(InvalidInput):
        Role.from_env()


def test_no_role_outside_a_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(WORKER_ENV, raising=False)
    assert Role.from_env() is None
