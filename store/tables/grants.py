"""The grants table: which principal may use which credential, where and how."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import case, select, update
from sqlalchemy.orm import Session

from store.db.changelog import GRANT
from store.db.engine import Database, bump, changed, covered, rowcount
from store.db.models import Credential, Grant, Principal, utcnow
from store.errors import InvalidInput, NotFound
from store.records import GrantEntry, grant_state
from store.rules import bodyrules, budgets, validation
from store.rules.bodyrules import BodyRule
from store.tables import credentials, principals


def add(
    db: Database,
    principal: str,
    methods: Sequence[str],
    credential: str | None = None,
    hosts: Sequence[str] = (),
    paths: Sequence[str] = (),
    once: bool = False,
    websocket: bool = False,
    expires_at: datetime | None = None,
    purpose: str | None = None,
    encoded_slash: bool = False,
    limits: validation.Limits = validation.NO_LIMITS,
    body: BodyRule | None = None,
) -> int:
    spec = validation.grant_spec(methods, hosts, paths, expires_at, encoded_slash)
    with db.change() as session:
        owner = principals.need(session, principal)
        return insert(
            session,
            owner.id,
            spec,
            credential,
            once=once,
            websocket=websocket,
            purpose=purpose,
            limits=limits,
            body=body,
        )


def insert(
    session: Session,
    principal_id: int,
    spec: validation.GrantSpec,
    credential: str | None,
    *,
    once: bool,
    websocket: bool,
    purpose: str | None,
    limits: validation.Limits = validation.NO_LIMITS,
    body: BodyRule | None = None,
) -> int:
    """Add a grant inside the caller's transaction; returns its id."""
    credential_id, its_hosts = None, []
    if credential is not None:
        cred = credentials.need(session, credential)
        credential_id, its_hosts = cred.id, cred.hosts
    validation.within_credential(spec, credential, its_hosts)
    row = validation.grant_columns(
        spec, once=once, websocket=websocket, purpose=purpose, limits=limits, body=body
    )
    grant = Grant(
        principal_id=principal_id, credential_id=credential_id, created_at=utcnow(), **row
    )
    session.add(grant)
    session.flush()
    changed(session, GRANT, grant.id)
    return grant.id


def listing(db: Database, principal: str | None = None) -> list[GrantEntry]:
    """Every grant, in any state; only a live principal's when `principal` is named."""
    query = (
        select(Grant, Principal.name, Credential.name)
        .join(Principal, Grant.principal_id == Principal.id)
        .outerjoin(Credential, Grant.credential_id == Credential.id)
        .order_by(Grant.id)
    )
    if principal is not None:
        query = query.where(Principal.name == principal, Principal.disabled_at.is_(None))
    now = utcnow()
    with db.session() as session:
        return [
            GrantEntry(
                id=g.id,
                principal=p_name,
                credential=c_name,
                hosts=g.hosts,
                methods=g.methods,
                paths=g.paths,
                once=g.once,
                websocket=g.websocket,
                expires_at=g.expires_at,
                purpose=g.purpose,
                created_at=g.created_at,
                state=grant_state(g.revoked_at, g.consumed_at, g.expires_at, now),
                encoded_slash=g.encoded_slash,
                key=g.key,
                rate=g.rate,
                burst=g.burst,
                max_uses=g.max_uses,
                uses=g.uses,
                approval=g.approval,
                hold=g.hold,
                body=bodyrules.describe(g.body),
                budget=budgets.describe(g.budget),
                cap_max_tokens=budgets.capping(g.budget),
            )
            for g, p_name, c_name in session.execute(query).all()
        ]


def revoke(db: Database, grant_id: int) -> bool:
    """Revoke a grant; False when it was already revoked."""
    with db.change() as session:
        grant = session.get(Grant, grant_id)
        if grant is None:
            raise NotFound(f"no grant with id {grant_id}")
        # db.change() moves the counter either way: the change log must say for what.
        changed(session, GRANT, grant_id)
        if grant.revoked_at is not None:
            return False
        grant.revoked_at = utcnow()
        return True


def set_budget(
    db: Database, grant_id: int, specs: Sequence[str], cap: bool | None = None
) -> str | None:
    """Replace a live grant's token budgets with `specs`, and set whether they cap max_tokens
    (None: as it was); no specs and no cap: no budget. Only a cap: the limits stay. What was
    already charged in each window still counts against the new ones. Returns the stored JSON.

    Raises: InvalidInput, NotFound.
    """
    with db.change() as session:
        grant = session.get(Grant, grant_id)
        if grant is None or grant.revoked_at is not None:
            raise NotFound(f"no live grant with id {grant_id}")
        old = budgets.from_json(grant.budget) if grant.budget is not None else None
        if not specs and cap is not None:
            if old is None:
                raise InvalidInput(
                    f"grant {grant_id} has no {{budget}} to cap max_tokens to", budget="budget"
                )
            specs = old.specs()
        keep = old is not None and old.cap and bool(specs)
        text = budgets.canonical(specs, keep if cap is None else cap)
        changed(session, GRANT, grant_id)
        grant.budget = text
        return text


def consume_once(db: Database, grant_id: int) -> bool:
    """Use a once-grant: True for exactly one caller, across every replica. Only the winner
    moves the change counter: the callers that lost a race changed nothing, and each replica
    would otherwise read and apply one change per loser."""
    now = utcnow()
    with db.session() as session, session.begin():
        result = session.execute(
            covered(
                update(Grant)
                .where(
                    Grant.id == grant_id,
                    Grant.once.is_(True),
                    Grant.consumed_at.is_(None),
                    Grant.revoked_at.is_(None),
                    (Grant.expires_at.is_(None)) | (Grant.expires_at > now),
                )
                .values(consumed_at=now)
            )
        )
        if rowcount(result) != 1:
            return False
        changed(session, GRANT, grant_id)
        bump(session)
        return True


def use(db: Database, grant_id: int) -> bool:
    """Spend one of a use-counted grant's uses: True for exactly max_uses callers, across
    every replica. Only the last use moves the change counter (every proxy then reloads and
    answers grant-consumed); the others cost one conditional UPDATE."""
    now = utcnow()
    with db.session() as session, session.begin():
        spent = session.execute(
            covered(  # noted below when it was the last use; the others change no record
                update(Grant)
                .where(
                    Grant.id == grant_id,
                    Grant.max_uses.is_not(None),
                    Grant.uses < Grant.max_uses,
                    Grant.consumed_at.is_(None),
                    Grant.revoked_at.is_(None),
                    (Grant.expires_at.is_(None)) | (Grant.expires_at > now),
                )
                .values(
                    uses=Grant.uses + 1,
                    consumed_at=case((Grant.uses + 1 >= Grant.max_uses, now), else_=None),
                )
                .returning(Grant.consumed_at)
            )
        ).all()
        if not spent:
            return False
        if spent[0][0] is not None:
            changed(session, GRANT, grant_id)
            bump(session)
        return True
