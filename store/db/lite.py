"""`principal add`, `grant add` and `grant list` on an SQLite store, without SQLAlchemy.

These are the commands a sandbox runner's script calls one by one, and importing SQLAlchemy
and the models costs most of such a call (0.5-0.8 s on a 2-vCPU machine, against 0.06 s for
Python itself). Here they run on the standard library's sqlite3, and do what the ORM path
does: the same validation (store/rules/validation.py), the schema at head and the master key the
store's own, the same rows byte for byte (tests/store/db/test_lite.py holds the two paths to
that) and
the same change_log entries (store/db/changelog.py), from which every proxy reads its delta.

Only the plain `sqlite:///PATH` form is served here; any other URL (PostgreSQL: psycopg alone
costs 0.3 s to import) and every other command goes through store/repository.py.
"""

from __future__ import annotations

import functools
import json
import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

from store.crypto import MasterKey, hash_token, new_token
from store.db import changelog, revisions
from store.errors import Conflict, MasterKeyError, NotFound, StoreUnavailable
from store.records import GrantEntry, grant_state, utcnow
from store.rules import bodyrules, budgets, validation
from store.rules.bodyrules import BodyRule
from store.rules.grammar import validate_name

_PREFIX = "sqlite:///"
_LIST_GRANTS = (
    "SELECT g.id, p.name, c.name, g.hosts, g.methods, g.paths, g.once, g.websocket, "
    "g.expires_at, g.purpose, g.created_at, g.revoked_at, g.consumed_at, g.encoded_slash, "
    "g.key, g.rate, g.burst, g.max_uses, g.uses, g.approval, g.hold, g.body, g.budget "
    "FROM grants g JOIN principals p ON g.principal_id = p.id "
    "LEFT OUTER JOIN credentials c ON g.credential_id = c.id"
)
_OF_PRINCIPAL = " WHERE p.name = ? AND p.disabled_at IS NULL"


def sqlite_file(url: str) -> Path | None:
    """The file behind a plain `sqlite:///PATH` URL; None for anything this module leaves to
    SQLAlchemy (another backend or driver, a query string, an escaped or in-memory name)."""
    if not url.startswith(_PREFIX):
        return None
    path = url[len(_PREFIX) :]
    if not path or path == ":memory:" or any(c in path for c in "?#%"):
        return None
    return Path(path)


def display_url(url: str) -> str:
    """The URL as store.engine.display_url shows it (SQLAlchemy's render_as_string), so that
    both paths name the store alike: the path percent-encoded but for ` +/`; as typed when
    it cannot be (SQLAlchemy's fallback). A file URL holds no password."""
    try:
        return _PREFIX + quote(url[len(_PREFIX) :], safe=" +/")
    except UnicodeEncodeError:
        return url


def _stamp(value: datetime) -> str:
    """A datetime as SQLAlchemy's SQLite DateTime stores it: naive UTC, microseconds."""
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")


def _time(value: str | None) -> datetime | None:
    return None if value is None else datetime.fromisoformat(value).replace(tzinfo=UTC)


@functools.lru_cache(maxsize=1024)
def _parsed(text: str) -> tuple[str, ...] | None:
    """A JSON list column; grants repeat a few values (["GET"], ["/"]) by the thousand."""
    value = json.loads(text)
    return None if value is None else tuple(value)


def _list(text: str | None) -> list[str] | None:
    value = None if text is None else _parsed(text)
    return None if value is None else list(value)


def _first_line(e: sqlite3.Error) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


