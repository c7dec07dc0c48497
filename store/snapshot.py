"""The proxy's view of the store: one read transaction, compiled into a Snapshot."""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cache
from typing import Any, TypeVar

from sqlalchemy import Text, cast, select

from store import keys
from store.crypto import MasterKey
from store.engine import Database
from store.errors import SealError, StoreUnavailable
from store.grammar import parse_host, parse_rate
from store.models import (
    AccessRequest,
    Credential,
    Grant,
    Principal,
    PrincipalToken,
    StoreState,
    utcnow,
)
from store.records import (
    APPROVED,
    HOLD,
    TOMBSTONE_RETENTION,
    Coverage,
    CredentialRecord,
    GrantRecord,
    SessionToken,
    Snapshot,
)

T = TypeVar("T")


# Reads in a row that may find the store changing before one is whole.
READ_ATTEMPTS = 5
_COUNTER = select(StoreState.change_counter).where(StoreState.id == 1)


def read(db: Database, key: MasterKey) -> Snapshot:
    """Live principals, credentials with their secrets open, and the grants they hold.

    Its SELECTs may each see a later commit (READ COMMITTED; SQLite starts no transaction
    for a SELECT): a snapshot is kept only if the change counter did not move while it was
    read. Every write the snapshot can see moves the counter (Database.change), so an
    unmoved counter means no write landed between the first SELECT and the last.
    """
    for _ in range(READ_ATTEMPTS):
        snapshot = _read(db, key)
        with db.reading() as connection:
            if connection.execute(_COUNTER).scalar_one() == snapshot.counter:
                return snapshot
    raise StoreUnavailable("the store kept changing while its snapshot was read")


