"""Requests held for an owner's approval: rows of access_requests of kind "hold".

A proxy records a held request (`hold`), polls its state (`states`), and settles it at its
deadline (`settle`); the owner decides with the access-request commands (`approve` here, or
access_requests.deny). An approved hold of a `first` grant covers later requests of its kind
(same grant, method, host, port and path) for good, until a time, or for a number of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta

from sqlalchemy import case, select, update
from sqlalchemy.orm import Session

from store.db.changelog import REQUEST
from store.db.engine import Database, bump, changed, covered
from store.db.models import AccessRequest, Grant, Principal, utcnow
from store.errors import InvalidInput
from store.records import APPROVED, EXPIRED, HOLD, PENDING
from store.tables import principals


def hold(
    db: Database,
    principal: str,
    grant_id: int,
    host: str,
    port: int,
    method: str,
    path: str,
    seconds: int,
    share: bool,
    operation: str | None = None,
    spent: str | None = None,
) -> tuple[int, bool]:
    """Record a held request; returns (id, created). With `share`, one of the same kind
    still pending is joined instead (its count goes up): one decision answers them all.
    `spent`: the request is held to go over its grant's spent budget (these limits).
    Not a policy change: the change counter stays."""
    now = utcnow()
    with db.session() as session, session.begin():
        owner = principals.need(session, principal, lock=True)
        # A write first: SQLite takes its write lock here (FOR UPDATE is PostgreSQL's), so one
        # principal's holds are recorded one at a time there too, and a kind is shared.
        session.execute(
            covered(update(Principal).where(Principal.id == owner.id).values(id=Principal.id))
        )  # writes nothing: only a lock
        if share and spent is None:  # a request over a budget waits on its own decision
            row = session.scalars(
                select(AccessRequest).where(
                    AccessRequest.principal_id == owner.id,
                    AccessRequest.kind == HOLD,
                    AccessRequest.state == PENDING,
                    AccessRequest.grant_id == grant_id,
                    AccessRequest.host == host,
                    AccessRequest.port == port,
                    AccessRequest.method == method,
                    AccessRequest.path == path,
                    AccessRequest.operation.is_(None)
                    if operation is None
                    else AccessRequest.operation == operation,
                    AccessRequest.hold_until > now,
                    AccessRequest.budget_spent.is_(None),
                )
            ).first()
            if row is not None:
                row.count += 1
                row.last_seen = now
                return row.id, False
        row = AccessRequest(
            principal_id=owner.id,
            kind=HOLD,
            grant_id=grant_id,
            host=host,
            port=port,
            method=method,
            path=path,
            source="auto",
            state=PENDING,
            count=1,
            first_seen=now,
            last_seen=now,
            hold_until=now + timedelta(seconds=seconds),
            operation=operation,
            budget_spent=spent,
        )
        session.add(row)
        session.flush()
        return row.id, True


def states(db: Database, ids: Sequence[int]) -> dict[int, str]:
    """The state of each of these held requests."""
    if not ids:
        return {}
    with db.session() as session:
        rows = session.execute(
            select(AccessRequest.id, AccessRequest.state).where(AccessRequest.id.in_(ids))
        ).all()
        return {rid: state for rid, state in rows}


def settle(db: Database, request_id: int) -> str:
    """At the holder's deadline: a still pending hold expires. Returns its final state (a
    decision that landed first stands)."""
    with db.session() as session, session.begin():
        session.execute(
            update(AccessRequest)
            .where(AccessRequest.id == request_id, AccessRequest.state == PENDING)
            .values(state=EXPIRED, decided_at=utcnow())
        )
        state = session.scalar(select(AccessRequest.state).where(AccessRequest.id == request_id))
        return state or EXPIRED


def leave(db: Database, request_id: int) -> None:
    """A held request's client went away: it no longer waits on the decision. The last one
    to leave a pending hold expires it (a later approval lets nothing go)."""
    with db.session() as session, session.begin():
        session.execute(
            update(AccessRequest)
            .where(AccessRequest.id == request_id, AccessRequest.state == PENDING)
            .values(
                state=case((AccessRequest.count <= 1, EXPIRED), else_=AccessRequest.state),
                decided_at=case(
                    (AccessRequest.count <= 1, utcnow()), else_=AccessRequest.decided_at
                ),
                count=case(
                    (AccessRequest.count <= 1, AccessRequest.count), else_=AccessRequest.count - 1
                ),
            )
        )


def use_cover(db: Database, request_id: int) -> bool:
    """Spend one request of an approval counted with --next: True for exactly that many
    callers across replicas. The last one moves the change counter (every proxy drops the
    approval)."""
    with db.session() as session, session.begin():
        spent = session.execute(
            covered(  # noted below when it was the last; the others change no record
                update(AccessRequest)
                .where(
                    AccessRequest.id == request_id,
                    AccessRequest.state == APPROVED,
                    AccessRequest.cover_uses.is_not(None),
                    AccessRequest.covered < AccessRequest.cover_uses,
                )
                .values(
                    covered=AccessRequest.covered + 1,
                    last_seen=utcnow(),
                )
                .returning(
                    case((AccessRequest.covered >= AccessRequest.cover_uses, True), else_=False)
                )
            )
        ).all()
        if not spent:
            return False
        if spent[0][0]:
            # Logged like any change (not a bare counter bump, a gap every replica would
            # answer with a full read): the replicas read the approvals again.
            changed(session, REQUEST, request_id)
            bump(session)
        return True


def approve(
    session: Session, row: AccessRequest, next_uses: int | None, until: datetime | None
) -> None:
    """Approve a pending hold (inside the caller's change transaction)."""
    grant = session.get(Grant, row.grant_id) if row.grant_id is not None else None
    # A request held to go over a spent budget is let go alone: its approval covers none.
    first = grant is not None and grant.approval == "first" and row.budget_spent is None
    if not first and (next_uses is not None or until is not None):
        raise InvalidInput(
            "{next} and {until} go with grants held with approval first (and not with a "
            "request held over its budget)",
            next="--next",
            until="--for",
        )
    row.state, row.decided_at = APPROVED, utcnow()
    # Under `each` the owner let this one request go: none after it, even if a policy file
    # later makes the grant `first` (whose approvals cover their kind).
    row.cover_uses, row.cover_until = (next_uses if first else 0), until
