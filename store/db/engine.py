"""The database behind one URL: engine, sessions, and the change counter every change bumps."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

from sqlalchemy import Connection, Engine, create_engine, delete, event, insert, select, update
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, IntegrityError, NoSuchModuleError
from sqlalchemy.orm import ORMExecuteState, Session, sessionmaker
from sqlalchemy.sql.base import Executable

from store.db import changelog
from store.db.changelog import ALL, CREDENTIAL, GRANT, MARK, PRINCIPAL, REQUEST, TOKEN
from store.db.models import (
    AccessRequest,
    Base,
    ChangeLog,
    Credential,
    Grant,
    Principal,
    PrincipalToken,
    StoreState,
)
from store.errors import Conflict, CredproxyError, InvalidInput, StoreUnavailable

_NOTED = "credproxy.changed"
# What the proxy reads, by model: a row of one written through the ORM is noted as its kind,
# whatever the write itself noted (store_state, the key's row, as everything).
_KINDS: dict[type[Base], str] = {
    Principal: PRINCIPAL,
    PrincipalToken: TOKEN,
    Credential: CREDENTIAL,
    Grant: GRANT,
    AccessRequest: REQUEST,
    StoreState: ALL,
}
_READ_TABLES = frozenset(str(model.__tablename__) for model in _KINDS)
_COVERED = "credproxy_covered"
E = TypeVar("E", bound=Executable)


def mark_of(counter: Any) -> Any:
    """The mark logged with the change at `counter` (a scalar subquery; NULL if none)."""
    return (
        select(ChangeLog.row_id)
        .where(ChangeLog.counter == counter, ChangeLog.kind == MARK)
        .scalar_subquery()
    )


STATE_MARK = select(StoreState.change_counter, mark_of(StoreState.change_counter)).where(
    StoreState.id == 1
)


def normalize_url(url: str) -> str:
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def display_url(url: str) -> str:
    try:
        return make_url(url).render_as_string(hide_password=True)
    except (ArgumentError, ValueError):
        return _masked(url)


def _masked(url: str) -> str:
    """An unparseable URL as typed, its userinfo's password (if any) masked."""
    return re.sub(r"(://[^/@]*?:)[^/@]*@", r"\1***@", url)


def sqlite_path(url: str) -> Path | None:
    """The file behind an SQLite URL; None for PostgreSQL and in-memory databases."""
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):
        return None
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    return Path(parsed.database)


def parse_url(url: str) -> URL:
    """A database URL this store can use, checked before anything connects.

    Raises InvalidInput with a one-line reason, the URL shown without its password.
    """
    usage = "use sqlite:///PATH or postgresql://USER:PASSWORD@HOST/DATABASE"
    try:
        parsed = make_url(normalize_url(url))
    except (ArgumentError, ValueError) as e:
        raise InvalidInput(f"invalid database URL {_masked(url)!r}: {usage}") from e
    shown = repr(display_url(url))
    if parsed.get_backend_name() == "sqlite":
        if parsed.drivername not in ("sqlite", "sqlite+pysqlite"):
            raise InvalidInput(f"unsupported database driver in {shown}: {usage}")
        if parsed.host:
            # sqlite://credproxy.db reads `credproxy.db` as a host name.
            path = parsed.host + (f"/{parsed.database}" if parsed.database else "")
            raise InvalidInput(
                f"invalid database URL {shown}: an SQLite URL has three slashes before "
                f"the path (sqlite:///{path}), four before an absolute path"
            )
        if parsed.database in (None, "", ":memory:"):
            raise InvalidInput(
                f"invalid database URL {shown}: name the SQLite file (sqlite:///PATH); "
                "an in-memory database would vanish with the process"
            )
        return parsed
    if parsed.get_backend_name() == "postgresql":
        if parsed.drivername != "postgresql+psycopg":
            raise InvalidInput(
                f"unsupported database driver in {shown}: use postgresql:// or "
                "postgresql+psycopg://"
            )
        if parsed.port is not None and not 0 < parsed.port < 65536:
            raise InvalidInput(f"invalid database URL {shown}: invalid port {parsed.port}")
        return parsed
    raise InvalidInput(f"unsupported database {shown}: {usage}")


