"""store/db/lite.py writes and reads what the ORM path does, row for row, and refuses alike."""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event

from store.crypto import MasterKey
from store.db import lite
from store.errors import CredproxyError, StoreUnavailable
from store.records import utcnow
from store.repository import Store
from store.rules import validation
from tests.stores import SECRET

LIMITED = validation.limits("5/m", 10)
HELD = validation.limits(None, None, approval="first", hold="30s")
# Every kind of grant the CLI can add: (credential, keyword arguments of add_grant).
GRANTS: list[dict[str, Any]] = [
    {"methods": ["GET"], "credential": "gh"},
    {"methods": ["POST", "GET"], "credential": "gh", "paths": ["/repos/*/issues", "/user"]},
    {"methods": ["*"], "hosts": ["pypi.org", "*.pythonhosted.org"]},
    {"methods": ["GET"], "credential": "gh", "hosts": ["api.github.com"], "once": True},
    {"methods": ["GET"], "credential": "gh", "websocket": True, "purpose": "triage ünïcode"},
    {"methods": ["GET"], "credential": "gh", "paths": ["/a/*"], "encoded_slash": True},
    {"methods": ["GET"], "credential": "gh", "limits": LIMITED},
    {"methods": ["GET"], "credential": "gh", "limits": validation.limits(None, None, 3)},
    {"methods": ["GET"], "credential": "gh", "limits": HELD},
    {"methods": ["GET"], "hosts": ["[::1]:8443"], "expires_at": utcnow() + timedelta(hours=1)},
]
TIME = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}")


@pytest.fixture
def key() -> MasterKey:
    return MasterKey.generate("test")


@pytest.fixture
def new_store(tmp_path: Path, key: MasterKey) -> Iterator[Callable[[str], Store]]:
    opened: list[Store] = []

    def new(name: str) -> Store:
        store = Store(f"sqlite:///{tmp_path / name}.db", key, create=True)
        store.migrate()
        store.check_key(adopt=True)
        opened.append(store)
        return store

    yield new
    for store in opened:
        store.close()


def _lite(store: Store, key: MasterKey | None) -> lite.Store:
    path = lite.sqlite_file(store.db.url)
    assert path is not None
    return lite.Store(store.db.url, path, key)


def _rows(store: Store, table: str) -> list[tuple[Any, ...]]:
    """Every row as stored: each value with its SQLite type, times and marks made comparable."""
    path = lite.sqlite_file(store.db.url)
    with sqlite3.connect(str(path)) as db:
        columns = [c[1] for c in db.execute(f"PRAGMA table_info({table})")]
        typed = ", ".join(f"typeof({c}), quote({c})" for c in columns)
        rows = db.execute(f"SELECT {typed} FROM {table} ORDER BY 1, 2").fetchall()  # noqa: S608
    kept = []
    for row in rows:
        values = [
            (t, "TIME" if isinstance(v, str) and TIME.search(v) else v)
            for t, v in zip(row[::2], row[1::2], strict=True)
        ]
        if table == "change_log" and values[1][1] == "'mark'":
            values[2] = ("integer", "MARK")
        if table == "principals":
            values[columns.index("token_hash")] = ("text", "HASH")
        kept.append(tuple(values))
    return sorted(kept, key=repr)


def _seed(add_principal: Callable[..., object], store: Store) -> None:
    add_principal("agent")
    add_principal("limited", LIMITED)
    store.add_credential("gh", "bearer", ["api.github.com"], SECRET)


def test_both_paths_write_the_same_rows(new_store: Callable[[str], Store], key: MasterKey) -> None:
    orm, fast = new_store("orm"), new_store("fast")
    quick = _lite(fast, key)
    _seed(orm.add_principal, orm)
    _seed(quick.add_principal, fast)
    for grant in GRANTS:
        kwargs = dict(grant)
        assert orm.add_grant("agent", **kwargs) == quick.add_grant("agent", **kwargs)
    for table in ("principals", "grants", "change_log", "store_state"):
        assert _rows(fast, table) == _rows(orm, table), table
    assert fast.change_counter() == orm.change_counter() == 3 + len(GRANTS)


