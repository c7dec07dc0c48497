"""The database behind a URL: the change counter, and SQLite files only init creates."""

from collections.abc import Callable
from pathlib import Path

import pytest

from store.crypto import MasterKey, Secret
from store.errors import Conflict, NotFound, StoreUnavailable
from store.repository import Store
from tests.stores import SECRET, seed

# -- the change counter ----------------------------------------------------------------


CHANGES: list[object] = [
    pytest.param(lambda s, g: s.add_principal("other"), id="add a principal"),
    pytest.param(lambda s, g: s.remove_principal("agent"), id="remove a principal"),
    pytest.param(
        lambda s, g: s.add_credential("c2", "bearer", ["a.example.com"], SECRET),
        id="add a credential",
    ),
    pytest.param(lambda s, g: s.rotate_credential("gh", Secret(b"x")), id="rotate a credential"),
    pytest.param(lambda s, g: s.remove_credential("gh"), id="remove a credential"),
    pytest.param(lambda s, g: s.add_grant("agent", ["*"], credential="gh"), id="add a grant"),
    pytest.param(lambda s, g: s.revoke_grant(g), id="revoke a grant"),
    pytest.param(lambda s, g: s.rotate_key(MasterKey.generate("new")), id="rotate the key"),
]


@pytest.mark.parametrize("change", CHANGES)
def test_every_change_bumps_the_counter_once(
    store: Store, change: Callable[[Store, int], object]
) -> None:
    grant_id = seed(store)
    before = store.change_counter()
    change(store, grant_id)
    assert store.change_counter() == before + 1


def test_a_refused_change_leaves_the_counter_alone(store: Store) -> None:
    seed(store)
    before = store.change_counter()
    with pytest.raises(Conflict):
        store.add_principal("agent")
    with pytest.raises(NotFound):
        store.remove_credential("ghost")
    assert store.change_counter() == before


def test_an_sqlite_store_is_never_created_but_by_init(tmp_path: Path, key: MasterKey) -> None:
    path = tmp_path / "gone.db"
    with pytest.raises(StoreUnavailable, match="no store at"):
        Store(f"sqlite:///{path}", key)
    assert not path.exists()
    created = Store(f"sqlite:///{path}", key, create=True)
    created.migrate()
    created.close()
    opened = Store(f"sqlite:///{path}", key)
    assert opened.schema_revision() is not None
    # Deleted while open: a new connection must not bring an empty store into being.
    opened.close()
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    with pytest.raises(StoreUnavailable):
        opened.change_counter()
    assert not path.exists()
