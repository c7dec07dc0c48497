"""The console_tokens table: operators' tokens kept as hashes, each expiring, revoked by name."""

from datetime import timedelta

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from store.crypto import hash_token
from store.db.models import ConsoleToken, utcnow
from store.errors import InvalidInput, NotFound
from store.repository import Store
from store.tables import console_tokens

DAY = timedelta(days=1)


def _rows(store: Store) -> list[ConsoleToken]:
    with Session(store.engine) as session:
        return list(session.scalars(select(ConsoleToken)))


def test_a_console_token_is_kept_only_as_its_hash_and_opens_as_its_operator(store: Store) -> None:
    counter = store.change_counter()
    token = store.add_console_token("alice", utcnow() + DAY)
    (row,) = _rows(store)
    assert row.token_hash == hash_token(token)
    assert all(token not in str(v) for v in vars(row).values())
    assert store.console_operator(token) == ("alice", row.id)
    assert store.console_token_live(row.id)
    assert store.change_counter() == counter  # the proxy has nothing to reload
    assert store.live_console_tokens() == 1
    (entry,) = store.list_console_tokens()
    assert (entry.operator, entry.state) == ("alice", "active")
    assert token not in repr(entry)


def test_an_unknown_or_principal_token_opens_nothing(store: Store) -> None:
    store.add_console_token("alice", utcnow() + DAY)
    agent = store.add_principal("agent")
    assert store.console_operator(agent) is None
    assert store.console_operator("") is None


def test_an_expired_token_opens_nothing(store: Store) -> None:
    token = store.add_console_token("alice", utcnow() + DAY)
    with Session(store.engine) as session, session.begin():
        session.execute(
            ConsoleToken.__table__.update().values(expires_at=utcnow() - timedelta(seconds=1))
        )
    (row,) = _rows(store)
    assert store.console_operator(token) is None
    assert not store.console_token_live(row.id)
    assert [t.state for t in store.list_console_tokens()] == ["expired"]
    assert store.live_console_tokens() == 0


def test_revoking_an_operator_revokes_each_of_its_live_tokens_only(store: Store) -> None:
    first = store.add_console_token("alice", utcnow() + DAY)
    second = store.add_console_token("alice", utcnow() + DAY)
    bob = store.add_console_token("bob", utcnow() + DAY)
    assert store.revoke_console_tokens("alice") == 2
    assert store.console_operator(first) is None
    assert store.console_operator(second) is None
    assert store.console_operator(bob) is not None
    assert [t.state for t in store.list_console_tokens()] == ["revoked", "revoked", "active"]
    with pytest.raises(NotFound, match="'alice' has no live console token"):
        store.revoke_console_tokens("alice")


@pytest.mark.parametrize(
    ("operator", "expires", "message"),
    [
        pytest.param("Alice", DAY, "invalid operator name", id="an operator name is validated"),
        pytest.param("alice", -DAY, "must be in the future", id="an expiry in the past is refused"),
    ],
)
def test_bad_input_is_refused(
    store: Store, operator: str, expires: timedelta, message: str
) -> None:
    with pytest.raises(InvalidInput, match=message):
        store.add_console_token(operator, utcnow() + expires)
    assert _rows(store) == []


def test_live_tokens_are_bounded(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(console_tokens, "MAX_ACTIVE", 2)
    store.add_console_token("alice", utcnow() + DAY)
    store.add_console_token("bob", utcnow() + DAY)
    with pytest.raises(InvalidInput, match="2 console tokens are live already"):
        store.add_console_token("carol", utcnow() + DAY)
    store.revoke_console_tokens("bob")
    store.add_console_token("carol", utcnow() + DAY)
