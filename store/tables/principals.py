"""The principals table: sandboxes and agents, each known by a hashed token."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from store.crypto import hash_token, new_token
from store.db.changelog import PRINCIPAL
from store.db.engine import Database, changed, covered, rowcount
from store.db.models import AccessRequest, Grant, Principal, utcnow
from store.errors import Conflict, NotFound
from store.records import DENIED, PENDING, PrincipalEntry
from store.rules import validation
from store.rules.grammar import validate_name


def find(session: Session, name: str, *, lock: bool = False) -> Principal | None:
    """The live principal called `name`; `lock` holds its row until the transaction ends."""
    query = select(Principal).where(Principal.name == name, Principal.disabled_at.is_(None))
    return session.scalars(query.with_for_update() if lock else query).first()


def need(session: Session, name: str, *, lock: bool = False) -> Principal:
    principal = find(session, name, lock=lock)
    if principal is None:
        raise NotFound(f"no principal named {name!r}")
    return principal


def add(db: Database, name: str, limits: validation.Limits = validation.NO_LIMITS) -> str:
    """Create a principal; returns its token, which is stored only as a hash."""
    validate_name("principal", name)
    token = new_token()
    with db.change() as session:
        if find(session, name) is not None:
            raise Conflict(f"principal {name!r} already exists")
        row = Principal(
            name=name,
            token_hash=hash_token(token),
            created_at=utcnow(),
            rate=limits.rate,
            burst=limits.burst,
        )
        session.add(row)
        changed(session, PRINCIPAL, row)
    return token


def set_limits(db: Database, name: str, limits: validation.Limits) -> None:
    """Set (or with an empty Limits, clear) the principal's own rate."""
    with db.change() as session:
        principal = need(session, name)
        principal.rate, principal.burst = limits.rate, limits.burst
        changed(session, PRINCIPAL, principal)


def listing(db: Database) -> list[PrincipalEntry]:
    with db.session() as session:
        rows = session.execute(
            select(Principal.name, Principal.created_at, Principal.rate, Principal.burst)
            .where(Principal.disabled_at.is_(None))
            .order_by(Principal.name)
        ).all()
    return [PrincipalEntry(*row) for row in rows]


def remove(db: Database, name: str) -> int:
    """Disable the principal, revoke its grants and deny its pending requests.

    Returns how many grants were revoked.
    """
    with db.change() as session:
        return disable(session, need(session, name), utcnow())


def disable(session: Session, principal: Principal, now: datetime) -> int:
    """`remove` inside the caller's transaction; returns how many grants were revoked."""
    principal.disabled_at = now
    changed(session, PRINCIPAL, principal)  # its grants and tokens are read with it
    # Both reached by the principal's note: the delta reads its grants and decisions.
    session.execute(
        covered(
            update(AccessRequest)
            .where(AccessRequest.principal_id == principal.id, AccessRequest.state == PENDING)
            .values(state=DENIED, decided_at=now, decision_reason="principal removed")
        )
    )
    revoked = session.execute(
        covered(
            update(Grant)
            .where(Grant.principal_id == principal.id, Grant.revoked_at.is_(None))
            .values(revoked_at=now)
        )
    )
    return rowcount(revoked)