def test_both_paths_list_the_same_grants(new_store: Callable[[str], Store], key: MasterKey) -> None:
    store = new_store("one")
    _seed(store.add_principal, store)
    ids = [store.add_grant("agent", **g) for g in GRANTS]
    store.add_principal("other")
    store.add_grant("other", ["GET"], credential="gh")
    store.revoke_grant(ids[0])
    assert store.consume_once(ids[3])
    with sqlite3.connect(str(lite.sqlite_file(store.db.url))) as db:  # expired since
        db.execute(
            "UPDATE grants SET expires_at = '2020-01-01 00:00:00.000000' WHERE id = ?", (ids[9],)
        )
    quick = _lite(store, None)
    for principal in (None, "agent", "other", "nobody"):
        listed = quick.list_grants(principal)
        assert listed == store.list_grants(principal)
    assert {g.state for g in quick.list_grants()} == {"active", "revoked", "consumed", "expired"}
    assert quick.credential_hosts() == store.credential_hosts() == {"gh": ["api.github.com"]}


def test_a_grant_added_here_reaches_the_proxy_as_a_delta(
    new_store: Callable[[str], Store], key: MasterKey
) -> None:
    store = new_store("one")
    _seed(store.add_principal, store)
    since = store.change_counter()
    grant_id = _lite(store, key).add_grant("agent", ["GET"], credential="gh", paths=["/user"])
    delta = store.delta(since)
    assert delta is not None and set(delta.grants) == {grant_id}
    record = delta.grants[grant_id]
    assert record is not None and record.paths == ("/user",) and record.credential == "gh"


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda s: s.add_grant("nobody", ["GET"], credential="gh"), id="no principal"),
        pytest.param(
            lambda s: s.add_grant("agent", ["GET"], credential="nope"), id="no credential"
        ),
        pytest.param(
            lambda s: s.add_grant("agent", ["GET"], credential="gh", hosts=["evil.example"]),
            id="host outside the credential's",
        ),
        pytest.param(lambda s: s.add_grant("agent", ["GET"]), id="no host, no credential"),
        pytest.param(lambda s: s.add_grant("agent", ["GET"], hosts=["*.com"]), id="public suffix"),
        pytest.param(lambda s: s.add_grant("agent", [], credential="gh"), id="no method"),
        pytest.param(lambda s: s.add_principal("agent"), id="principal exists"),
        pytest.param(lambda s: s.add_principal("Bad Name"), id="bad name"),
    ],
)
def test_both_paths_refuse_alike_and_change_nothing(
    new_store: Callable[[str], Store], key: MasterKey, change: Callable[[Any], object]
) -> None:
    store = new_store("one")
    _seed(store.add_principal, store)
    before = _rows(store, "change_log"), _rows(store, "grants"), _rows(store, "principals")
    with pytest.raises(CredproxyError) as full:
        change(store)
    fast = _lite(store, key)
    with pytest.raises(CredproxyError) as quick:
        change(fast)
    assert (type(quick.value), str(quick.value)) == (type(full.value), str(full.value))
    assert (
        _rows(store, "change_log"),
        _rows(store, "grants"),
        _rows(store, "principals"),
    ) == before
    # The refused transaction was ended: the next change through the same connection works.
    assert fast.add_grant("agent", ["GET"], credential="gh") > 0


def test_removed_principals_and_credentials_are_not_found(
    new_store: Callable[[str], Store], key: MasterKey
) -> None:
    """A name that was removed (and the row kept, disabled) is not the live one."""
    store = new_store("one")
    _seed(store.add_principal, store)
    store.add_credential("old", "bearer", ["old.example"], SECRET)
    store.remove_principal("agent")
    store.remove_credential("old")
    quick = _lite(store, key)
    for change in (
        lambda s: s.add_grant("agent", ["GET"], credential="gh"),
        lambda s: s.add_grant("limited", ["GET"], credential="old"),
    ):
        with pytest.raises(CredproxyError) as full:
            change(store)
        with pytest.raises(CredproxyError) as fast:
            change(quick)
        assert str(fast.value) == str(full.value) and "no " in str(fast.value)
    quick.add_principal("agent")  # the name is free again
    grant_id = quick.add_grant("agent", ["GET"], credential="gh")
    (listed,) = [g for g in quick.list_grants("agent")]
    assert listed.id == grant_id and listed.principal == "agent"


