"""The principal_tokens table: further tokens with ids, expiry and revocation; the proxy's view."""

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import update

from addon.core.policy import Policy, long_lived
from store.crypto import hash_token
from store.db.models import PrincipalToken, utcnow
from store.errors import InvalidInput, NotFound
from store.repository import Store


def test_a_token_is_returned_once_and_stored_only_as_its_hash(store: Store) -> None:
    store.add_principal("agent")
    token_id, token = store.add_token("agent", None, "exec: curl")
    with store.engine.connect() as conn:
        rows = conn.execute(PrincipalToken.__table__.select()).all()
    assert [r.token_hash for r in rows] == [hash_token(token)]
    assert all(token not in str(v) for v in rows[0])
    (entry,) = store.list_tokens("agent")
    assert (entry.id, entry.principal, entry.note, entry.state) == (
        token_id,
        "agent",
        "exec: curl",
        "active",
    )
    assert token not in repr(entry)


def test_a_principal_holds_several_tokens_and_each_authenticates(store: Store) -> None:
    own = store.add_principal("agent")
    first_id, first = store.add_token("agent", None)
    second_id, second = store.add_token("agent", utcnow() + timedelta(hours=1))
    policy = Policy(store.snapshot())
    now = datetime.now(UTC)
    assert policy.token_of("agent", own, now) == long_lived(1)
    assert policy.token_of("agent", first, now) == first_id
    assert policy.token_of("agent", second, now) == second_id
    assert policy.token_of("agent", "not-a-token", now) is None


def test_a_revoked_token_is_refused_and_the_others_are_not(store: Store) -> None:
    store.add_principal("agent")
    gone_id, gone = store.add_token("agent", None)
    kept_id, kept = store.add_token("agent", None)
    before = store.change_counter()
    store.revoke_token(gone_id)
    assert store.change_counter() > before  # the proxy reloads on it
    policy = Policy(store.snapshot())
    now = datetime.now(UTC)
    assert policy.token_of("agent", gone, now) is None
    assert not policy.token_live("agent", gone_id, now)
    assert policy.token_of("agent", kept, now) == kept_id
    assert [t.state for t in store.list_tokens()] == ["revoked", "active"]
    store.revoke_token(gone_id)  # again: harmless


def test_an_expired_token_is_left_out_of_the_snapshot(store: Store) -> None:
    store.add_principal("agent")
    token_id, token = store.add_token("agent", utcnow() + timedelta(hours=1))
    with store.db.change() as session:
        session.execute(update(PrincipalToken).values(expires_at=utcnow() - timedelta(seconds=1)))
    snap = store.snapshot()
    assert snap.sessions == {}
    assert Policy(snap).token_of("agent", token, datetime.now(UTC)) is None
    assert [t.state for t in store.list_tokens("agent")] == ["expired"]


def test_a_token_expires_at_request_time_without_a_store_change(store: Store) -> None:
    store.add_principal("agent")
    expires = utcnow() + timedelta(minutes=5)
    token_id, token = store.add_token("agent", expires)
    policy = Policy(store.snapshot())
    assert policy.token_of("agent", token, expires - timedelta(seconds=1)) == token_id
    assert policy.token_live("agent", token_id, expires - timedelta(seconds=1))
    assert policy.token_of("agent", token, expires) is None
    assert not policy.token_live("agent", token_id, expires)


def test_a_token_names_only_its_own_principal(store: Store) -> None:
    store.add_principal("agent")
    store.add_principal("other")
    token_id, token = store.add_token("agent", None)
    policy = Policy(store.snapshot())
    now = datetime.now(UTC)
    assert policy.token_of("other", token, now) is None
    assert not policy.token_live("other", token_id, now)


def test_removing_the_principal_ends_its_tokens(store: Store) -> None:
    store.add_principal("agent")
    token_id, token = store.add_token("agent", None)
    store.remove_principal("agent")
    store.add_principal("agent")  # the name again, a new principal
    policy = Policy(store.snapshot())
    assert policy.token_of("agent", token, datetime.now(UTC)) is None
    assert store.list_tokens() == []


def test_tokens_of_an_unknown_principal_or_id_are_not_found(store: Store) -> None:
    with pytest.raises(NotFound, match="no principal named 'ghost'"):
        store.add_token("ghost", None)
    with pytest.raises(NotFound, match="no token with id 7"):
        store.revoke_token(7)


def test_a_note_is_short_and_printable(store: Store) -> None:
    store.add_principal("agent")
    with pytest.raises(InvalidInput, match="note"):
        store.add_token("agent", None, "a\nb")
    with pytest.raises(InvalidInput, match="note"):
        store.add_token("agent", None, "x" * 201)
