"""Key custody: the store's check value of its master key, sealing under it, rotating it."""

from __future__ import annotations

from sqlalchemy import select

from store.crypto import MasterKey, Secret
from store.db.engine import Database
from store.db.models import Credential, StoreState
from store.errors import MasterKeyError
from store.rules import secretref


def _context(name: str) -> str:
    """The associated data of a credential's seal: a ciphertext moved to another row fails."""
    return f"credential/{name}"


def seal(key: MasterKey, name: str, secret: Secret) -> tuple[str, bytes, bytes]:
    """(key_id, nonce, ciphertext) of credential `name`'s secret."""
    return key.seal(secret.reveal(), _context(name))


def unseal(
    key: MasterKey, name: str, key_id: str | None, nonce: bytes | None, ciphertext: bytes | None
) -> Secret:
    """Raises SealError when the row was tampered with or sealed under another key."""
    assert key_id is not None and nonce is not None and ciphertext is not None
    return key.open(key_id, nonce, ciphertext, _context(name))


def need(key: MasterKey | None) -> MasterKey:
    if key is None:
        raise MasterKeyError("this command needs the master key")
    return key


def check(db: Database, key: MasterKey | None, *, adopt: bool = False) -> None:
    """Compare `key` with the store's check value; `adopt` records it if unset."""
    if key is None:
        return
    with db.session() as session, session.begin():
        state = session.get_one(StoreState, 1)
        if state.key_check is None and adopt:
            state.key_id, state.key_check = key.key_id, key.check_value
            return
        if state.key_check is None:
            raise MasterKeyError(f"{db.display_url} has no master key yet: run credproxy init")
        if state.key_check != key.check_value:
            raise MasterKeyError(
                f"the master key from {key.source} (id {key.key_id}) is not the key "
                f"of {db.display_url} (id {state.key_id})"
            )


def stored_key_id(db: Database) -> str | None:
    with db.session() as session:
        key_id: str | None = session.get_one(StoreState, 1).key_id
        return key_id


def rotate(db: Database, old: MasterKey, new: MasterKey) -> int:
    """Re-seal every secret under `new` in one transaction; returns how many."""
    with db.change() as session:
        state = session.get_one(StoreState, 1, with_for_update=True)
        if state.key_check != old.check_value:
            raise MasterKeyError(f"the master key from {old.source} is not this store's key")
        rows = session.scalars(select(Credential).where(Credential.ciphertext.is_not(None))).all()
        for row in rows:
            secret = unseal(old, row.name, row.key_id, row.nonce, row.ciphertext)
            row.key_id, row.nonce, row.ciphertext = seal(new, row.name, secret)
            row.fingerprint = new.fingerprint(secret)
        held = session.scalars(select(Credential).where(Credential.secret_ref.is_not(None)))
        for row in held:  # a reference's mark is keyed too
            assert row.secret_ref is not None
            if row.fingerprint == secretref.mark(old, row.name, row.secret_ref):
                row.fingerprint = secretref.mark(new, row.name, row.secret_ref)
        state.key_id, state.key_check = new.key_id, new.check_value
        return len(rows)