class Store:
    """The SQLite store at `path`; `key` None for a command that reads no secret."""

    def __init__(self, url: str, path: Path, key: MasterKey | None) -> None:
        self.display_url = display_url(url)
        self.key = key
        if not path.is_file():
            raise StoreUnavailable(f"no store at {path}: run credproxy init")
        # Read-write, never create: a store deleted or moved away is not replaced.
        try:
            self._db = sqlite3.connect(
                f"file:{quote(str(path))}?mode=rw", uri=True, timeout=5, isolation_level=None
            )
            self._db.execute("PRAGMA foreign_keys=ON")
            self._db.execute("PRAGMA journal_mode=WAL")
        except sqlite3.Error as e:
            raise StoreUnavailable(f"cannot reach database {url}: {_first_line(e)}") from e
        with self._reading() as db:
            self._check_ready(db)

    def close(self) -> None:
        self._db.close()

    @contextmanager
    def _transaction(self, begin: str) -> Iterator[sqlite3.Connection]:
        try:
            self._db.execute(begin)
            try:
                yield self._db
                self._db.execute("COMMIT")
            except BaseException:
                # SQLite rolls some failures back itself (an interrupt, an I/O error, a full
                # disk): then there is nothing to roll back, and the error to report is theirs.
                if self._db.in_transaction:
                    with suppress(sqlite3.Error):
                        self._db.execute("ROLLBACK")
                raise
        except sqlite3.IntegrityError as e:
            raise Conflict("the change conflicts with an existing record") from e
        except sqlite3.Error as e:
            raise StoreUnavailable(f"database {self.display_url} failed: {_first_line(e)}") from e

    def _reading(self) -> Any:
        return self._transaction("BEGIN")

    def _changing(self) -> Any:
        # IMMEDIATE: the write lock first, so that the reads below see the state it changes.
        return self._transaction("BEGIN IMMEDIATE")

    def _check_ready(self, db: sqlite3.Connection) -> None:
        """What Settings.store() and reader() check: schema at head, and the key the store's."""
        has_versions = db.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'alembic_version'"
        ).fetchone()
        versions = (
            sorted(v for (v,) in db.execute("SELECT version_num FROM alembic_version"))
            if has_versions
            else []
        )
        # More than one row (branched heads) reads as neither head nor none.
        revisions.check_head(self.display_url, ", ".join(versions) or None)
        if self.key is None:
            return
        row = db.execute("SELECT key_id, key_check FROM store_state WHERE id = 1").fetchone()
        if row is None or row[1] is None:
            raise MasterKeyError(f"{self.display_url} has no master key yet: run credproxy init")
        if row[1] != self.key.check_value:
            raise MasterKeyError(
                f"the master key from {self.key.source} (id {self.key.key_id}) is not the key "
                f"of {self.display_url} (id {row[0]})"
            )

    @staticmethod
    def _bump(db: sqlite3.Connection, kind: str, row_id: int) -> None:
        """store.db.engine.bump: move the change counter, log the change and its mark."""
        (counter,) = db.execute(
            "UPDATE store_state SET change_counter = change_counter + 1 WHERE id = 1 "
            "RETURNING change_counter"
        ).fetchone()
        db.executemany(
            "INSERT INTO change_log (counter, kind, row_id) VALUES (?, ?, ?)",
            [(counter, k, i) for k, i in changelog.rows([(kind, row_id)])],
        )
        prune = changelog.pruned_through(counter)
        if prune is not None:
            db.execute("DELETE FROM change_log WHERE counter <= ?", (prune,))

    @staticmethod
    def _principal_id(db: sqlite3.Connection, name: str) -> int | None:
        row = db.execute(
            "SELECT id FROM principals WHERE name = ? AND disabled_at IS NULL", (name,)
        ).fetchone()
        return None if row is None else int(row[0])

    # -- the commands --------------------------------------------------------------------

    def add_principal(self, name: str, limits: validation.Limits = validation.NO_LIMITS) -> str:
        """store.tables.principals.add: returns the token, which is stored only as a hash."""
        validate_name("principal", name)
        token = new_token()
        with self._changing() as db:
            if self._principal_id(db, name) is not None:
                raise Conflict(f"principal {name!r} already exists")
            row_id = db.execute(
                "INSERT INTO principals (name, token_hash, created_at, rate, burst) "
                "VALUES (?, ?, ?, ?, ?) RETURNING id",
                (name, hash_token(token), _stamp(utcnow()), limits.rate, limits.burst),
            ).fetchone()[0]
            self._bump(db, changelog.PRINCIPAL, row_id)
        return token

    def add_grant(
        self,
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
        """store.tables.grants.add: returns the new grant's id."""
        spec = validation.grant_spec(methods, hosts, paths, expires_at, encoded_slash)
        with self._changing() as db:
            owner = self._principal_id(db, principal)
            if owner is None:
                raise NotFound(f"no principal named {principal!r}")
            credential_id, its_hosts = None, []
            if credential is not None:
                row = db.execute(
                    "SELECT id, hosts FROM credentials WHERE name = ? AND removed_at IS NULL",
                    (credential,),
                ).fetchone()
                if row is None:
                    raise NotFound(f"no credential named {credential!r}")
                credential_id, its_hosts = row[0], json.loads(row[1])
            validation.within_credential(spec, credential, its_hosts)
            row = validation.grant_columns(
                spec, once=once, websocket=websocket, purpose=purpose, limits=limits, body=body
            )
            # JSON columns as SQLAlchemy's JSON writes them: None is JSON null.
            for name in ("hosts", "methods", "paths"):
                row[name] = json.dumps(row[name])
            if row["expires_at"] is not None:
                row["expires_at"] = _stamp(row["expires_at"])
            row |= {
                "principal_id": owner,
                "credential_id": credential_id,
                "created_at": _stamp(utcnow()),
                "uses": 0,
            }
            names = ", ".join(row)
            marks = ", ".join("?" * len(row))
            grant_id: int = db.execute(
                f"INSERT INTO grants ({names}) VALUES ({marks}) RETURNING id",  # noqa: S608 - names are columns(), not input
                tuple(row.values()),
            ).fetchone()[0]
            self._bump(db, changelog.GRANT, grant_id)
            return grant_id

    def list_grants(self, principal: str | None = None) -> list[GrantEntry]:
        """store.tables.grants.listing: every grant, or a live principal's."""
        query, args = _LIST_GRANTS, tuple[str, ...]()
        if principal is not None:
            query, args = _LIST_GRANTS + _OF_PRINCIPAL, (principal,)
        now = utcnow()
        with self._reading() as db:
            rows = db.execute(query + " ORDER BY g.id", args).fetchall()
        return [
            GrantEntry(
                id=r[0],
                principal=r[1],
                credential=r[2],
                hosts=_list(r[3]),
                methods=_list(r[4]) or [],
                paths=_list(r[5]) or [],
                once=bool(r[6]),
                websocket=bool(r[7]),
                expires_at=_time(r[8]),
                purpose=r[9],
                created_at=_time(r[10]) or now,
                state=grant_state(_time(r[11]), _time(r[12]), _time(r[8]), now),
                encoded_slash=bool(r[13]),
                key=r[14],
                rate=r[15],
                burst=r[16],
                max_uses=r[17],
                uses=r[18],
                approval=r[19],
                hold=r[20],
                body=bodyrules.describe(r[21]),
                budget=budgets.describe(r[22]),
                cap_max_tokens=budgets.capping(r[22]),
            )
            for r in rows
        ]

    def credential_hosts(self) -> dict[str, list[str]]:
        """Each live credential's hosts, by name."""
        with self._reading() as db:
            rows = db.execute("SELECT name, hosts FROM credentials WHERE removed_at IS NULL")
            return {name: json.loads(hosts) for name, hosts in rows.fetchall()}
