"""The verdict on a store's schema revision, without Alembic: current, missing, or newer."""

from __future__ import annotations

import pytest

from store.db.revisions import KNOWN_SCHEMAS, SCHEMA_HEAD, check_head, refuse_newer
from store.errors import StoreUnavailable


def test_the_head_is_among_the_known_revisions() -> None:
    assert SCHEMA_HEAD in KNOWN_SCHEMAS
    assert SCHEMA_HEAD == max(KNOWN_SCHEMAS)


def test_a_store_at_the_head_passes() -> None:
    check_head("sqlite:///x.db", SCHEMA_HEAD)


@pytest.mark.parametrize(
    ("current", "message"),
    [
        pytest.param(None, "at schema none, not", id="a store never migrated: run init"),
        pytest.param("0001", "at schema 0001, not", id="an older revision: run init"),
        pytest.param("9999", "newer than this credproxy's", id="a newer revision: upgrade"),
        pytest.param(
            f"{SCHEMA_HEAD}, 9999", "newer than this credproxy's", id="two heads, one unknown"
        ),
    ],
)
def test_any_other_revision_is_refused_saying_what_to_do(current: str | None, message: str) -> None:
    with pytest.raises(StoreUnavailable, match=message) as caught:
        check_head("sqlite:///x.db", current)
    assert "sqlite:///x.db" in str(caught.value)


@pytest.mark.parametrize("current", [None, "0001", SCHEMA_HEAD])
def test_refuse_newer_lets_every_known_revision_through(current: str | None) -> None:
    refuse_newer("sqlite:///x.db", current)
