"""Every query credproxy makes: the operator's changes, and the snapshot the proxy compiles."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

from sqlalchemy import (
    Connection,
    Engine,
    Select,
    Text,
    cast,
    column,
    create_engine,
    event,
    func,
    inspect,
    select,
    table,
    update,
)
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, IntegrityError, NoSuchModuleError
from sqlalchemy.orm import Session, sessionmaker

from store.crypto import MasterKey, Secret, hash_token, new_token
from store.errors import (
    Conflict,
    CredproxyError,
    InvalidInput,
    MasterKeyError,
    NotFound,
    SealError,
    StoreUnavailable,
)
from store.grammar import (
    HostPattern,
    parse_host,
    validate_header_name,
    validate_method,
    validate_name,
    validate_param_name,
    validate_path_pattern,
)
from store.models import AccessRequest, Credential, Grant, Principal, StoreState, utcnow
from store.records import TOMBSTONE_RETENTION, CredentialRecord, GrantRecord, Snapshot

SCHEMES = ("bearer", "header", "basic", "query")
PENDING, APPROVED, DENIED = "pending", "approved", "denied"
REQUEST_STATES = (PENDING, APPROVED, DENIED)
MAX_PENDING_PER_PRINCIPAL = 50
MAX_REQUEST_PATH = 2048
MAX_REQUEST_TEXT = 1000
MIGRATIONS = Path(__file__).parent / "migrations"
# The newest revision in MIGRATIONS, so that `run` checks the schema without importing Alembic
# (0.15 s of its start-up). tests/test_migrations.py holds it to Alembic's own head.
SCHEMA_HEAD = "0003"
# Every revision this code can migrate from; anything else was written by a newer credproxy.
KNOWN_SCHEMAS = frozenset(
    p.name.split("_", 1)[0] for p in (MIGRATIONS / "versions").glob("0*_*.py")
)
_VERSIONS = table("alembic_version", column("version_num"))

T = TypeVar("T")


def normalize_url(url: str) -> str:
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def display_url(url: str) -> str:
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return "<unparseable database URL>"


def sqlite_path(url: str) -> Path | None:
    """The file behind an SQLite URL; None for PostgreSQL and in-memory databases."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        return None
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    return Path(parsed.database)


def make_engine(url: str, *, create: bool = False) -> Engine:
    """An engine for `url`; only with `create` may an SQLite file come into being."""
    try:
        parsed = make_url(url)
    except ArgumentError as e:
        raise InvalidInput(f"invalid database URL {display_url(url)}") from e
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
    elif parsed.get_backend_name() == "sqlite":
        kwargs["connect_args"] = {"timeout": 5}
        path = sqlite_path(url)
        if path is not None and not create:
            if not path.is_file():
                raise StoreUnavailable(f"no store at {path}: run credproxy init")
            # Open read-write, never create: a store deleted or moved away must not be
            # replaced by an empty one at the next connection.
            parsed = parsed.set(
                database=f"file:{quote(str(path))}", query={"mode": "rw", "uri": "true"}
            )
    else:
        raise InvalidInput(f"unsupported database {display_url(url)}: use sqlite or postgresql")
    try:
        engine = create_engine(parsed, **kwargs)
    except NoSuchModuleError as e:
        raise InvalidInput(f"unsupported database driver in {display_url(url)}") from e
    if parsed.get_backend_name() == "sqlite":
        event.listen(engine, "connect", _sqlite_pragmas)
    return engine


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.close()


