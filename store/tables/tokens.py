"""The principal_tokens table: a principal's further tokens (sessions), stored as hashes.

The long-lived token made by `principal add` stays in principals.token_hash; these are the
others, each with an id, an optional expiry and a revocation.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select

from store.crypto import hash_token, new_token
from store.db.changelog import TOKEN
from store.db.engine import Database, changed
from store.db.models import Principal, PrincipalToken, utcnow
from store.errors import InvalidInput, NotFound
from store.records import TokenEntry
from store.tables import principals

MAX_NOTE = 200
ACTIVE, EXPIRED, REVOKED = "active", "expired", "revoked"


def add(
    db: Database, principal: str, expires_at: datetime | None, note: str | None = None
) -> tuple[int, str]:
    """A new token for the live principal; returns its id and the token, stored only hashed."""
    if note is not None and (len(note) > MAX_NOTE or not note.isprintable()):
        raise InvalidInput(f"a token's note is at most {MAX_NOTE} printable characters")
    token = new_token()
    with db.change() as session:
        owner = principals.need(session, principal)
        row = PrincipalToken(
            principal_id=owner.id,
            token_hash=hash_token(token),
            note=note,
            created_at=utcnow(),
            expires_at=expires_at,
        )
        session.add(row)
        session.flush()
        changed(session, TOKEN, row.id)
        return row.id, token


def listing(db: Database, principal: str | None = None) -> list[TokenEntry]:
    """Tokens of live principals (of one, if named), in every state."""
    now = utcnow()
    with db.session() as session:
        query = (
            select(PrincipalToken, Principal.name)
            .join(Principal, Principal.id == PrincipalToken.principal_id)
            .where(Principal.disabled_at.is_(None))
            .order_by(PrincipalToken.id)
        )
        if principal is not None:
            query = query.where(Principal.name == principal)
        rows = session.execute(query).all()
        return [
            TokenEntry(
                id=t.id,
                principal=name,
                note=t.note,
                created_at=t.created_at,
                expires_at=t.expires_at,
                revoked_at=t.revoked_at,
                state=_state(t, now),
            )
            for t, name in rows
        ]


def _state(token: PrincipalToken, now: datetime) -> str:
    if token.revoked_at is not None:
        return REVOKED
    if token.expires_at is not None and token.expires_at <= now:
        return EXPIRED
    return ACTIVE


def revoke(db: Database, token_id: int) -> None:
    """Revoke one token; revoking it again is harmless, an unknown id is NotFound."""
    with db.change() as session:
        token = session.get(PrincipalToken, token_id)
        if token is None:
            raise NotFound(f"no token with id {token_id}")
        if token.revoked_at is None:
            token.revoked_at = utcnow()
        changed(session, TOKEN, token_id)
