"""The proxy's view of the store: one read transaction, compiled into a Snapshot."""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from functools import cache
from typing import Any, TypeVar

from sqlalchemy import Select, Text, cast, select

from store.crypto import MasterKey
from store.db.engine import Database, mark_of
from store.db.models import (
    AccessRequest,
    Credential,
    Grant,
    Principal,
    PrincipalToken,
    StoreState,
    utcnow,
)
from store.errors import InvalidInput, SealError
from store.records import (
    APPROVED,
    HOLD,
    NO_SECRET,
    TOMBSTONE_RETENTION,
    Coverage,
    CredentialRecord,
    GrantRecord,
    SessionToken,
    Snapshot,
)
from store.rules import bodyrules, budgets, secretref
from store.rules.bodyrules import BodyRule
from store.rules.grammar import parse_host, parse_rate
from store.tables import keys

T = TypeVar("T")


Query = Select[*tuple[Any, ...]]
STATE = select(
    StoreState.change_counter, StoreState.key_id, mark_of(StoreState.change_counter)
).where(StoreState.id == 1)


def read(db: Database, key: MasterKey) -> Snapshot:
    """Live principals, credentials with their secrets open, and the grants they hold.

    Its SELECTs run in one read transaction that sees one state of the store (Database.
    reading): the counter it reads is the state's, whatever commits while it runs. (They
    once ran each on the latest commit, checked by the counter after, and started again
    when it had moved: under a steady stream of changes, a read of a large store never
    finished, and every replica went stale.)
    """
    return _read(db, key)


# The four queries below are the snapshot's definition of "live"; the full read and the
# delta read (store/db/delta.py) both use them, so that both see the same records.


def principals() -> Query:
    return select(
        Principal.id, Principal.name, Principal.token_hash, Principal.rate, Principal.burst
    ).where(Principal.disabled_at.is_(None))


def sessions(now: datetime) -> Query:
    # Expired tokens are left out; the proxy also checks expiry per request, so one that
    # expires between two reads is refused without waiting for a store change.
    return select(
        PrincipalToken.principal_id,
        PrincipalToken.id,
        PrincipalToken.token_hash,
        PrincipalToken.expires_at,
    ).where(
        PrincipalToken.revoked_at.is_(None),
        (PrincipalToken.expires_at.is_(None)) | (PrincipalToken.expires_at > now),
    )


def credentials() -> Query:
    return select(
        Credential.id,
        Credential.name,
        Credential.scheme,
        Credential.header_name,
        Credential.param_name,
        _json_text(Credential.hosts),
        Credential.key_id,
        Credential.nonce,
        Credential.ciphertext,
        Credential.fingerprint,
        _json_text(Credential.options),
        Credential.secret_ref,
    ).where(Credential.removed_at.is_(None))


def grants(now: datetime) -> Query:
    # Used once-grants, and grants expired within TOMBSTONE_RETENTION, stay in the
    # snapshot as tombstones: a later request is told grant-consumed or grant-expired,
    # by a restarted proxy as by one that watched the grant go.
    return select(
        Grant.id,
        Grant.principal_id,
        Grant.credential_id,
        _json_text(Grant.hosts),
        _json_text(Grant.methods),
        _json_text(Grant.paths),
        Grant.once,
        Grant.websocket,
        Grant.expires_at,
        Grant.consumed_at.is_not(None).label("consumed"),
        Grant.encoded_slash,
        Grant.rate,
        Grant.burst,
        Grant.max_uses,
        Grant.approval,
        Grant.hold,
        Grant.body,
        Grant.budget,
    ).where(
        Grant.revoked_at.is_(None),
        (Grant.expires_at.is_(None)) | (Grant.expires_at > now - TOMBSTONE_RETENTION),
    )


def coverage(now: datetime) -> Query:
    # Approvals of a `first` grant's held requests that still cover later ones: the proxy
    # checks `until` per request; a counted one is spent in the store. Few rows: the delta
    # read reads them all again whenever an access request or a grant changed.
    return (
        select(
            AccessRequest.grant_id,
            AccessRequest.id,
            AccessRequest.method,
            AccessRequest.host,
            AccessRequest.port,
            AccessRequest.path,
            AccessRequest.cover_until,
            AccessRequest.cover_uses.is_not(None),
            AccessRequest.operation,
        )
        .join(Grant, AccessRequest.grant_id == Grant.id)
        .where(
            AccessRequest.kind == HOLD,
            AccessRequest.state == APPROVED,
            Grant.approval == "first",
            Grant.revoked_at.is_(None),
            # An approval is the owner's word on one principal's requests: a grant a policy
            # file moved to another principal takes none of them along.
            AccessRequest.principal_id == Grant.principal_id,
            (AccessRequest.cover_until.is_(None)) | (AccessRequest.cover_until > now),
            (AccessRequest.cover_uses.is_(None))
            | (AccessRequest.covered < AccessRequest.cover_uses),
        )
        .order_by(AccessRequest.id)
    )


def compile_coverage(rows: Iterable[Any]) -> dict[int, tuple[Coverage, ...]]:
    found: dict[int, tuple[Coverage, ...]] = {}
    for gid, rid, method, host, port, path, until, counted, operation in rows:
        assert gid is not None  # joined to its grant
        cover = Coverage(rid, method, host, port, path, until, bool(counted), operation)
        found[gid] = (*found.get(gid, ()), cover)
    return found