class Store:
    """The store behind one database URL; `key` may be None for commands that need no secret."""

    def __init__(self, url: str, key: MasterKey | None, *, create: bool = False) -> None:
        self.url = normalize_url(url)
        self.display_url = display_url(self.url)
        self.key = key
        self._reopening = threading.Lock()
        self._open(create)

    def _open(self, create: bool = False) -> None:
        self._file = sqlite_path(self.url)
        self.engine = make_engine(self.url, create=create)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
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

    def reopen_if_replaced(self) -> bool:
        """Reopen the store if another file now stands at its SQLite path (a restore).

        Returns True when it did. Raises StoreUnavailable when the file is gone, or the new
        one is not ready: never serve on from an unlinked file.
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
                self.check_ready()
            except CredproxyError:
                self._identity = None  # checked again at the next poll
                raise
            return True

    def restrict_file(self) -> None:
        """Make an SQLite database file private to its owner: it holds sealed secrets."""
        database = sqlite_path(self.url)
        if database is not None:
            for suffix in ("", "-wal", "-shm"):
                path = Path(f"{database}{suffix}")
                if path.exists():
                    path.chmod(0o600)

    def close(self) -> None:
        self.engine.dispose()

    @contextmanager
    def _session(self) -> Iterator[Session]:
        try:
            with self._sessions() as session:
                yield session
        except IntegrityError as e:
            raise Conflict("the change conflicts with an existing record") from e
        except DBAPIError as e:
            raise StoreUnavailable(f"database {self.display_url} failed: {_first_line(e)}") from e

    @contextmanager
    def _reading(self) -> Iterator[Connection]:
        """One read transaction on a plain connection, for rows that need no ORM objects."""
        try:
            with self.engine.begin() as connection:
                yield connection
        except DBAPIError as e:
            raise StoreUnavailable(f"database {self.display_url} failed: {_first_line(e)}") from e

    @contextmanager
    def _change(self) -> Iterator[Session]:
        """A write transaction that also bumps the change counter the proxy polls."""
        with self._session() as session, session.begin():
            yield session
            session.execute(
                update(StoreState)
                .where(StoreState.id == 1)
                .values(change_counter=StoreState.change_counter + 1)
            )

    # -- schema and key --------------------------------------------------------------

    def _alembic(self) -> Any:
        # Alembic is imported where it is used: it costs a noticeable part of start-up.
        from alembic.config import Config

        config = Config()
        config.set_main_option("script_location", str(MIGRATIONS))
        return config

    def migrate(self, revision: str = "head") -> None:
        """Bring the schema to `revision`; harmless when already there."""
        self._refuse_newer(self.schema_revision())
        config = self._alembic()
        from alembic import command
        from alembic.util import CommandError

        try:
            with self.engine.begin() as connection:
                config.attributes["connection"] = connection
                command.upgrade(config, revision)
        except DBAPIError as e:
            raise self._unreachable(e) from e
        except CommandError as e:
            raise StoreUnavailable(
                f"cannot migrate database {self.display_url}: {str(e).splitlines()[0][:200]}"
            ) from e

    def _refuse_newer(self, current: str | None) -> None:
        if current is not None and not KNOWN_SCHEMAS.issuperset(current.split(", ")):
            raise StoreUnavailable(
                f"database {self.display_url} is at schema {current}, newer than this "
                f"credproxy's {SCHEMA_HEAD}: upgrade credproxy"
            )

    def _unreachable(self, e: DBAPIError) -> StoreUnavailable:
        return StoreUnavailable(f"cannot reach database {self.display_url}: {_first_line(e)}")

    def schema_revision(self) -> str | None:
        """Alembic's recorded revision, None before the first migration."""
        try:
            with self.engine.connect() as connection:
                if not inspect(connection).has_table(_VERSIONS.name):
                    return None
                versions = connection.execute(select(_VERSIONS.c.version_num)).scalars()
                # More than one row (branched heads) reads as neither head nor none.
                return ", ".join(sorted(versions)) or None
        except DBAPIError as e:
            raise self._unreachable(e) from e

    def check_ready(self) -> None:
        """Raise unless the schema is at head and the master key is the store's own."""
        current = self.schema_revision()
        self._refuse_newer(current)
        if current != SCHEMA_HEAD:
            raise StoreUnavailable(
                f"database {self.display_url} is at schema {current or 'none'}, "
                f"not {SCHEMA_HEAD}: run credproxy init"
            )
        self.check_key()

    def check_key(self, *, adopt: bool = False) -> None:
        """Compare the master key with the store's check value; `adopt` records it if unset."""
        if self.key is None:
            return
        with self._session() as session, session.begin():
            state = session.get_one(StoreState, 1)
            if state.key_check is None and adopt:
                state.key_id, state.key_check = self.key.key_id, self.key.check_value
                return
            if state.key_check is None:
                raise MasterKeyError(
                    f"{self.display_url} has no master key yet: run credproxy init"
                )
            if state.key_check != self.key.check_value:
                raise MasterKeyError(
                    f"the master key from {self.key.source} (id {self.key.key_id}) is not the key "
                    f"of {self.display_url} (id {state.key_id})"
                )

    def stored_key_id(self) -> str | None:
        with self._session() as session:
            key_id: str | None = session.get_one(StoreState, 1).key_id
            return key_id

    def change_counter(self) -> int:
        with self._session() as session:
            return session.execute(
                select(StoreState.change_counter).where(StoreState.id == 1)
            ).scalar_one()

    def rotate_key(self, new_key: MasterKey) -> int:
        """Re-seal every secret under `new_key` in one transaction; returns how many."""
        old = self._need_key()
        with self._change() as session:
            state = session.get_one(StoreState, 1, with_for_update=True)
            if state.key_check != old.check_value:
                raise MasterKeyError(f"the master key from {old.source} is not this store's key")
            rows = session.scalars(
                select(Credential).where(Credential.ciphertext.is_not(None))
            ).all()
            for row in rows:
                secret = _open(old, row.name, row.key_id, row.nonce, row.ciphertext)
                row.key_id, row.nonce, row.ciphertext = new_key.seal(
                    secret.reveal(), _context(row.name)
                )
                row.fingerprint = new_key.fingerprint(secret)
            state.key_id, state.key_check = new_key.key_id, new_key.check_value
            return len(rows)

    def _need_key(self) -> MasterKey:
        if self.key is None:
            raise MasterKeyError("this command needs the master key")
        return self.key

    # -- principals ------------------------------------------------------------------

    def add_principal(self, name: str) -> str:
        """Create a principal; returns its token, which is stored only as a hash."""
        validate_name("principal", name)
        token = new_token()
        with self._change() as session:
            if _live_principal(session, name) is not None:
                raise Conflict(f"principal {name!r} already exists")
            session.add(Principal(name=name, token_hash=hash_token(token), created_at=utcnow()))
        return token

    def list_principals(self) -> Sequence[Principal]:
        with self._session() as session:
            return session.scalars(
                select(Principal).where(Principal.disabled_at.is_(None)).order_by(Principal.name)
            ).all()

    def remove_principal(self, name: str) -> int:
        """Disable the principal and revoke its grants; returns how many grants were revoked."""
        with self._change() as session:
            principal = _need(_live_principal(session, name), "principal", name)
            now = utcnow()
            principal.disabled_at = now
            session.execute(
                update(AccessRequest)
                .where(AccessRequest.principal_id == principal.id, AccessRequest.state == PENDING)
                .values(state=DENIED, decided_at=now, decision_reason="principal removed")
            )
            return _revoke_where(session, Grant.principal_id == principal.id, now)

    # -- credentials -----------------------------------------------------------------

    def add_credential(
        self,
        name: str,
        scheme: str,
        hosts: Sequence[str],
        secret: Secret,
        header_name: str | None = None,
        param_name: str | None = None,
    ) -> str:
        """Seal and store a credential; returns its fingerprint."""
        key = self._need_key()
        validate_name("credential", name)
        patterns = _parse_hosts(hosts)
        if not patterns:
            raise InvalidInput("a credential needs at least one --host")
        header_name, param_name = _scheme_options(scheme, header_name, param_name)
        _validate_secret(scheme, secret)
        with self._change() as session:
            if _live_credential(session, name) is not None:
                raise Conflict(f"credential {name!r} already exists")
            key_id, nonce, ciphertext = key.seal(secret.reveal(), _context(name))
            fingerprint = key.fingerprint(secret)
            session.add(
                Credential(
                    name=name,
                    scheme=scheme,
                    header_name=header_name,
                    param_name=param_name,
                    hosts=[str(p) for p in patterns],
                    key_id=key_id,
                    nonce=nonce,
                    ciphertext=ciphertext,
                    fingerprint=fingerprint,
                    created_at=utcnow(),
                )
            )
        return fingerprint

    def list_credentials(self) -> Sequence[Credential]:
        with self._session() as session:
            return session.scalars(
                select(Credential).where(Credential.removed_at.is_(None)).order_by(Credential.name)
            ).all()

    def rotate_credential(self, name: str, secret: Secret) -> str:
        key = self._need_key()
        with self._change() as session:
            row: Credential = _need(_live_credential(session, name), "credential", name)
            _validate_secret(row.scheme, secret)
            row.key_id, row.nonce, row.ciphertext = key.seal(secret.reveal(), _context(name))
            row.fingerprint = key.fingerprint(secret)
            row.rotated_at = utcnow()
            return row.fingerprint

    def remove_credential(self, name: str) -> int:
        """Destroy the sealed secret and revoke the credential's grants."""
        with self._change() as session:
            row = _need(_live_credential(session, name), "credential", name)
            now = utcnow()
            row.removed_at = now
            row.key_id = row.nonce = row.ciphertext = None
            return _revoke_where(session, Grant.credential_id == row.id, now)

    # -- grants ----------------------------------------------------------------------

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
    ) -> int:
        spec = _grant_spec(methods, hosts, paths, expires_at)
        with self._change() as session:
            owner = _need(_live_principal(session, principal), "principal", principal)
            return _insert_grant(
                session, owner.id, spec, credential, once=once, websocket=websocket, purpose=purpose
            )

    def list_grants(self, principal: str | None = None) -> list[dict[str, Any]]:
        query = (
            select(Grant, Principal.name, Credential.name)
            .join(Principal, Grant.principal_id == Principal.id)
            .outerjoin(Credential, Grant.credential_id == Credential.id)
            .order_by(Grant.id)
        )
        if principal is not None:
            query = query.where(Principal.name == principal, Principal.disabled_at.is_(None))
        now = utcnow()
        with self._session() as session:
            return [
                {
                    "id": g.id,
                    "principal": p_name,
                    "credential": c_name,
                    "hosts": g.hosts,
                    "methods": g.methods,
                    "paths": g.paths,
                    "once": g.once,
                    "websocket": g.websocket,
                    "expires_at": g.expires_at.isoformat() if g.expires_at else None,
                    "purpose": g.purpose,
                    "created_at": g.created_at.isoformat(),
                    "state": _grant_state(g, now),
                }
                for g, p_name, c_name in session.execute(query).all()
            ]

    def revoke_grant(self, grant_id: int) -> None:
        with self._change() as session:
            grant = session.get(Grant, grant_id)
            if grant is None:
                raise NotFound(f"no grant with id {grant_id}")
            if grant.revoked_at is None:
                grant.revoked_at = utcnow()

    def consume_once(self, grant_id: int) -> bool:
        """Use a once-grant: True for exactly one caller, across every replica."""
        now = utcnow()
        with self._change() as session:
            result = session.execute(
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
            return bool(getattr(result, "rowcount", 0) == 1)

    # -- access requests -------------------------------------------------------------

    def record_access_request(
        self,
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
        _validate_request(host, port, method, path, purpose, explicit)
        now = utcnow()
        with self._session() as session, session.begin():
            # The lock serialises one principal's requests across replicas: no duplicate
            # rows, and the limit holds.
            owner = _need(_live_principal(session, principal, lock=True), "principal", principal)
            row = session.scalars(
                select(AccessRequest).where(
                    AccessRequest.principal_id == owner.id,
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
                .where(AccessRequest.principal_id == owner.id, AccessRequest.state == PENDING)
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

    def get_access_request(self, principal: str, request_id: int) -> dict[str, Any] | None:
        """One of `principal`'s own requests; another principal's id reads as None."""
        with self._session() as session:
            found = session.execute(
                _requests_query().where(
                    AccessRequest.id == request_id,
                    Principal.name == principal,
                    Principal.disabled_at.is_(None),
                )
            ).first()
            return _request_dict(found[0], found[1]) if found else None

    def list_access_requests(self, state: str | None = None) -> list[dict[str, Any]]:
        query = _requests_query()
        if state is not None:
            if state not in REQUEST_STATES:
                raise InvalidInput(
                    f"invalid state {state!r}: use one of {', '.join(REQUEST_STATES)}"
                )
            query = query.where(AccessRequest.state == state)
        with self._session() as session:
            return [_request_dict(row, name) for row, name in session.execute(query).all()]

    def approve_access_request(
        self,
        request_id: int,
        credential: str | None = None,
        path: str | None = None,
        once: bool = False,
        expires_at: datetime | None = None,
    ) -> int:
        """Turn a pending request into a grant, narrowed to `path` if given; returns its id."""
        with self._change() as session:
            row = _pending_request(session, request_id)
            if path is None and "*" in row.path.split("/"):
                raise InvalidInput(
                    f"request {request_id}'s path {row.path} has a '*' segment, which a grant "
                    "reads as any segment: approve it with --path"
                )
            host = HostPattern(row.host, None if row.port == 443 else row.port)
            spec = _grant_spec([row.method], [str(host)], [path or row.path], expires_at)
            purpose = f"access request {row.id}" + (f": {row.purpose}" if row.purpose else "")
            grant_id = _insert_grant(
                session, row.principal_id, spec, credential, once=once, websocket=False,
                purpose=purpose,
            )
            row.state, row.decided_at, row.grant_id = APPROVED, utcnow(), grant_id
            return grant_id

    def deny_access_request(self, request_id: int, reason: str | None = None) -> None:
        if reason is not None:
            _check_text("reason", reason)
        # A change like any other, so every proxy reloads and writes the decision's audit line.
        with self._change() as session:
            row = _pending_request(session, request_id)
            row.state, row.decided_at, row.decision_reason = DENIED, utcnow(), reason

    def decided_access_requests(self, since: datetime) -> list[dict[str, Any]]:
        """Requests approved or denied after `since`, oldest first."""
        query = (
            _requests_query()
            .where(AccessRequest.decided_at > since)
            .order_by(None)
            .order_by(AccessRequest.decided_at, AccessRequest.id)
        )
        with self._session() as session:
            return [_request_dict(row, name) for row, name in session.execute(query).all()]

    # -- the proxy's view ------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        key = self._need_key()
        now = utcnow()
        with self._reading() as connection:
            counter, key_id = connection.execute(
                select(StoreState.change_counter, StoreState.key_id).where(StoreState.id == 1)
            ).one()
            principals = connection.execute(
                select(Principal.id, Principal.name, Principal.token_hash).where(
                    Principal.disabled_at.is_(None)
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
                ).where(
                    Grant.revoked_at.is_(None),
                    (Grant.expires_at.is_(None))
                    | (Grant.expires_at > now - TOMBSTONE_RETENTION),
                )
            ).all()
        # Thousands of grants repeat a few lists: each distinct text is decoded and parsed once.
        parse = cache(parse_host)
        hosts_of = _decoded(lambda hosts: tuple(parse(h) for h in hosts or ()))
        methods_of = _decoded(frozenset)
        paths_of = _decoded(tuple)
        names = {pid: name for pid, name, _ in principals}
        records: dict[str, CredentialRecord] = {}
        by_id: dict[int, CredentialRecord] = {}
        unreadable = []
        # Rows are unpacked, not read by attribute name: at 10,000 grants that costs 0.1 s.
        for cid, name, scheme, header, param, hosts, key_id, nonce, ciphertext, fp in creds:
            try:
                secret = _open(key, name, key_id, nonce, ciphertext)
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
            )
            records[name] = by_id[cid] = rec
        compiled = []
        for gid, pid, cred_id, hosts, methods, paths, once, websocket, expires, consumed in grants:
            if pid not in names or (consumed and not once):
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
                    websocket=websocket,
                    expires_at=expires,
                    consumed=consumed,
                )
            )
        return Snapshot(
            counter=counter,
            key_id=key_id,
            token_hashes={name: h for _, name, h in principals},
            credentials=records,
            grants=tuple(compiled),
            unreadable=tuple(sorted(unreadable)),
        )


def _json_text(attribute: Any) -> Any:
    """A JSON column as its stored text, labelled with its own name."""
    return cast(attribute, Text).label(attribute.key)


def _decoded(parse: Callable[[Any], T]) -> Callable[[str | None], T]:
    """`parse` of the decoded JSON text, once per distinct text (SQL NULL reads as null)."""
    return cache(lambda raw: parse(json.loads(raw) if raw is not None else None))


def _context(name: str) -> str:
    return f"credential/{name}"


def _open(
    key: MasterKey, name: str, key_id: str | None, nonce: bytes | None, ciphertext: bytes | None
) -> Secret:
    assert key_id is not None and nonce is not None and ciphertext is not None
    return key.open(key_id, nonce, ciphertext, _context(name))


def _first_line(e: DBAPIError) -> str:
    text = str(e.orig) if e.orig is not None else type(e).__name__
    return (text.strip().splitlines() or ["error"])[0][:200]


def _need(row: Any, kind: str, name: str) -> Any:
    if row is None:
        raise NotFound(f"no {kind} named {name!r}")
    return row


def _live_principal(session: Session, name: str, lock: bool = False) -> Principal | None:
    query = select(Principal).where(Principal.name == name, Principal.disabled_at.is_(None))
    return session.scalars(query.with_for_update() if lock else query).first()


def _live_credential(session: Session, name: str) -> Credential | None:
    return session.scalars(
        select(Credential).where(Credential.name == name, Credential.removed_at.is_(None))
    ).first()


def _revoke_where(session: Session, condition: Any, now: datetime) -> int:
    result = session.execute(
        update(Grant).where(condition, Grant.revoked_at.is_(None)).values(revoked_at=now)
    )
    return int(getattr(result, "rowcount", 0))


def _parse_hosts(hosts: Sequence[str]) -> list[HostPattern]:
    return sorted({parse_host(h) for h in hosts}, key=lambda p: (p.host, p.port or 0))


def _scheme_options(
    scheme: str, header_name: str | None, param_name: str | None
) -> tuple[str | None, str | None]:
    if scheme not in SCHEMES:
        raise InvalidInput(f"invalid scheme {scheme!r}: use one of {', '.join(SCHEMES)}")
    if (scheme == "header") != (header_name is not None):
        raise InvalidInput("--header NAME goes with --scheme header, and only with it")
    if (scheme == "query") != (param_name is not None):
        raise InvalidInput("--param NAME goes with --scheme query, and only with it")
    if header_name is not None:
        validate_header_name(header_name)
    if param_name is not None:
        validate_param_name(param_name)
    return header_name, param_name


def _validate_secret(scheme: str, secret: Secret) -> None:
    value = secret.reveal()
    if not value:
        raise InvalidInput("the secret is empty")
    # A CR or LF in a header value would let the secret split the request.
    if any(b < 0x20 or b == 0x7F for b in value):
        raise InvalidInput("the secret contains control characters")
    if scheme in ("bearer", "header") and not value.isascii():
        raise InvalidInput("a header secret must be ASCII")
    if scheme == "basic" and b":" not in value:
        raise InvalidInput("a basic secret must be user:password")


def _grant_state(g: Grant, now: datetime) -> str:
    if g.revoked_at is not None:
        return "revoked"
    if g.consumed_at is not None:
        return "consumed"
    if g.expires_at is not None and g.expires_at <= now:
        return "expired"
    return "active"


@dataclass(frozen=True)
class _GrantSpec:
    methods: list[str]
    paths: list[str]
    hosts: list[HostPattern]
    expires_at: datetime | None


def _grant_spec(
    methods: Sequence[str], hosts: Sequence[str], paths: Sequence[str], expires_at: datetime | None
) -> _GrantSpec:
    if not methods:
        raise InvalidInput("a grant needs at least one --method (or '*')")
    method_list = sorted({validate_method(m) for m in methods})
    if "*" in method_list and len(method_list) > 1:
        raise InvalidInput("--method '*' already allows every method")
    path_list = sorted({validate_path_pattern(p) for p in paths}) or ["/"]
    patterns = _parse_hosts(hosts)
    if expires_at is not None and expires_at <= utcnow():
        raise InvalidInput("the grant's expiry is in the past")
    return _GrantSpec(method_list, path_list, patterns, expires_at)


def _insert_grant(
    session: Session,
    principal_id: int,
    spec: _GrantSpec,
    credential: str | None,
    *,
    once: bool,
    websocket: bool,
    purpose: str | None,
) -> int:
    credential_id = None
    if credential is not None:
        cred = _need(_live_credential(session, credential), "credential", credential)
        credential_id = cred.id
        allowed = [parse_host(h) for h in cred.hosts]
        for pattern in spec.hosts:
            if not any(a.covers(pattern) for a in allowed):
                raise InvalidInput(
                    f"host {pattern} is outside credential {credential!r}'s hosts "
                    f"({', '.join(cred.hosts)})"
                )
    elif not spec.hosts:
        raise InvalidInput("a grant without --credential needs at least one --host")
    grant = Grant(
        principal_id=principal_id,
        credential_id=credential_id,
        hosts=[str(p) for p in spec.hosts] or None,
        methods=spec.methods,
        paths=spec.paths,
        once=once,
        websocket=websocket,
        expires_at=spec.expires_at,
        purpose=purpose,
        created_at=utcnow(),
    )
    session.add(grant)
    session.flush()
    return grant.id


def _validate_request(
    host: str, port: int, method: str, path: str, purpose: str | None, explicit: bool
) -> None:
    if validate_method(method) == "*":
        raise InvalidInput("an access request names one method, not '*'")
    if not 0 < port < 65536:
        raise InvalidInput(f"invalid port {port}")
    # The path and purpose come from the agent and end up on the owner's terminal.
    if (
        not path.startswith("/")
        or len(path) > MAX_REQUEST_PATH
        or not (path.isascii() and path.isprintable())
        or " " in path
    ):
        raise InvalidInput(
            f"invalid path: must start with '/', be printable ASCII without spaces, "
            f"and be at most {MAX_REQUEST_PATH} characters"
        )
    if purpose is not None:
        _check_text("purpose", purpose)
    if explicit:
        # The proxy has already normalised the host of a denied request; an asked-for one
        # is the agent's own text.
        pattern = parse_host(f"[{host}]" if ":" in host else host)
        if pattern.wildcard or pattern.port is not None or pattern.host != host:
            raise InvalidInput(f"invalid host {host!r}: name one host, without port or wildcard")


def _check_text(what: str, text: str) -> None:
    if len(text) > MAX_REQUEST_TEXT or not text.isprintable():
        raise InvalidInput(
            f"invalid {what}: one line of printable text, at most {MAX_REQUEST_TEXT} characters"
        )


def _pending_request(session: Session, request_id: int) -> AccessRequest:
    row = session.get(AccessRequest, request_id, with_for_update=True)
    if row is None:
        raise NotFound(f"no access request with id {request_id}")
    if row.state != PENDING:
        raise InvalidInput(f"request {request_id} is {row.state}, not pending")
    return row


def _requests_query() -> Select[AccessRequest, str]:
    return (
        select(AccessRequest, Principal.name)
        .join(Principal, AccessRequest.principal_id == Principal.id)
        .order_by(AccessRequest.id)
    )


def _request_dict(row: AccessRequest, principal: str) -> dict[str, Any]:
    return {
        "id": row.id,
        "principal": principal,
        "host": row.host,
        "port": row.port,
        "method": row.method,
        "path": row.path,
        "purpose": row.purpose,
        "source": row.source,
        "state": row.state,
        "count": row.count,
        "first_seen": row.first_seen.isoformat(),
        "last_seen": row.last_seen.isoformat(),
        "decided_at": row.decided_at.isoformat() if row.decided_at else None,
        "decision_reason": row.decision_reason,
        "grant_id": row.grant_id,
    }
