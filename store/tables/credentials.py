"""The credentials table: secrets sealed under the master key (or where each is held, when
elsewhere), and the hosts each is for."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import select, text, update
from sqlalchemy.orm import Session

from store.crypto import MasterKey, Secret
from store.db.changelog import CREDENTIAL
from store.db.engine import Database, bump, changed, covered, rowcount, sqlite_path
from store.db.models import Credential, Grant, utcnow
from store.errors import Conflict, NotFound, StoreUnavailable
from store.records import CredentialEntry
from store.rules import secretref, validation
from store.rules.grammar import validate_name
from store.tables import keys


def find(session: Session, name: str) -> Credential | None:
    return session.scalars(
        select(Credential).where(Credential.name == name, Credential.removed_at.is_(None))
    ).first()


def need(session: Session, name: str) -> Credential:
    credential = find(session, name)
    if credential is None:
        raise NotFound(f"no credential named {name!r}")
    return credential


def add(
    db: Database,
    key: MasterKey,
    name: str,
    scheme: str,
    hosts: Sequence[str],
    secret: Secret | None,
    header_name: str | None = None,
    param_name: str | None = None,
    options: Mapping[str, Any] | None = None,
    secret_ref: str | None = None,
) -> str:
    """Seal and store a credential, or store where its secret is held (`secret_ref`, then
    `secret` is None); returns its fingerprint, or the reference."""
    validate_name("credential", name)
    patterns = validation.credential_hosts(hosts)
    header_name, param_name = validation.scheme_options(scheme, header_name, param_name)
    settings = validation.credential_options(scheme, options or {}, patterns)
    sealed: tuple[str | None, bytes | None, bytes | None] = (None, None, None)
    fingerprint = ""
    if secret_ref is not None:
        secret_ref = secretref.for_scheme(scheme, secret_ref)
    else:
        assert secret is not None
        secret = validation.scheme_secret(scheme, secret, settings)
        settings |= validation.secret_hint(scheme, secret)
    with db.change() as session:
        if find(session, name) is not None:
            raise Conflict(f"credential {name!r} already exists")
        if secret_ref is not None:
            fingerprint = secretref.mark(key, name, secret_ref)
        elif secret is not None:
            sealed = keys.seal(key, name, secret)
            fingerprint = key.fingerprint(secret)
        row = Credential(
            name=name,
            scheme=scheme,
            header_name=header_name,
            param_name=param_name,
            hosts=[str(p) for p in patterns],
            options=settings or None,
            key_id=sealed[0],
            nonce=sealed[1],
            ciphertext=sealed[2],
            fingerprint=fingerprint,
            secret_ref=secret_ref,
            created_at=utcnow(),
        )
        session.add(row)
        changed(session, CREDENTIAL, row)
    return secret_ref or fingerprint


def listing(db: Database) -> list[CredentialEntry]:
    with db.session() as session:
        rows = session.scalars(
            select(Credential).where(Credential.removed_at.is_(None)).order_by(Credential.name)
        ).all()
        return [
            CredentialEntry(
                name=c.name,
                scheme=c.scheme,
                header_name=c.header_name,
                param_name=c.param_name,
                hosts=c.hosts,
                fingerprint="" if c.secret_ref is not None else c.fingerprint,
                created_at=c.created_at,
                rotated_at=c.rotated_at,
                options=c.options or {},
                secret_ref=c.secret_ref,
                ref_mark=c.fingerprint if c.secret_ref is not None else None,
            )
            for c in rows
        ]


def rotate(
    db: Database, key: MasterKey, name: str, secret: Secret | None, secret_ref: str | None = None
) -> str:
    """Seal a new secret for the credential, or hold it at `secret_ref` instead (`secret`
    None); returns its fingerprint, or the reference."""
    with db.change() as session:
        row = need(session, name)
        settings = dict(row.options or {})
        if secret_ref is not None:
            row.secret_ref = secretref.for_scheme(row.scheme, secret_ref)
            row.key_id = row.nonce = row.ciphertext = None
            row.fingerprint = secretref.mark(key, name, row.secret_ref)
        else:
            assert secret is not None
            secret = validation.scheme_secret(row.scheme, secret, settings)
            hint = validation.secret_hint(row.scheme, secret)
            if hint:
                row.options = settings | hint
            row.key_id, row.nonce, row.ciphertext = keys.seal(key, name, secret)
            row.fingerprint = key.fingerprint(secret)
            row.secret_ref = None
        row.rotated_at = utcnow()
        changed(session, CREDENTIAL, row)  # its grants are read with it
        return row.secret_ref or row.fingerprint


def remove(db: Database, name: str) -> int:
    """Destroy the sealed secret and revoke the credential's grants; returns how many."""
    with db.change() as session:
        return destroy(session, need(session, name), utcnow())