class Compiler:
    """Rows into records; thousands of grants repeat a few lists, so each distinct text is
    decoded and parsed once."""

    def __init__(self, key: MasterKey) -> None:
        self.key = key
        parse = cache(parse_host)
        self.hosts_of = _decoded(lambda hosts: tuple(parse(h) for h in hosts or ()))
        self.methods_of = _decoded(frozenset)
        self.paths_of = _decoded(tuple)
        self.options_of = _decoded(lambda options: options or {})
        self.rate_of = cache(parse_rate)
        self.body_of = cache(_body_rule)
        self.budget_of = cache(budgets.from_json)

    def credentials(
        self, rows: Iterable[Any]
    ) -> tuple[dict[int, CredentialRecord], dict[int, str]]:
        """The readable credentials by id, and the unreadable ones' names by id."""
        by_id: dict[int, CredentialRecord] = {}
        unreadable: dict[int, str] = {}
        # Rows are unpacked, not read by attribute name: that is measurably slower at scale.
        for row in rows:
            cid, name, scheme, header, param, hosts, key_id, nonce, ciphertext, fp, opts = row[:11]
            ref = row[11]
            if ref is not None:  # held elsewhere: the proxy resolves it
                if not hmac.compare_digest(fp, secretref.mark(self.key, name, ref)):
                    unreadable[cid] = name  # not written with the master key: never read
                    continue
                secret, fp = NO_SECRET, ""
            else:
                try:
                    secret = keys.unseal(self.key, name, key_id, nonce, ciphertext)
                except SealError:  # one bad row must not hide the others; it is named
                    unreadable[cid] = name
                    continue
            by_id[cid] = CredentialRecord(
                name=name,
                scheme=scheme,
                header_name=header,
                param_name=param,
                hosts=self.hosts_of(hosts),
                secret=secret,
                fingerprint=fp,
                options=self.options_of(opts),
                secret_ref=ref,
                available=ref is None,
            )
        return by_id, unreadable

    def grant(
        self, row: Sequence[Any], names: dict[int, str], by_id: dict[int, CredentialRecord]
    ) -> GrantRecord | None:
        """The grant as the proxy holds it, or None when it has no place in the snapshot."""
        gid, pid, cred_id, hosts, methods, paths, once, ws, expires, consumed, slash = row[:11]
        rate, burst, max_uses, approval, hold, body, budget_text = row[11:]
        # A spent once- or use-counted grant stays, as a tombstone (grant-consumed).
        if pid not in names or (consumed and not once and max_uses is None):
            return None
        cred = None
        if cred_id is not None:
            cred = by_id.get(cred_id)
            if cred is None:
                return None
        rule = None
        if body is not None:
            rule = self.body_of(body)
            if rule is None:
                return None  # a body rule that cannot be read: no grant, never one without it
        budget = None
        if budget_text is not None:
            budget = self.budget_of(budget_text)
            if budget is None:
                return None  # a budget that cannot be read: no grant, never one without it
        grant_hosts = self.hosts_of(hosts)
        if not grant_hosts and cred is not None:
            grant_hosts = cred.hosts
        return GrantRecord(
            id=gid,
            principal=names[pid],
            credential=cred.name if cred else None,
            hosts=grant_hosts,
            methods=self.methods_of(methods),
            paths=self.paths_of(paths),
            once=once,
            websocket=ws,
            expires_at=expires,
            consumed=consumed,
            encoded_slash=slash,
            rate=self.rate_of(rate) if rate is not None else None,
            burst=burst,
            max_uses=max_uses,
            approval=approval,
            hold=hold,
            body=rule,
            budget=budget,
        )


def _read(db: Database, key: MasterKey) -> Snapshot:
    now = utcnow()
    with db.reading() as connection:
        counter, key_id, mark = connection.execute(STATE).one()
        people = connection.execute(principals()).all()
        tokens = connection.execute(sessions(now)).all()
        creds = connection.execute(credentials()).all()
        rows = connection.execute(grants(now)).all()
        covering = connection.execute(coverage(now)).all()
    compiler = Compiler(key)
    names = {pid: name for pid, name, *_ in people}
    live_sessions: dict[str, list[SessionToken]] = {}
    for pid, tid, token_hash, expires in tokens:
        if pid in names:
            live_sessions.setdefault(names[pid], []).append(SessionToken(tid, token_hash, expires))
    by_id, unreadable = compiler.credentials(creds)
    compiled = []
    for row in rows:
        grant = compiler.grant(row, names, by_id)
        if grant is not None:
            compiled.append(grant)
    return Snapshot(
        counter=counter,
        key_id=key_id,
        token_hashes={name: h for _, name, h, _, _ in people},
        credentials={c.name: c for c in by_id.values()},
        grants=tuple(compiled),
        unreadable=tuple(sorted(unreadable.values())),
        sessions={name: tuple(found) for name, found in live_sessions.items()},
        principal_limits={
            name: (compiler.rate_of(rate), burst)
            for _, name, _, rate, burst in people
            if rate is not None
        },
        principal_ids=names,
        credential_ids={cid: c.name for cid, c in by_id.items()} | unreadable,
        coverage=compile_coverage(covering),
        mark=mark,
    )


def _json_text(attribute: Any) -> Any:
    """A JSON column as its stored text, labelled with its own name."""
    return cast(attribute, Text).label(attribute.key)


def _decoded(parse: Callable[[Any], T]) -> Callable[[str | None], T]:
    """`parse` of the decoded JSON text, once per distinct text (SQL NULL reads as null)."""
    return cache(lambda raw: parse(json.loads(raw) if raw is not None else None))


def _body_rule(text: str) -> BodyRule | None:
    """A stored body rule, or None when it does not validate (a hand-edited row)."""
    try:
        return bodyrules.from_json(text)
    except InvalidInput:
        return None
