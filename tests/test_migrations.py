from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
import sqlalchemy as sa
from alembic.config import Config
from alembic.script import ScriptDirectory

from addon.core.policy import Policy, long_lived
from store.crypto import MasterKey, hash_token
from store.db.models import UTCDateTime
from store.db.revisions import MIGRATIONS, SCHEMA_HEAD
from store.errors import StoreUnavailable
from store.repository import Store

TABLES = {
    "alembic_version",
    "store_state",
    "principals",
    "credentials",
    "grants",
    "access_requests",
    "principal_tokens",
    "console_tokens",
    "rate_buckets",
    "budget_usage",
    "change_log",
}
CREATED = datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC)


def _head() -> str:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    head = ScriptDirectory.from_config(config).get_current_head()
    assert head is not None
    return head


def test_the_head_run_checks_is_alembics() -> None:
    assert SCHEMA_HEAD == _head()


@pytest.fixture
def bare(db_url: str) -> Iterator[Store]:
    """A store on an empty database, without a master key."""
    s = Store(db_url, None, create=True)
    yield s
    s.close()


def test_empty_database_is_brought_to_head(bare: Store) -> None:
    assert bare.schema_revision() is None
    bare.migrate()
    assert set(sa.inspect(bare.engine).get_table_names()) == TABLES
    assert bare.schema_revision() == _head()
    assert bare.change_counter() == 0
    assert bare.stored_key_id() is None


def test_migrating_twice_is_harmless(bare: Store, key: MasterKey) -> None:
    bare.migrate()
    bare.key = key
    bare.check_key(adopt=True)
    bare.add_principal("agent")
    counter = bare.change_counter()
    bare.migrate()
    assert bare.schema_revision() == _head()
    assert [p.name for p in bare.list_principals()] == ["agent"]
    assert bare.change_counter() == counter
    bare.check_ready()


def test_upgrade_from_0001_keeps_the_data(bare: Store, key: MasterKey) -> None:
    bare.migrate("0001")
    assert bare.schema_revision() == "0001"
    assert "websocket" not in {c["name"] for c in sa.inspect(bare.engine).get_columns("grants")}
    principals = sa.table(
        "principals",
        sa.column("id", sa.Integer),
        sa.column("name", sa.String),
        sa.column("token_hash", sa.String),
        sa.column("created_at", UTCDateTime),
    )
    credentials = sa.table(
        "credentials",
        sa.column("id", sa.Integer),
        sa.column("name", sa.String),
        sa.column("scheme", sa.String),
        sa.column("hosts", sa.JSON),
        sa.column("key_id", sa.String),
        sa.column("nonce", sa.LargeBinary),
        sa.column("ciphertext", sa.LargeBinary),
        sa.column("fingerprint", sa.String),
        sa.column("created_at", UTCDateTime),
    )
    grants = sa.table(
        "grants",
        sa.column("id", sa.Integer),
        sa.column("principal_id", sa.Integer),
        sa.column("credential_id", sa.Integer),
        sa.column("methods", sa.JSON),
        sa.column("paths", sa.JSON),
        sa.column("once", sa.Boolean),
        sa.column("created_at", UTCDateTime),
    )
    key_id, nonce, ciphertext = key.seal(b"ghp_secret", "credential/gh")
    with bare.engine.begin() as conn:
        conn.execute(
            sa.update(sa.table("store_state", sa.column("key_id"), sa.column("key_check"))).values(
                key_id=key.key_id, key_check=key.check_value
            )
        )
        conn.execute(
            principals.insert().values(
                id=1, name="agent", token_hash=hash_token("tok"), created_at=CREATED
            )
        )
        conn.execute(
            credentials.insert().values(
                id=1,
                name="gh",
                scheme="bearer",
                hosts=["api.github.com"],
                key_id=key_id,
                nonce=nonce,
                ciphertext=ciphertext,
                fingerprint="fp-x",
                created_at=CREATED,
            )
        )
        conn.execute(
            grants.insert().values(
                id=1,
                principal_id=1,
                credential_id=1,
                methods=["GET"],
                paths=["/v1/"],
                once=False,
                created_at=CREATED,
            )
        )

    bare.migrate()

    assert bare.schema_revision() == _head()
    with bare.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT websocket FROM grants WHERE id = 1")).scalar_one() in (
            False,
            0,
        )
    bare.key = key
    bare.check_ready()
    (principal,) = bare.list_principals()
    assert (principal.name, principal.created_at) == ("agent", CREATED)
    (grant,) = bare.list_grants()
    assert (grant.principal, grant.credential, grant.paths) == ("agent", "gh", ["/v1/"])
    assert grant.websocket is False
    snap = bare.snapshot()
    assert snap.credentials["gh"].secret.reveal() == b"ghp_secret"
    assert [g.id for g in snap.grants] == [1]
    assert snap.token_hashes == {"agent": hash_token("tok")}


