"""The budget_usage table: tokens charged to each grant's budget, per window, by every replica.

A charge is one INSERT ... ON CONFLICT DO UPDATE per window that adds to the row, so charges
from any number of replicas sum exactly and survive restarts; the check before forwarding is
one SELECT. Neither moves the change counter: usage is not policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.dialects import postgresql, sqlite

from store.db.engine import Database
from store.db.models import BudgetUsage, Grant, Principal
from store.records import BudgetEntry, Usage, grant_state, utcnow
from store.rules import budgets


def used(db: Database, grant_id: int, windows: Sequence[str]) -> dict[str, Usage]:
    """What was charged to the grant in each named window (`day:2026-12-07`); 0 when nothing."""
    with db.session() as session:
        rows = session.execute(
            select(
                BudgetUsage.window,
                BudgetUsage.input_tokens,
                BudgetUsage.output_tokens,
                BudgetUsage.requests,
                BudgetUsage.estimated,
                BudgetUsage.spend_micros,
            ).where(BudgetUsage.grant_id == grant_id, BudgetUsage.window.in_(list(windows)))
        ).all()
    found = {w: Usage(i, o, r, e, s) for w, i, o, r, e, s in rows}
    return {w: found.get(w, Usage()) for w in windows}


def charge(
    db: Database,
    grant_id: int,
    windows: Sequence[str],
    input_tokens: int,
    output_tokens: int,
    estimated: bool,
    spend_micros: int = 0,
) -> None:
    """Add one answer's tokens to each window's row, atomically on both backends."""
    with db.session() as session, session.begin():
        module = postgresql if session.get_bind().dialect.name == "postgresql" else sqlite
        for window in sorted(set(windows)):  # one lock order for every caller
            statement = module.insert(BudgetUsage).values(
                grant_id=grant_id,
                window=window,
                input_tokens=input_tokens,
                output_tokens=output_tokens,
                requests=1,
                estimated=int(estimated),
                spend_micros=spend_micros,
            )
            excluded = statement.excluded
            session.execute(
                statement.on_conflict_do_update(
                    index_elements=[BudgetUsage.grant_id, BudgetUsage.window],
                    set_={
                        "input_tokens": BudgetUsage.input_tokens + excluded.input_tokens,
                        "output_tokens": BudgetUsage.output_tokens + excluded.output_tokens,
                        "requests": BudgetUsage.requests + excluded.requests,
                        "estimated": BudgetUsage.estimated + excluded.estimated,
                        "spend_micros": BudgetUsage.spend_micros + excluded.spend_micros,
                    },
                )
            )


def listing(
    db: Database, principal: str | None = None, now: datetime | None = None
) -> list[BudgetEntry]:
    """Every live grant with a budget, each limit with what its current window used."""
    now = now or utcnow()
    query = (
        select(Grant, Principal.name)
        .join(Principal, Grant.principal_id == Principal.id)
        .where(Grant.budget.is_not(None), Grant.revoked_at.is_(None))
        .order_by(Grant.id)
    )
    if principal is not None:
        query = query.where(Principal.name == principal)
    entries = []
    with db.session() as session:
        for grant, name in session.execute(query).all():
            budget = budgets.from_json(grant.budget) if grant.budget is not None else None
            if budget is None:
                continue
            state = grant_state(grant.revoked_at, grant.consumed_at, grant.expires_at, now)
            keys = {w: budgets.window_key(w, now) for w in budget.windows()}
            rows = {
                r.window: r
                for r in session.scalars(
                    select(BudgetUsage).where(
                        BudgetUsage.grant_id == grant.id,
                        BudgetUsage.window.in_(list(keys.values())),
                    )
                )
            }
            for limit in budget.limits:
                row = rows.get(keys[limit.window])
                usage = Usage()
                if row is not None:
                    usage = Usage(row.input_tokens, row.output_tokens, 0, 0, row.spend_micros)
                spent = usage.of(limit.kind)
                entries.append(
                    BudgetEntry(
                        grant_id=grant.id,
                        principal=name,
                        state=state,
                        kind=limit.kind,
                        window=limit.window,
                        limit=limit.tokens,
                        used=spent,
                        remaining=max(0, limit.tokens - spent),
                        resets_at=budgets.window_end(limit.window, now),
                        requests=0 if row is None else row.requests,
                        estimated=0 if row is None else row.estimated,
                    )
                )
    return entries
