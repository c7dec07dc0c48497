"""What the store's tests share: a seeded store, and rows read back past the Store API."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from store.crypto import Secret
from store.repository import Store

SECRET = Secret(b"ghp_0123456789abcdef")


def seed(store: Store) -> int:
    """Principal `agent`, bearer credential `gh` on api.github.com, and a grant for it."""
    store.add_principal("agent")
    store.add_credential("gh", "bearer", ["api.github.com"], SECRET)
    return store.add_grant("agent", ["GET"], credential="gh")


def read_row(store: Store, model: type, name: str) -> object:
    with Session(store.engine) as session:
        return session.scalars(select(model).where(model.name == name)).one()


def grant_state(store: Store, grant_id: int) -> str:
    (grant,) = [g for g in store.list_grants() if g.id == grant_id]
    return grant.state