def test_upgrade_from_0006_keeps_each_principals_token_working(bare: Store, key: MasterKey) -> None:
    bare.migrate("0006")
    assert "principal_tokens" not in sa.inspect(bare.engine).get_table_names()
    principals = sa.table(
        "principals",
        sa.column("id", sa.Integer),
        sa.column("name", sa.String),
        sa.column("token_hash", sa.String),
        sa.column("created_at", UTCDateTime),
    )
    with bare.engine.begin() as conn:
        conn.execute(
            sa.update(sa.table("store_state", sa.column("key_id"), sa.column("key_check"))).values(
                key_id=key.key_id, key_check=key.check_value
            )
        )
        conn.execute(
            principals.insert().values(
                id=1, name="agent", token_hash=hash_token("tok"), created_at=CREATED
            )
        )

    bare.migrate()

    bare.key = key
    bare.check_ready()
    policy = Policy(bare.snapshot())
    assert policy.token_of("agent", "tok", datetime.now(UTC)) == long_lived(1)
    token_id, token = bare.add_token("agent", None)
    assert Policy(bare.snapshot()).token_of("agent", token, datetime.now(UTC)) == token_id


def test_unmigrated_database_is_not_ready(bare: Store) -> None:
    with pytest.raises(StoreUnavailable, match="schema none, not .*: run credproxy init"):
        bare.check_ready()


def test_database_behind_head_is_not_ready(bare: Store) -> None:
    bare.migrate("0001")
    with pytest.raises(StoreUnavailable, match="schema 0001, not .*: run credproxy init"):
        bare.check_ready()


def test_database_with_two_versions_is_not_ready(bare: Store) -> None:
    bare.migrate()
    with bare.engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO alembic_version (version_num) VALUES ('0002')"))
    assert bare.schema_revision() == f"0002, {_head()}"
    with pytest.raises(StoreUnavailable, match=f"schema 0002, {_head()}, not {_head()}"):
        bare.check_ready()


def test_a_schema_from_a_newer_credproxy_is_refused_in_one_line(store: Store) -> None:
    with store.engine.begin() as conn:
        conn.exec_driver_sql("UPDATE alembic_version SET version_num = '9999'")
    for attempt in (store.migrate, store.check_ready):
        with pytest.raises(StoreUnavailable, match="at schema 9999, newer than") as info:
            attempt()
        assert "\n" not in str(info.value)


def test_upgrade_from_0007_keeps_grants_and_requests_and_holds_nothing(
    bare: Store, key: MasterKey
) -> None:
    bare.migrate("0007")
    assert "approval" not in {c["name"] for c in sa.inspect(bare.engine).get_columns("grants")}
    with bare.engine.begin() as conn:
        conn.execute(
            sa.update(sa.table("store_state", sa.column("key_id"), sa.column("key_check"))).values(
                key_id=key.key_id, key_check=key.check_value
            )
        )
        conn.execute(
            sa.text(
                "INSERT INTO principals (id, name, token_hash, created_at) "
                "VALUES (1, 'agent', :h, :c)"
            ),
            {"h": hash_token("tok"), "c": CREATED.replace(tzinfo=None)},
        )
        conn.execute(
            sa.text(
                "INSERT INTO grants (id, principal_id, hosts, methods, paths, once, websocket, "
                "encoded_slash, created_at, uses) VALUES (1, 1, '[\"api.test\"]', '[\"GET\"]', "
                "'[\"/\"]', false, false, false, :c, 0)"
            ),
            {"c": CREATED.replace(tzinfo=None)},
        )
        conn.execute(
            sa.text(
                "INSERT INTO access_requests (id, principal_id, host, port, method, path, "
                "source, state, count, first_seen, last_seen) VALUES (1, 1, 'api.test', 443, "
                "'GET', '/x', 'auto', 'pending', 1, :c, :c)"
            ),
            {"c": CREATED.replace(tzinfo=None)},
        )

    bare.migrate()

    assert bare.schema_revision() == _head()
    bare.key = key
    (grant,) = bare.list_grants()
    assert (grant.approval, grant.hold) == (None, None)
    (request,) = bare.list_access_requests()
    assert (request.kind, request.state, request.covered) == ("access", "pending", 0)
    (compiled,) = bare.snapshot().grants
    assert compiled.approval is None