def _read(db: Database, key: MasterKey) -> Snapshot:
    now = utcnow()
    with db.reading() as connection:
        counter, key_id = connection.execute(
            select(StoreState.change_counter, StoreState.key_id).where(StoreState.id == 1)
        ).one()
        principals = connection.execute(
            select(Principal.id, Principal.name, Principal.token_hash).where(
                Principal.disabled_at.is_(None)
            )
        ).all()
        # Expired tokens are left out; the proxy also checks expiry per request, so one that
        # expires between two reads is refused without waiting for a store change.
        sessions = connection.execute(
            select(
                PrincipalToken.principal_id,
                PrincipalToken.id,
                PrincipalToken.token_hash,
                PrincipalToken.expires_at,
            ).where(
                PrincipalToken.revoked_at.is_(None),
                (PrincipalToken.expires_at.is_(None)) | (PrincipalToken.expires_at > now),
            )
        ).all()
        limited = connection.execute(
            select(Principal.name, Principal.rate, Principal.burst).where(
                Principal.disabled_at.is_(None), Principal.rate.is_not(None)
            )
        ).all()
        creds = connection.execute(
            select(
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
            ).where(Credential.removed_at.is_(None))
        ).all()
        # Used once-grants, and grants expired within TOMBSTONE_RETENTION, stay in the
        # snapshot as tombstones: a later request is told grant-consumed or grant-expired,
        # by a restarted proxy as by one that watched the grant go.
        grants = connection.execute(
            select(
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
            ).where(
                Grant.revoked_at.is_(None),
                (Grant.expires_at.is_(None)) | (Grant.expires_at > now - TOMBSTONE_RETENTION),
            )
        ).all()
        # Approvals of a `first` grant's held requests that still cover later ones: the
        # proxy checks `until` per request; a counted one is spent in the store.
        covering = connection.execute(
            select(
                AccessRequest.grant_id,
                AccessRequest.id,
                AccessRequest.method,
                AccessRequest.host,
                AccessRequest.port,
                AccessRequest.path,
                AccessRequest.cover_until,
                AccessRequest.cover_uses.is_not(None),
            )
            .join(Grant, AccessRequest.grant_id == Grant.id)
            .where(
                AccessRequest.kind == HOLD,
                AccessRequest.state == APPROVED,
                Grant.approval == "first",
                Grant.revoked_at.is_(None),
                (AccessRequest.cover_until.is_(None)) | (AccessRequest.cover_until > now),
                (AccessRequest.cover_uses.is_(None))
                | (AccessRequest.covered < AccessRequest.cover_uses),
            )
            .order_by(AccessRequest.id)
        ).all()
    coverage: dict[int, tuple[Coverage, ...]] = {}
    for gid, rid, method, host, port, path, until, counted in covering:
        assert gid is not None  # joined to its grant
        found = Coverage(rid, method, host, port, path, until, bool(counted))
        coverage[gid] = (*coverage.get(gid, ()), found)
    # Thousands of grants repeat a few lists: each distinct text is decoded and parsed once.
    parse = cache(parse_host)
    hosts_of = _decoded(lambda hosts: tuple(parse(h) for h in hosts or ()))
    methods_of = _decoded(frozenset)
    paths_of = _decoded(tuple)
    options_of = _decoded(lambda options: options or {})
    names = {pid: name for pid, name, _ in principals}
    live_sessions: dict[str, list[SessionToken]] = {}
    for pid, tid, token_hash, expires in sessions:
        if pid in names:
            live_sessions.setdefault(names[pid], []).append(SessionToken(tid, token_hash, expires))
    records: dict[str, CredentialRecord] = {}
    by_id: dict[int, CredentialRecord] = {}
    unreadable = []
    # Rows are unpacked, not read by attribute name: that is measurably slower at scale.
    for cid, name, scheme, header, param, hosts, key_id, nonce, ciphertext, fp, opts in creds:
        try:
            secret = keys.unseal(key, name, key_id, nonce, ciphertext)
        except SealError:  # one bad row must not hide the others; it is named
            unreadable.append(name)
            continue
        rec = CredentialRecord(
            name=name,
            scheme=scheme,
            header_name=header,
            param_name=param,
            hosts=hosts_of(hosts),
            secret=secret,
            fingerprint=fp,
            options=options_of(opts),
        )
        records[name] = by_id[cid] = rec
    compiled = []
    rate_of = cache(parse_rate)
    for row in grants:
        gid, pid, cred_id, hosts, methods, paths, once, ws, expires, consumed, slash = row[:11]
        rate, burst, max_uses, approval, hold = row[11:]
        # A spent once- or use-counted grant stays, as a tombstone (grant-consumed).
        if pid not in names or (consumed and not once and max_uses is None):
            continue
        cred = None
        if cred_id is not None:
            cred = by_id.get(cred_id)
            if cred is None:
                continue
        grant_hosts = hosts_of(hosts)
        if not grant_hosts and cred is not None:
            grant_hosts = cred.hosts
        compiled.append(
            GrantRecord(
                id=gid,
                principal=names[pid],
                credential=cred.name if cred else None,
                hosts=grant_hosts,
                methods=methods_of(methods),
                paths=paths_of(paths),
                once=once,
                websocket=ws,
                expires_at=expires,
                consumed=consumed,
                encoded_slash=slash,
                rate=rate_of(rate) if rate is not None else None,
                burst=burst,
                max_uses=max_uses,
                approval=approval,
                hold=hold,
            )
        )
    return Snapshot(
        counter=counter,
        key_id=key_id,
        token_hashes={name: h for _, name, h in principals},
        credentials=records,
        grants=tuple(compiled),
        unreadable=tuple(sorted(unreadable)),
        sessions={name: tuple(found) for name, found in live_sessions.items()},
        principal_limits={name: (rate_of(rate), burst) for name, rate, burst in limited},
        coverage=coverage,
    )


def _json_text(attribute: Any) -> Any:
    """A JSON column as its stored text, labelled with its own name."""
    return cast(attribute, Text).label(attribute.key)


def _decoded(parse: Callable[[Any], T]) -> Callable[[str | None], T]:
    """`parse` of the decoded JSON text, once per distinct text (SQL NULL reads as null)."""
    return cache(lambda raw: parse(json.loads(raw) if raw is not None else None))
