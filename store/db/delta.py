"""What changed since a counter: the change log's rows, read back as records (a Delta).

A replica at counter N reads change_log rows after N and only the rows they name, compiled
by the same queries and code as the full snapshot (store/snapshot.py). None, whenever the
log cannot say: a gap (pruned, or a write that logged nothing), a change logged as ALL
(a key rotation, a policy file), or more rows than a full read would cost. The caller then
reads the whole store.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from sqlalchemy import Connection, or_, select

from store.crypto import MasterKey
from store.db.changelog import ALL, CREDENTIAL, GRANT, MARK, PRINCIPAL, REQUEST, TOKEN
from store.db.engine import Database
from store.db.models import ChangeLog, Credential, Grant, Principal, PrincipalToken, utcnow
from store.records import CredentialRecord, Delta, GrantRecord, PrincipalRecord, SessionToken
from store.snapshot import (
    STATE,
    Compiler,
    Query,
    compile_coverage,
    coverage,
    credentials,
    grants,
    principals,
    sessions,
)

# Past this many rows to read, the full snapshot is the cheaper read.
MAX_ROWS = 20_000


def read(db: Database, key: MasterKey, since: int, mark: int | None = None) -> Delta | None:
    """The changes after counter `since`, read in one state of the store (as snapshot.read):
    the log up to the counter of that state, and the rows it names as they stand in it.
    `mark`: the mark of the change at `since` the caller saw; another one there means the
    store is not the one it read (restored in place, and changed since): None."""
    return _read(db, key, since, mark)


def _read(db: Database, key: MasterKey, since: int, seen: int | None) -> Delta | None:
    now = utcnow()
    with db.reading() as c:
        counter, key_id, mark = c.execute(STATE).one()
        if counter < since:
            return None  # the store went back (a restore): nothing to apply it to
        rows = c.execute(
            select(ChangeLog.counter, ChangeLog.kind, ChangeLog.row_id).where(
                ChangeLog.counter >= since, ChangeLog.counter <= counter
            )
        ).all()
        if seen is not None and (since, MARK, seen) not in {tuple(r) for r in rows}:
            return None  # not the change the caller saw at `since`: another store's history
        log = [(n, kind, row_id) for n, kind, row_id in rows if n > since and kind != MARK]
        if len({n for n, _, _ in log}) != counter - since or len(log) > MAX_ROWS:
            return None
        noted: dict[str, set[int]] = {PRINCIPAL: set(), TOKEN: set(), CREDENTIAL: set()}
        noted[GRANT] = set()
        for _, kind, row_id in log:
            if kind == ALL:
                return None
            if kind in noted:
                noted[kind].add(row_id)
        pids, tids, cids, gids = (noted[k] for k in (PRINCIPAL, TOKEN, CREDENTIAL, GRANT))
        # A principal's change reaches its tokens and grants; a credential's, its grants.
        if pids:
            tids |= set(c.scalars(_ids(PrincipalToken, PrincipalToken.principal_id, pids)))
        if pids or cids:
            gids |= set(
                c.scalars(
                    select(Grant.id).where(
                        or_(_within(Grant.principal_id, pids), _within(Grant.credential_id, cids))
                    )
                )
            )
        if len(pids) + len(tids) + len(cids) + len(gids) > MAX_ROWS:
            return None
        grant_rows = _rows(c, grants(now), Grant.id, gids)
        token_rows = _rows(c, sessions(now), PrincipalToken.id, tids)
        owners = pids | {r[1] for r in grant_rows} | {r[0] for r in token_rows}
        people = _rows(c, principals(), Principal.id, owners)
        wanted = cids | {r[2] for r in grant_rows if r[2] is not None}
        cred_rows = _rows(c, credentials(), Credential.id, wanted)
        # Approvals that cover a `first` grant's requests: few rows, read whole again when an
        # access request or a grant changed.
        covering = (
            c.execute(coverage(now)).all()
            if gids or any(kind == REQUEST for _, kind, _ in log)
            else None
        )
    compiler = Compiler(key)
    names = {pid: name for pid, name, *_ in people}
    by_id, unreadable = compiler.credentials(cred_rows)
    found_principals: dict[int, PrincipalRecord | None] = dict.fromkeys(pids)
    for pid, name, token_hash, rate, burst in people:
        if pid in pids:
            limit = (compiler.rate_of(rate), burst) if rate is not None else None
            found_principals[pid] = PrincipalRecord(name, token_hash, limit)
    found_tokens: dict[int, tuple[str, SessionToken] | None] = dict.fromkeys(tids)
    for pid, tid, token_hash, expires in token_rows:
        if pid in names:
            found_tokens[tid] = (names[pid], SessionToken(tid, token_hash, expires))
    found_credentials: dict[int, CredentialRecord | str | None] = dict.fromkeys(cids)
    for cid in cids:
        found_credentials[cid] = by_id.get(cid) or unreadable.get(cid)
    found_grants: dict[int, GrantRecord | None] = dict.fromkeys(gids)
    for row in grant_rows:
        found_grants[row[0]] = compiler.grant(row, names, by_id)
    return Delta(
        counter=counter,
        key_id=key_id,
        changes=len(log),
        principals=found_principals,
        tokens=found_tokens,
        credentials=found_credentials,
        grants=found_grants,
        # Removing a principal denies its pending requests too.
        decisions=bool(pids) or any(kind == REQUEST for _, kind, _ in log),
        coverage=compile_coverage(covering) if covering is not None else None,
        mark=mark,
    )


def _within(column: Any, ids: Collection[int]) -> Any:
    return column.in_(sorted(ids))


def _rows(c: Connection, query: Query, column: Any, ids: Collection[int]) -> list[Any]:
    return list(c.execute(query.where(_within(column, ids))).all()) if ids else []


def _ids(model: Any, column: Any, ids: Collection[int]) -> Any:
    return select(model.id).where(_within(column, ids))