def make_engine(url: str, *, create: bool = False) -> Engine:
    """An engine for `url`; only with `create` may an SQLite file come into being."""
    parsed = parse_url(url)
    kwargs: dict[str, Any] = {}
    if parsed.get_backend_name() == "postgresql":
        kwargs.update(
            pool_size=5,
            max_overflow=5,
            pool_timeout=5,
            pool_pre_ping=True,
            connect_args={
                "connect_timeout": 5,
                # A replica stuck mid-transaction must not hold row locks for long.
                "options": "-c statement_timeout=5000 -c idle_in_transaction_session_timeout=5000",
            },
        )
    else:
        kwargs["connect_args"] = {"timeout": 5}
        path = sqlite_path(url)
        if path is not None and create and not path.parent.is_dir():
            raise StoreUnavailable(
                f"cannot create a store at {path}: the directory {path.parent} does not exist"
            )
        if path is not None and not create:
            if not path.is_file():
                raise StoreUnavailable(f"no store at {path}: run credproxy init")
            # Open read-write, never create: a store deleted or moved away must not be
            # replaced by an empty one at the next connection.
            parsed = parsed.set(
                database=f"file:{quote(str(path))}", query={"mode": "rw", "uri": "true"}
            )
    try:
        engine = create_engine(parsed, **kwargs)
    except (NoSuchModuleError, ImportError) as e:
        raise InvalidInput(f"unsupported database driver in {display_url(url)}") from e
    if parsed.get_backend_name() == "sqlite":
        event.listen(engine, "connect", _sqlite_pragmas)
    return engine


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.close()


def rowcount(result: object) -> int:
    """How many rows an UPDATE touched."""
    return int(getattr(result, "rowcount", 0))


# PostgreSQL's words (psycopg gives no SQLSTATE for a failed connection).
_MISSING_DATABASE = re.compile(r'FATAL: +database "([^"]+)" does not exist')


def _no_such_database(url: str, name: str) -> StoreUnavailable:
    """A PostgreSQL server without the database: say how to create it."""
    parsed = make_url(url)
    host, port = parsed.host or "localhost", parsed.port or 5432
    user = f" -U {parsed.username}" if parsed.username else ""
    return StoreUnavailable(
        f"database {name!r} does not exist on {host}:{port}: create it with "
        f"`createdb -h {host} -p {port}{user} {name}`, then run credproxy init"
    )


def _first_line(e: DBAPIError) -> str:
    text = str(e.orig) if e.orig is not None else type(e).__name__
    return (text.strip().splitlines() or ["error"])[0][:200]


class Database:
    """One database URL's engine and sessions, reopened when its SQLite file is replaced."""

    def __init__(self, url: str, *, create: bool = False) -> None:
        self.url = normalize_url(url)
        self.display_url = display_url(self.url)
        self._reopening = threading.Lock()
        self._open(create)

    def _open(self, create: bool = False) -> None:
        self._file = sqlite_path(self.url)
        self.engine = make_engine(self.url, create=create)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        event.listen(self._sessions, "after_flush", _note_flushed)
        event.listen(self._sessions, "do_orm_execute", _note_bulk)
        self._identity = self._file_identity()

    def _file_identity(self) -> tuple[int, int] | None:
        """(st_dev, st_ino) of the SQLite file; None for PostgreSQL or before it exists."""
        if self._file is None:
            return None
        try:
            st = self._file.stat()
        except OSError:
            return None
        return st.st_dev, st.st_ino

    def reopen_if_replaced(self, check: Callable[[], None]) -> bool:
        """Reopen if another file now stands at the SQLite path (a restore), then `check` it.

        Returns True when it did. Raises StoreUnavailable when the file is gone, and whatever
        `check` raises: never serve on from an unlinked file.
        """
        if self._file is None:
            return False
        with self._reopening:  # the poll and a SIGHUP reload may both look
            identity = self._file_identity()
            if identity is None:
                raise StoreUnavailable(f"the store file {self._file} is gone")
            if identity == self._identity:
                return False
            self.engine.dispose()
            self._open()
            try:
                check()
            except CredproxyError:
                self._identity = None  # checked again at the next poll
                raise
            return True

    def restrict_file(self) -> None:
        """Make an SQLite database file private to its owner: it holds sealed secrets."""
        if self._file is not None:
            for suffix in ("", "-wal", "-shm"):
                path = Path(f"{self._file}{suffix}")
                if path.exists():
                    path.chmod(0o600)

    def close(self) -> None:
        self.engine.dispose()

    def failed(self, e: DBAPIError) -> StoreUnavailable:
        return StoreUnavailable(f"database {self.display_url} failed: {_first_line(e)}")

    def unreachable(self, e: DBAPIError) -> StoreUnavailable:
        missing = _MISSING_DATABASE.search(_first_line(e))
        if missing:
            return _no_such_database(self.url, missing.group(1))
        return StoreUnavailable(f"cannot reach database {self.display_url}: {_first_line(e)}")

    @contextmanager
    def session(self) -> Iterator[Session]:
        try:
            with self._sessions() as session:
                yield session
        except IntegrityError as e:
            raise Conflict("the change conflicts with an existing record") from e
        except DBAPIError as e:
            raise self.failed(e) from e

    @contextmanager
    def reading(self) -> Iterator[Connection]:
        """One read-only transaction on a plain connection whose SELECTs all see one state of
        the store, whatever commits meanwhile: REPEATABLE READ on PostgreSQL (a snapshot
        taken at its first SELECT), an explicit read transaction on SQLite (WAL keeps its
        snapshot; pysqlite would run each SELECT on its own). A read therefore never has to
        start again because the store changed while it ran."""
        try:
            with self.engine.connect() as connection:
                if connection.dialect.name == "postgresql":
                    connection = connection.execution_options(isolation_level="REPEATABLE READ")
                    with connection.begin():
                        connection.exec_driver_sql("SET TRANSACTION READ ONLY")
                        yield connection
                else:
                    connection.exec_driver_sql("BEGIN")
                    try:
                        yield connection
                    finally:
                        connection.exec_driver_sql("COMMIT")
        except DBAPIError as e:
            raise self.failed(e) from e

    @contextmanager
    def change(self) -> Iterator[Session]:
        """A write transaction that also bumps the change counter the proxy polls and logs
        the rows it noted (`changed`)."""
        with self.session() as session, session.begin():
            yield session
            bump(session)

    def change_counter(self) -> int:
        with self.session() as session:
            return session.execute(
                select(StoreState.change_counter).where(StoreState.id == 1)
            ).scalar_one()

    def state_mark(self) -> tuple[int, int | None]:
        """The change counter and the mark of the change it counts (None before marks)."""
        with self.session() as session:
            counter, mark = session.execute(STATE_MARK).one()
            return counter, mark