def destroy(session: Session, row: Credential, now: datetime) -> int:
    """`remove` inside the caller's transaction; returns how many grants were revoked."""
    row.removed_at = now
    changed(session, CREDENTIAL, row)
    row.key_id = row.nonce = row.ciphertext = None
    revoked = session.execute(  # reached by the credential's note: its grants are read
        covered(
            update(Grant)
            .where(Grant.credential_id == row.id, Grant.revoked_at.is_(None))
            .values(revoked_at=now)
        )
    )
    return rowcount(revoked)


T = TypeVar("T")


@contextlib.contextmanager
def _one_at_a_time(db: Database, hold: float) -> Iterator[None]:
    """SQLite has no row lock (FOR UPDATE is ignored, and nothing is locked before the first
    write): two processes on one file (--workers, or a second proxy) would both read the same
    refresh token and present it. An exclusive lock on a file beside the database serialises
    the exchanges (SQLite is one host's, so is the lock) and no other write. PostgreSQL's
    row lock does this there."""
    path = sqlite_path(db.url)
    if path is None:
        yield
        return
    fd = os.open(path.with_name(path.name + ".exchange-lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + hold
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise StoreUnavailable("another process held the token exchange") from None
                time.sleep(0.02)
        yield
    finally:
        os.close(fd)  # and with it the lock


def exchange(
    db: Database,
    key: MasterKey,
    name: str,
    fingerprint: str,
    step: Callable[[dict[str, Any]], tuple[T, dict[str, Any] | None]],
    hold: float = 15.0,
) -> T:
    """Run `step` on a JSON secret under the credential's row lock, and seal what it returns
    in the same transaction: a refresh token rotated on use is stored before its access
    token is used, and two replicas never present the same one. The fingerprint stays the
    operator's (what `credential rotate` changes). Raises Conflict when the credential was
    rotated or removed meanwhile; a failing `step` leaves the row as it was. `step` may take
    up to `hold` seconds (PostgreSQL's timeouts are raised for this transaction to match).
    Only a secret sealed back is a change: the replicas read that credential again, not the
    whole store, and an exchange that seals nothing moves no counter.
    """
    with _one_at_a_time(db, hold), db.session() as session, session.begin():
        if session.get_bind().dialect.name == "postgresql":
            ms = int(hold * 1000)
            session.execute(text(f"SET LOCAL statement_timeout = {ms}"))
            session.execute(text(f"SET LOCAL idle_in_transaction_session_timeout = {ms}"))
        row = session.scalars(
            select(Credential)
            .where(Credential.name == name, Credential.removed_at.is_(None))
            .with_for_update()
        ).first()
        if row is None or row.fingerprint != fingerprint:
            raise Conflict(f"credential {name!r} changed")
        read_nonce = row.nonce
        plain = keys.unseal(key, name, row.key_id, read_nonce, row.ciphertext)
        result, updated = step(json.loads(plain.reveal()))
        if updated is not None:
            sealed = Secret(json.dumps(updated, separators=(",", ":"), sort_keys=True).encode())
            key_id, nonce, ciphertext = keys.seal(key, name, sealed)
            # Written only over what was read: SQLite's read takes no lock, and a rotate or
            # remove meanwhile must win (a new nonce comes with every seal).
            written = session.execute(
                covered(  # the credential, noted below
                    update(Credential)
                    .where(
                        Credential.id == row.id,
                        Credential.fingerprint == fingerprint,
                        Credential.nonce == read_nonce,
                        Credential.removed_at.is_(None),
                    )
                    .values(key_id=key_id, nonce=nonce, ciphertext=ciphertext)
                    .execution_options(synchronize_session=False)
                )
            )
            if rowcount(written) != 1:
                raise Conflict(f"credential {name!r} changed")
            changed(session, CREDENTIAL, row.id)
            bump(session)
        return result
