"""The access_requests table: what agents were denied or asked for, and the owner's decision."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Select, func, select, update
from sqlalchemy.orm import Session

from store.db.changelog import GRANT, REQUEST
from store.db.engine import Database, changed, covered
from store.db.models import AccessRequest, Grant, Principal, utcnow
from store.errors import InvalidInput, NotFound
from store.records import ACCESS, APPROVED, BUDGET, DENIED, HOLD, PENDING, AccessRequestEntry
from store.rules import budgets, validation
from store.rules.grammar import HostPattern
from store.tables import approvals, grants, principals

MAX_PENDING_PER_PRINCIPAL = 50


def record(
    db: Database,
    principal: str,
    host: str,
    port: int,
    method: str,
    path: str,
    purpose: str | None = None,
    explicit: bool = False,
) -> tuple[int, str] | None:
    """Record what a principal was denied or asks for; returns (id, state).

    Returns None when the principal already has MAX_PENDING_PER_PRINCIPAL pending requests.
    Not a policy change, so the change counter stays.
    """
    validation.request(host, port, method, path, purpose, explicit)
    now = utcnow()
    with db.session() as session, session.begin():
        # The lock serialises one principal's requests across replicas: no duplicate
        # rows, and the limit holds.
        owner = principals.need(session, principal, lock=True)
        row = session.scalars(
            select(AccessRequest).where(
                AccessRequest.principal_id == owner.id,
                AccessRequest.kind == ACCESS,
                AccessRequest.state == PENDING,
                AccessRequest.host == host,
                AccessRequest.port == port,
                AccessRequest.method == method,
                AccessRequest.path == path,
            )
        ).first()
        if row is not None:
            row.count += 1
            row.last_seen = now
            if explicit:
                row.source = "explicit"
                if purpose is not None:
                    row.purpose = purpose
            return row.id, row.state
        pending = session.scalar(
            select(func.count())
            .select_from(AccessRequest)
            .where(
                AccessRequest.principal_id == owner.id,
                AccessRequest.kind == ACCESS,
                AccessRequest.state == PENDING,
            )
        )
        if (pending or 0) >= MAX_PENDING_PER_PRINCIPAL:
            return None
        row = AccessRequest(
            principal_id=owner.id,
            host=host,
            port=port,
            method=method,
            path=path,
            purpose=purpose,
            source="explicit" if explicit else "auto",
            state=PENDING,
            count=1,
            first_seen=now,
            last_seen=now,
        )
        session.add(row)
        session.flush()
        return row.id, row.state


def record_budget(
    db: Database,
    principal: str,
    grant_id: int,
    host: str,
    port: int,
    method: str,
    path: str,
    spent: str,
) -> tuple[int, str]:
    """Record that `grant_id`'s budget refused a request (`spent`: the limits found spent,
    `total=200000/day`); returns (id, state). One pending request per grant: a later refusal
    counts on it and names what is spent now. Not a policy change: the counter stays."""
    validation.request(host, port, method, path, None, False)
    now = utcnow()
    with db.session() as session, session.begin():
        owner = principals.need(session, principal, lock=True)
        row = session.scalars(
            select(AccessRequest).where(
                AccessRequest.principal_id == owner.id,
                AccessRequest.kind == BUDGET,
                AccessRequest.state == PENDING,
                AccessRequest.grant_id == grant_id,
            )
        ).first()
        if row is not None:
            row.count += 1
            row.last_seen = now
            row.budget_spent = spent
            return row.id, row.state
        row = AccessRequest(
            principal_id=owner.id,
            kind=BUDGET,
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
            budget_spent=spent,
        )
        session.add(row)
        session.flush()
        return row.id, row.state


def get(db: Database, principal: str, request_id: int) -> AccessRequestEntry | None:
    """One of `principal`'s own requests; another principal's id reads as None."""
    with db.session() as session:
        found = session.execute(
            _query().where(
                AccessRequest.id == request_id,
                Principal.name == principal,
                Principal.disabled_at.is_(None),
            )
        ).first()
        return _entry(found[0], found[1]) if found else None


def listing(db: Database, state: str | None = None) -> list[AccessRequestEntry]:
    query = _query()
    if state is not None:
        query = query.where(AccessRequest.state == validation.request_state(state))
    with db.session() as session:
        return [_entry(row, name) for row, name in session.execute(query).all()]


def pending(db: Database) -> list[AccessRequestEntry]:
    """Requests of kind access (not holds) still waiting for a decision."""
    query = _query().where(AccessRequest.kind == ACCESS, AccessRequest.state == PENDING)
    with db.session() as session:
        return [_entry(row, name) for row, name in session.execute(query).all()]


def decided_since(db: Database, since: datetime) -> list[AccessRequestEntry]:
    """Requests approved or denied after `since`, oldest first."""
    query = (
        _query()
        .where(AccessRequest.decided_at > since)
        .order_by(None)
        .order_by(AccessRequest.decided_at, AccessRequest.id)
    )
    with db.session() as session:
        return [_entry(row, name) for row, name in session.execute(query).all()]


def approve(
    db: Database,
    request_id: int,
    credential: str | None = None,
    path: str | None = None,
    once: bool = False,
    expires_at: datetime | None = None,
    next_uses: int | None = None,
    cover_until: datetime | None = None,
    decided_by: str | None = None,
) -> tuple[str, int | None]:
    """Turn a pending access request into a grant, narrowed to `path` if given, or let a
    held request go on; returns the kind and the grant's id (a new grant for an access
    request, the grant it was held under for a hold). A budget request is approved with
    `approve_budget` only."""
    with db.change() as session:
        row = _pending(session, request_id)
        if row.kind == BUDGET:
            raise InvalidInput(
                f"request {request_id} asks to raise grant {row.grant_id}'s budget "
                f"({row.budget_spent} is spent): approve it with {{budget}} KIND=TOKENS/WINDOW",
                budget="a budget",
            )
        row.decided_by = decided_by
        if row.kind == HOLD:
            given: dict[str, object] = {"credential": credential, "path": path}
            given |= {"once": once or None, "expires": expires_at}
            for flag, value in given.items():
                if value is not None:
                    raise InvalidInput(
                        f"{{{flag}}} goes with access requests: request {request_id} is a "
                        "held request",
                        **{flag: flag},
                    )
            approvals.approve(session, row, next_uses, cover_until)
            return HOLD, row.grant_id
        if next_uses is not None or cover_until is not None:
            raise InvalidInput(
                f"{{next}} and {{until}} go with held requests: request {request_id} is an "
                "access request",
                next="--next",
                until="--for",
            )
        if path is None:
            validation.approvable_path(request_id, row.path)
        host = HostPattern(row.host, None if row.port == 443 else row.port)
        spec = validation.grant_spec([row.method], [str(host)], [path or row.path], expires_at)
        purpose = f"access request {row.id}" + (f": {row.purpose}" if row.purpose else "")
        grant_id = grants.insert(
            session,
            row.principal_id,
            spec,
            credential,
            once=once,
            websocket=False,
            purpose=purpose,
        )
        row.state, row.decided_at, row.grant_id = APPROVED, utcnow(), grant_id
        changed(session, REQUEST, row)
        return ACCESS, grant_id


def approve_budget(
    db: Database, request_id: int, specs: list[str], decided_by: str | None = None
) -> tuple[int, str | None, str]:
    """Approve a pending budget request by replacing its grant's budget with `specs`, as
    `grant budget` does (what was charged in each window still counts); returns the grant's
    id and its budget before and after, described.

    Raises: InvalidInput (no specs, a bad one, another kind of request, a revoked grant),
    NotFound.
    """
    text = budgets.canonical(specs)
    if text is None:
        raise InvalidInput("{budget} is needed to raise a budget", budget="a budget")
    with db.change() as session:
        row = _pending(session, request_id)
        if row.kind != BUDGET:
            raise InvalidInput(
                f"{{budget}} goes with budget requests: request {request_id} is a {row.kind} "
                "request",
                budget="a budget",
            )
        grant = session.get(Grant, row.grant_id) if row.grant_id is not None else None
        if grant is None or grant.revoked_at is not None:
            raise InvalidInput(f"grant {row.grant_id} is revoked: deny request {request_id}")
        was = budgets.describe(grant.budget)
        if budgets.capping(grant.budget):
            # As `grant budget` does: a raised budget keeps the grant's max_tokens cap.
            text = budgets.canonical(specs, cap=True)
        now = budgets.describe(text)
        assert now is not None
        grant.budget = text
        changed(session, GRANT, grant.id)
        row.state, row.decided_at, row.decided_by = APPROVED, utcnow(), decided_by
        row.budget_was, row.budget_set = was, now
        changed(session, REQUEST, row)
        return grant.id, was, now


def deny(
    db: Database, request_id: int, reason: str | None = None, decided_by: str | None = None
) -> None:
    if reason is not None:
        validation.text("reason", reason)
    # A change like any other, so every proxy reloads and writes the decision's audit line.
    with db.change() as session:
        row = _pending(session, request_id)
        row.state, row.decided_at, row.decision_reason = DENIED, utcnow(), reason
        row.decided_by = decided_by
        changed(session, REQUEST, row)


def _pending(session: Session, request_id: int) -> AccessRequest:
    # A write first: SQLite takes its write lock here (FOR UPDATE is PostgreSQL's; its
    # driver runs a lone SELECT outside the transaction), so the state read below is the
    # one this change replaces: two decisions, or a decision and a hold's deadline, never
    # both take.
    session.execute(
        covered(  # writes nothing: the decision below is noted by the caller
            update(AccessRequest).where(AccessRequest.id == request_id).values(id=AccessRequest.id)
        )
    )
    row = session.get(AccessRequest, request_id, with_for_update=True)
    if row is None:
        raise NotFound(f"no access request with id {request_id}")
    if row.state != PENDING:
        raise InvalidInput(f"request {request_id} is {row.state}, not pending")
    return row


def _query() -> Select[AccessRequest, str]:
    return (
        select(AccessRequest, Principal.name)
        .join(Principal, AccessRequest.principal_id == Principal.id)
        .order_by(AccessRequest.id)
    )


def _entry(row: AccessRequest, principal: str) -> AccessRequestEntry:
    return AccessRequestEntry(
        id=row.id,
        principal=principal,
        host=row.host,
        port=row.port,
        method=row.method,
        path=row.path,
        purpose=row.purpose,
        source=row.source,
        state=row.state,
        count=row.count,
        first_seen=row.first_seen,
        last_seen=row.last_seen,
        decided_at=row.decided_at,
        decision_reason=row.decision_reason,
        grant_id=row.grant_id,
        kind=row.kind,
        operation=row.operation,
        hold_until=row.hold_until,
        cover_until=row.cover_until,
        cover_uses=row.cover_uses,
        covered=row.covered,
        budget_spent=row.budget_spent,
        budget_was=row.budget_was,
        budget_set=row.budget_set,
        decided_by=row.decided_by,
    )