def changed(session: Session, kind: str, *rows: Any) -> None:
    """Note rows (ids, or ORM objects whose id the flush assigns) this change touches."""
    session.info.setdefault(_NOTED, []).extend((kind, row) for row in rows)


def covered(statement: E) -> E:
    """A bulk write whose rows the transaction's notes reach (a removed principal's grants,
    revoked with it; the grant it noted by id). Without it, one is logged as ALL."""
    return statement.execution_options(**{_COVERED: True})


def _note_flushed(session: Session, _context: Any) -> None:
    """Note every row of a table the proxy reads that this flush wrote: a write that forgot
    to note it, or noted another, still reaches every replica."""
    for row in (*session.new, *session.deleted):
        kind = _KINDS.get(type(row))
        if kind is not None:
            changed(session, kind, 0 if kind == ALL else row)
    for row in session.dirty:
        kind = _KINDS.get(type(row))
        if kind is not None and session.is_modified(row):
            changed(session, kind, 0 if kind == ALL else row)


def _note_bulk(state: ORMExecuteState) -> None:
    """A bulk INSERT, UPDATE or DELETE of a table the proxy reads is logged as ALL, unless
    the statement is `covered` by the notes of its transaction."""
    if not (state.is_insert or state.is_update or state.is_delete):
        return
    if state.execution_options.get(_COVERED):
        return
    table = getattr(state.statement, "table", None)
    if getattr(table, "name", None) in _READ_TABLES:
        changed(state.session, ALL, 0)


def bump(session: Session) -> int:
    """Move the change counter and log the rows noted in this transaction; the new counter.

    The counter's row lock, held to the commit, numbers changes in commit order: a proxy
    that reads counter N finds every change up to N in change_log.
    """
    session.flush()
    noted = session.info.pop(_NOTED, [])
    counter: int = session.execute(
        covered(
            update(StoreState)
            .where(StoreState.id == 1)
            .values(change_counter=StoreState.change_counter + 1)
            .returning(StoreState.change_counter)
        )
    ).scalar_one()
    rows = changelog.rows((kind, row if isinstance(row, int) else row.id) for kind, row in noted)
    session.execute(
        insert(ChangeLog), [{"counter": counter, "kind": k, "row_id": i} for k, i in rows]
    )
    prune = changelog.pruned_through(counter)
    if prune is not None:
        session.execute(delete(ChangeLog).where(ChangeLog.counter <= prune))
    return counter
