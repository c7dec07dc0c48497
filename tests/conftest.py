"""Store fixtures: every store test runs on SQLite and on PostgreSQL."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from store.crypto import MasterKey
from store.repository import Store

PG_ADDRESS = "127.0.0.1:5432"
PG_USERS = ("postgres", "root")


def _pg_admin() -> tuple[psycopg.Connection, str]:
    """A connection to the maintenance database, and the role it uses; skip or fail if down."""
    errors = []
    for user in PG_USERS:
        try:
            url = f"postgresql://{user}@{PG_ADDRESS}/postgres"
            return psycopg.connect(url, autocommit=True, connect_timeout=3), user
        except psycopg.OperationalError as e:
            errors.append(f"{user}: {(str(e).strip().splitlines() or ['?'])[0]}")
    reason = f"PostgreSQL at {PG_ADDRESS} is unreachable ({'; '.join(errors)})"
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def pg_database() -> Iterator[tuple[psycopg.Connection, str]]:
    """One PostgreSQL database for the run, dropped afterwards; an admin connection to it.

    Creating a database per test costs about half a second, so each test gets its own role
    and schema inside this one instead.
    """
    admin, user = _pg_admin()
    name = f"credproxy_test_{secrets.token_hex(6)}"
    with admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        try:
            url = f"postgresql://{user}@{PG_ADDRESS}/{name}"
            with psycopg.connect(url, autocommit=True) as conn:
                yield conn, name
        finally:
            admin.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture(params=["sqlite", "postgresql"], ids=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty database: an SQLite file, or a fresh PostgreSQL role and schema."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/t.db"
        return
    conn, database = request.getfixturevalue("pg_database")
    # The default search_path starts with "$user", so the role's tables land in its schema.
    role = f"credproxy_test_{secrets.token_hex(6)}"
    ident = sql.Identifier(role)
    conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(ident))
    conn.execute(sql.SQL("CREATE SCHEMA AUTHORIZATION {}").format(ident))
    try:
        yield f"postgresql+psycopg://{role}@{PG_ADDRESS}/{database}"
    finally:
        # A failed test may leave a connection holding locks the DROP would wait for.
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,)
        )
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(ident))
        conn.execute(sql.SQL("DROP ROLE {}").format(ident))


@pytest.fixture
def key() -> MasterKey:
    return MasterKey.generate("test")


@pytest.fixture
def store(db_url: str, key: MasterKey) -> Iterator[Store]:
    """A migrated store whose master key is `key`."""
    s = Store(db_url, key, create=True)
    s.migrate()
    s.check_key(adopt=True)
    yield s
    s.close()


@pytest.fixture
def open_store(db_url: str) -> Iterator[Callable[[MasterKey | None], Store]]:
    """Open more stores on the same database (another replica, another key); closed after."""
    opened: list[Store] = []

    def open_(key: MasterKey | None) -> Store:
        opened.append(Store(db_url, key))
        return opened[-1]

    yield open_
    for s in opened:
        s.close()