def test_the_store_is_checked_as_the_orm_path_checks_it(
    new_store: Callable[[str], Store], key: MasterKey, tmp_path: Path
) -> None:
    store = new_store("one")
    path = lite.sqlite_file(store.db.url)
    assert path is not None

    def refusal(with_key: MasterKey | None) -> tuple[str, str]:
        with pytest.raises(CredproxyError) as full:
            Store(store.db.url, with_key).check_ready()
        with pytest.raises(CredproxyError) as quick:
            lite.Store(store.db.url, path, with_key)
        assert type(quick.value) is type(full.value)
        return str(full.value), str(quick.value)

    full, quick = refusal(MasterKey.generate("test"))
    assert full == quick and "is not the key of" in quick
    with sqlite3.connect(str(path)) as db:
        db.execute("UPDATE alembic_version SET version_num = '0008'")
    full, quick = refusal(key)
    assert full == quick and "at schema 0008, not" in quick
    with sqlite3.connect(str(path)) as db:
        db.execute("UPDATE alembic_version SET version_num = '9999'")
    full, quick = refusal(None)
    assert full == quick and "newer than this" in quick
    with sqlite3.connect(str(path)) as db:
        db.execute("DROP TABLE alembic_version")
    full, quick = refusal(None)
    assert full == quick and "at schema none" in quick
    gone = tmp_path / "gone.db"
    with pytest.raises(StoreUnavailable, match="no store at .*gone.db: run credproxy init"):
        lite.Store(f"sqlite:///{gone}", gone, None)
    assert not gone.exists()  # never created


def test_a_store_without_its_key_yet_is_refused(tmp_path: Path, key: MasterKey) -> None:
    store = Store(f"sqlite:///{tmp_path}/k.db", None, create=True)
    store.migrate()
    path = lite.sqlite_file(store.db.url)
    assert path is not None
    with pytest.raises(CredproxyError, match="has no master key yet: run credproxy init"):
        lite.Store(store.db.url, path, key)
    store.close()


@pytest.mark.parametrize(
    ("url", "path"),
    [
        ("sqlite:///credproxy.db", "credproxy.db"),
        ("sqlite:////var/lib/credproxy/db.sqlite", "/var/lib/credproxy/db.sqlite"),
        ("sqlite:///a b.db", "a b.db"),
        ("sqlite:///x.db?mode=ro", None),
        ("sqlite:///x%20y.db", None),
        ("sqlite:///:memory:", None),
        ("sqlite:///", None),
        ("sqlite://host/x.db", None),
        ("sqlite+pysqlite:///x.db", None),
        ("postgresql://u@127.0.0.1/test", None),
    ],
)
def test_only_plain_file_urls_take_the_quick_path(url: str, path: str | None) -> None:
    found = lite.sqlite_file(url)
    assert (str(found) if found else None) == path


def test_a_path_sqlalchemy_would_escape_is_named_as_the_orm_path_names_it(
    new_store: Callable[[str], Store], key: MasterKey
) -> None:
    """SQLAlchemy shows the path percent-encoded (but for ` +/`) in every message that names
    the store; the quick path names it alike (and on one line, whatever the path holds)."""
    url = new_store("dö @n:1+(x)\nz").db.url
    path = lite.sqlite_file(url)
    assert path is not None
    other = MasterKey.generate("test")
    full = Store(url, other)
    with pytest.raises(CredproxyError) as refused:
        full.check_ready()
    full.close()
    with pytest.raises(CredproxyError) as quick:
        lite.Store(url, path, other)
    assert str(quick.value) == str(refused.value)
    assert "%40n%3A1+%28x%29%0Az.db" in str(quick.value)
    reader = lite.Store(url, path, None)
    assert reader.display_url == full.display_url
    reader.close()


def test_a_transaction_sqlite_rolled_back_itself_fails_with_its_own_error(
    new_store: Callable[[str], Store], key: MasterKey
) -> None:
    """On some errors (an interrupt, an I/O error, sometimes a full disk) SQLite rolls the
    whole transaction back itself: the command fails with that error, as the ORM path does,
    not with a ROLLBACK's "no transaction is active", and nothing is left half-written."""
    store = new_store("one")
    _seed(store.add_principal, store)
    before = _rows(store, "change_log"), _rows(store, "grants")

    def interrupt_the_insert(connection: sqlite3.Connection) -> None:
        armed = [False]

        def traced(sql: str) -> None:
            armed[0] = sql.startswith("INSERT INTO grants")

        connection.set_trace_callback(traced)
        connection.set_progress_handler(lambda: armed[0], 1)

    orm = Store(store.db.url, key)
    event.listen(orm.engine, "connect", lambda c, _r: interrupt_the_insert(c))
    with pytest.raises(CredproxyError) as full:
        orm.add_grant("agent", ["GET"], credential="gh")
    orm.close()
    quick = _lite(store, key)
    interrupt_the_insert(quick._db)
    with pytest.raises(CredproxyError) as fast:
        quick.add_grant("agent", ["GET"], credential="gh")
    assert (type(fast.value), str(fast.value)) == (type(full.value), str(full.value))
    assert str(fast.value).endswith("failed: interrupted")
    assert (_rows(store, "change_log"), _rows(store, "grants")) == before
    assert not quick._db.in_transaction
    quick.close()
