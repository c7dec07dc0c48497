"""The console_tokens table: who may sign in to the approvers' console (`run --console`).

Each row is one operator's token, stored as its hash (the principals' `hash_token`), with an
expiry it always has and a revocation. The proxy never reads this table: a write here moves
no change counter, and an agent's token is never looked for in it.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import ColumnElement, func, select, update
from sqlalchemy.orm import Session

from store.crypto import hash_token, new_token, token_matches
from store.db.engine import Database, rowcount
from store.db.models import ConsoleToken, utcnow
from store.errors import InvalidInput, NotFound
from store.records import ConsoleTokenEntry
from store.rules.grammar import validate_name

# Live tokens at once: a sign-in compares the given token with each of them.
MAX_ACTIVE = 100
ACTIVE, EXPIRED, REVOKED = "active", "expired", "revoked"


def _live(now: datetime) -> tuple[ColumnElement[bool], ...]:
    return (ConsoleToken.revoked_at.is_(None), ConsoleToken.expires_at > now)


def add(db: Database, operator: str, expires_at: datetime) -> str:
    """A new token for `operator`; returns it. Only its hash is kept."""
    validate_name("operator", operator)
    now = utcnow()
    if expires_at <= now:
        raise InvalidInput("a console token's {expires} must be in the future", expires="expiry")
    token = new_token()
    with db.session() as session, session.begin():
        if _count_live(session, now) >= MAX_ACTIVE:
            raise InvalidInput(f"{MAX_ACTIVE} console tokens are live already: revoke one first")
        session.add(
            ConsoleToken(
                operator=operator,
                token_hash=hash_token(token),
                created_at=now,
                expires_at=expires_at,
            )
        )
    return token


def _count_live(session: Session, now: datetime) -> int:
    return session.execute(select(func.count(ConsoleToken.id)).where(*_live(now))).scalar_one()


def live_count(db: Database) -> int:
    """How many tokens are live (`run --console` alone needs one)."""
    with db.session() as session:
        return _count_live(session, utcnow())


def listing(db: Database) -> list[ConsoleTokenEntry]:
    """Every console token in every state, oldest first."""
    now = utcnow()
    with db.session() as session:
        rows = session.scalars(select(ConsoleToken).order_by(ConsoleToken.id)).all()
        return [
            ConsoleTokenEntry(
                id=t.id,
                operator=t.operator,
                created_at=t.created_at,
                expires_at=t.expires_at,
                revoked_at=t.revoked_at,
                state=_state(t, now),
            )
            for t in rows
        ]


def _state(token: ConsoleToken, now: datetime) -> str:
    if token.revoked_at is not None:
        return REVOKED
    if token.expires_at <= now:
        return EXPIRED
    return ACTIVE


def revoke(db: Database, operator: str) -> int:
    """Revoke every live token of `operator`; returns how many. None live is NotFound."""
    now = utcnow()
    with db.session() as session, session.begin():
        done = session.execute(
            update(ConsoleToken)
            .where(ConsoleToken.operator == operator, *_live(now))
            .values(revoked_at=now)
        )
        count = rowcount(done)
    if count == 0:
        raise NotFound(f"operator {operator!r} has no live console token")
    return count


def operator_of(db: Database, token: str) -> tuple[str, int] | None:
    """The operator and token id that `token` is, if live; every live hash is compared."""
    with db.session() as session:
        rows = session.execute(
            select(ConsoleToken.operator, ConsoleToken.id, ConsoleToken.token_hash)
            .where(*_live(utcnow()))
            .limit(MAX_ACTIVE)
        ).all()
    found = None
    for operator, token_id, token_hash in rows:
        if token_matches(token, token_hash):
            found = (operator, token_id)
    return found


def is_live(db: Database, token_id: int) -> bool:
    """Whether the token is neither revoked nor expired: a signed-in session asks each time."""
    with db.session() as session:
        return (
            session.execute(
                select(ConsoleToken.id).where(ConsoleToken.id == token_id, *_live(utcnow()))
            ).first()
            is not None
        )
