"""The principals table: tokens stored as hashes, removal that revokes."""

import pytest

from store.crypto import hash_token
from store.db.models import Principal
from store.errors import Conflict, InvalidInput, NotFound
from store.repository import Store
from tests.stores import grant_state, read_row, seed

# -- principals ------------------------------------------------------------------------


def test_principal_token_is_returned_once_and_stored_only_as_its_hash(store: Store) -> None:
    token = store.add_principal("agent")
    assert len(token) >= 22
    row = read_row(store, Principal, "agent")
    assert row.token_hash == hash_token(token)
    assert all(token not in str(v) for v in vars(row).values())
    assert [p.name for p in store.list_principals()] == ["agent"]


def test_principal_name_is_validated(store: Store) -> None:
    with pytest.raises(InvalidInput, match="invalid principal name"):
        store.add_principal("Agent")


def test_duplicate_principal_is_a_conflict(store: Store) -> None:
    store.add_principal("agent")
    with pytest.raises(Conflict, match="'agent' already exists"):
        store.add_principal("agent")


def test_removing_a_principal_revokes_its_grants(store: Store) -> None:
    grant_id = seed(store)
    assert store.remove_principal("agent") == 1
    assert store.list_principals() == []
    assert grant_state(store, grant_id) == "revoked"


def test_removed_principal_name_can_be_reused_without_its_old_grants(store: Store) -> None:
    seed(store)
    first = read_row(store, Principal, "agent").token_hash
    store.remove_principal("agent")
    token = store.add_principal("agent")
    snap = store.snapshot()
    assert snap.token_hashes == {"agent": hash_token(token)} != {"agent": first}
    assert snap.grants == ()
    assert store.list_grants("agent") == []


def test_removing_an_unknown_principal_is_not_found(store: Store) -> None:
    with pytest.raises(NotFound, match="no principal named 'ghost'"):
        store.remove_principal("ghost")
