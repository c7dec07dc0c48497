import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import null, select, update
from sqlalchemy.orm import Session

from addon.policy import Policy, Reason, Request
from store.crypto import MasterKey, Secret, hash_token
from store.errors import (
    Conflict,
    InvalidInput,
    MasterKeyError,
    NotFound,
    SealError,
    StoreUnavailable,
)
from store.grammar import HostPattern
from store.models import Credential, Grant, Principal, utcnow
from store.records import TOMBSTONE_RETENTION
from store.repository import Store

SECRET = Secret(b"ghp_0123456789abcdef")


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


def _seed(store: Store) -> int:
    """Principal `agent`, bearer credential `gh` on api.github.com, and a grant for it."""
    store.add_principal("agent")
    store.add_credential("gh", "bearer", ["api.github.com"], SECRET)
    return store.add_grant("agent", ["GET"], credential="gh")


def _row(store: Store, model: type, name: str) -> object:
    with Session(store.engine) as session:
        return session.scalars(select(model).where(model.name == name)).one()


def _grant_state(store: Store, grant_id: int) -> str:
    (grant,) = [g for g in store.list_grants() if g["id"] == grant_id]
    return str(grant["state"])


# -- principals ------------------------------------------------------------------------


def test_principal_token_is_returned_once_and_stored_only_as_its_hash(store: Store) -> None:
    token = store.add_principal("agent")
    assert len(token) >= 22
    row = _row(store, Principal, "agent")
    assert row.token_hash == hash_token(token)
    assert all(token not in str(v) for v in vars(row).values())
    assert [p.name for p in store.list_principals()] == ["agent"]


def test_principal_name_is_validated(store: Store) -> None:
    with pytest.raises(InvalidInput, match="invalid principal name"):
        store.add_principal("Agent")


def test_duplicate_principal_is_a_conflict(store: Store) -> None:
    store.add_principal("agent")
    with pytest.raises(Conflict, match="'agent' already exists"):
        store.add_principal("agent")


def test_removing_a_principal_revokes_its_grants(store: Store) -> None:
    grant_id = _seed(store)
    assert store.remove_principal("agent") == 1
    assert store.list_principals() == []
    assert _grant_state(store, grant_id) == "revoked"


def test_removed_principal_name_can_be_reused_without_its_old_grants(store: Store) -> None:
    _seed(store)
    first = _row(store, Principal, "agent").token_hash
    store.remove_principal("agent")
    token = store.add_principal("agent")
    snap = store.snapshot()
    assert snap.token_hashes == {"agent": hash_token(token)} != {"agent": first}
    assert snap.grants == ()
    assert store.list_grants("agent") == []


def test_removing_an_unknown_principal_is_not_found(store: Store) -> None:
    with pytest.raises(NotFound, match="no principal named 'ghost'"):
        store.remove_principal("ghost")


# -- credentials -----------------------------------------------------------------------


def test_credential_is_sealed_and_listed_with_its_fingerprint(store: Store, key: MasterKey) -> None:
    fingerprint = store.add_credential(
        "gh", "bearer", ["api.github.com", "*.example.net"], SECRET
    )
    (row,) = store.list_credentials()
    assert (row.name, row.scheme, row.fingerprint) == ("gh", "bearer", fingerprint)
    assert row.hosts == ["*.example.net", "api.github.com"]
    assert SECRET.reveal() not in row.ciphertext
    assert key.open(row.key_id, row.nonce, row.ciphertext, "credential/gh") == SECRET


def test_duplicate_credential_is_a_conflict(store: Store) -> None:
    store.add_credential("gh", "bearer", ["api.github.com"], SECRET)
    with pytest.raises(Conflict, match="'gh' already exists"):
        store.add_credential("gh", "bearer", ["api.github.com"], Secret(b"other"))


@pytest.mark.parametrize(
    ("scheme", "secret", "options", "reason"),
    [
        pytest.param("header", b"k", {}, "--header", id="header scheme needs --header"),
        pytest.param(
            "bearer", b"k", {"header_name": "X-Key"}, "--header", id="bearer refuses --header"
        ),
        pytest.param("query", b"k", {}, "--param", id="query scheme needs --param"),
        pytest.param("basic", b"userpass", {}, "user:password", id="basic needs user:password"),
        pytest.param("header", b"k", {"header_name": "Host"}, "forbidden", id="header is not Host"),
        pytest.param(
            "header", b"k", {"header_name": "Proxy-Authorization"}, "forbidden",
            id="header is not Proxy-Authorization",
        ),
        pytest.param("query", b"k", {"param_name": "a&b"}, "parameter", id="param name is checked"),
        pytest.param("bearer", b"", {}, "empty", id="empty secret"),
        pytest.param("bearer", b"tok\r\nX-Evil: 1", {}, "control", id="CRLF in the secret"),
        pytest.param("bearer", b"tok\x00", {}, "control", id="NUL in the secret"),
        pytest.param("bearer", b"tok\x7f", {}, "control", id="DEL in the secret"),
        pytest.param("bearer", "tök".encode(), {}, "ASCII", id="non-ASCII header secret"),
        pytest.param("digest", b"k", {}, "invalid scheme", id="unknown scheme"),
    ],
)
def test_credential_options_and_secret_are_validated(
    store: Store, scheme: str, secret: bytes, options: dict[str, str], reason: str
) -> None:
    counter = store.change_counter()
    with pytest.raises(InvalidInput, match=reason):
        store.add_credential("c", scheme, ["api.example.com"], Secret(secret), **options)
    assert store.list_credentials() == []
    assert store.change_counter() == counter


@pytest.mark.parametrize(
    ("hosts", "reason"),
    [
        pytest.param([], "at least one --host", id="no host"),
        pytest.param(["*.com"], "public suffix", id="wildcard over a TLD"),
        pytest.param(["api.example.com", "bad host"], "invalid host", id="one bad host of two"),
    ],
)
def test_credential_hosts_are_validated(store: Store, hosts: list[str], reason: str) -> None:
    with pytest.raises(InvalidInput, match=reason):
        store.add_credential("c", "bearer", hosts, SECRET)
    assert store.list_credentials() == []


@pytest.mark.parametrize(
    ("scheme", "secret", "options"),
    [
        pytest.param("bearer", b"tok", {}, id="bearer"),
        pytest.param("header", b"tok", {"header_name": "X-Api-Key"}, id="header"),
        pytest.param("basic", b"user:pa:ss", {}, id="basic"),
        pytest.param("query", b"tok", {"param_name": "api_key"}, id="query"),
    ],
)
def test_each_scheme_stores_its_option(
    store: Store, scheme: str, secret: bytes, options: dict[str, str]
) -> None:
    store.add_credential("c", scheme, ["api.example.com"], Secret(secret), **options)
    record = store.snapshot().credentials["c"]
    assert record.scheme == scheme
    assert (record.header_name, record.param_name) == (
        options.get("header_name"),
        options.get("param_name"),
    )
    assert record.secret.reveal() == secret


def test_rotating_a_credential_reseals_it(store: Store) -> None:
    before = store.add_credential("gh", "bearer", ["api.github.com"], SECRET)
    old_ciphertext = _row(store, Credential, "gh").ciphertext
    after = store.rotate_credential("gh", Secret(b"ghp_new"))
    row = _row(store, Credential, "gh")
    assert after != before
    assert row.ciphertext != old_ciphertext
    assert row.rotated_at is not None
    assert store.snapshot().credentials["gh"].secret.reveal() == b"ghp_new"


def test_rotation_validates_the_new_secret(store: Store) -> None:
    store.add_credential("gh", "basic", ["api.github.com"], Secret(b"u:p"))
    with pytest.raises(InvalidInput, match="user:password"):
        store.rotate_credential("gh", Secret(b"nocolon"))
    assert store.snapshot().credentials["gh"].secret.reveal() == b"u:p"


def test_rotating_an_unknown_credential_is_not_found(store: Store) -> None:
    with pytest.raises(NotFound, match="no credential named 'gh'"):
        store.rotate_credential("gh", SECRET)


def test_removing_a_credential_wipes_its_secret_and_revokes_its_grants(store: Store) -> None:
    grant_id = _seed(store)
    assert store.remove_credential("gh") == 1
    row = _row(store, Credential, "gh")
    assert (row.key_id, row.nonce, row.ciphertext) == (None, None, None)
    assert store.list_credentials() == []
    assert _grant_state(store, grant_id) == "revoked"
    store.add_credential("gh", "bearer", ["api.github.com"], SECRET)


# -- grants ----------------------------------------------------------------------------


def test_grant_defaults_to_the_credentials_hosts_and_the_root_path(store: Store) -> None:
    grant_id = _seed(store)
    (grant,) = store.list_grants()
    assert grant["id"] == grant_id
    assert (grant["hosts"], grant["methods"], grant["paths"]) == (None, ["GET"], ["/"])
    assert (grant["once"], grant["websocket"], grant["state"]) == (False, False, "active")


def test_grant_hosts_may_narrow_a_wildcard_credential(store: Store) -> None:
    store.add_principal("agent")
    store.add_credential("ex", "bearer", ["*.example.com"], SECRET)
    store.add_grant("agent", ["GET"], credential="ex", hosts=["api.example.com"])
    (grant,) = store.snapshot().grants
    assert grant.hosts == (HostPattern("api.example.com"),)


@pytest.mark.parametrize(
    ("kwargs", "error", "reason"),
    [
        pytest.param(
            {"credential": "gh", "hosts": ["evil.example"]}, InvalidInput, "outside",
            id="host outside the credential's hosts",
        ),
        pytest.param(
            {"credential": "gh", "hosts": ["api.github.com:8443"]}, InvalidInput, "outside",
            id="credential host on another port",
        ),
        pytest.param(
            {"credential": "gh", "hosts": ["*.github.com"]}, InvalidInput, "outside",
            id="wildcard wider than the credential's host",
        ),
        pytest.param({}, InvalidInput, "needs at least one --host", id="no credential and no host"),
        pytest.param(
            {"principal": "ghost", "credential": "gh"}, NotFound, "ghost", id="unknown principal"
        ),
        pytest.param({"credential": "nope"}, NotFound, "nope", id="unknown credential"),
        pytest.param(
            {"credential": "gh", "expires_at": utcnow() - timedelta(seconds=1)}, InvalidInput,
            "past", id="expiry in the past",
        ),
        pytest.param({"credential": "gh", "methods": []}, InvalidInput, "--method", id="no method"),
        pytest.param(
            {"credential": "gh", "methods": ["*", "GET"]}, InvalidInput, "every method",
            id="star with another method",
        ),
        pytest.param(
            {"hosts": ["*.com"]}, InvalidInput, "public suffix", id="host-only grant over *.com",
        ),
    ],
)
def test_bad_grant_is_refused_and_changes_nothing(
    store: Store, kwargs: dict[str, object], error: type[Exception], reason: str
) -> None:
    _seed(store)
    before = (store.list_grants(), store.change_counter())
    kwargs = {"principal": "agent", "methods": ["GET"], **kwargs}
    with pytest.raises(error, match=reason):
        store.add_grant(**kwargs)  # type: ignore[arg-type]
    assert (store.list_grants(), store.change_counter()) == before


def test_revoking_an_unknown_grant_is_not_found(store: Store) -> None:
    with pytest.raises(NotFound, match="no grant with id 999"):
        store.revoke_grant(999)


# -- the change counter ----------------------------------------------------------------


CHANGES: list[object] = [
    pytest.param(lambda s, g: s.add_principal("other"), id="add a principal"),
    pytest.param(lambda s, g: s.remove_principal("agent"), id="remove a principal"),
    pytest.param(
        lambda s, g: s.add_credential("c2", "bearer", ["a.example.com"], SECRET),
        id="add a credential",
    ),
    pytest.param(lambda s, g: s.rotate_credential("gh", Secret(b"x")), id="rotate a credential"),
    pytest.param(lambda s, g: s.remove_credential("gh"), id="remove a credential"),
    pytest.param(lambda s, g: s.add_grant("agent", ["*"], credential="gh"), id="add a grant"),
    pytest.param(lambda s, g: s.revoke_grant(g), id="revoke a grant"),
    pytest.param(lambda s, g: s.rotate_key(MasterKey.generate("new")), id="rotate the key"),
]


@pytest.mark.parametrize("change", CHANGES)
def test_every_change_bumps_the_counter_once(
    store: Store, change: Callable[[Store, int], object]
) -> None:
    grant_id = _seed(store)
    before = store.change_counter()
    change(store, grant_id)
    assert store.change_counter() == before + 1


def test_a_refused_change_leaves_the_counter_alone(store: Store) -> None:
    _seed(store)
    before = store.change_counter()
    with pytest.raises(Conflict):
        store.add_principal("agent")
    with pytest.raises(NotFound):
        store.remove_credential("ghost")
    assert store.change_counter() == before


# -- once-grants -----------------------------------------------------------------------


def _once_grant(store: Store, **kwargs: object) -> int:
    store.add_principal("agent")
    store.add_credential("gh", "bearer", ["api.github.com"], SECRET)
    return store.add_grant("agent", ["POST"], credential="gh", once=True, **kwargs)  # type: ignore[arg-type]


def test_once_grant_is_consumed_exactly_once(store: Store) -> None:
    grant_id = _once_grant(store)
    assert store.consume_once(grant_id) is True
    assert store.consume_once(grant_id) is False
    assert _grant_state(store, grant_id) == "consumed"
    assert [g.consumed for g in store.snapshot().grants] == [True]


def test_revoked_once_grant_cannot_be_consumed(store: Store) -> None:
    grant_id = _once_grant(store)
    store.revoke_grant(grant_id)
    assert store.consume_once(grant_id) is False


def test_expired_once_grant_cannot_be_consumed(store: Store) -> None:
    grant_id = _once_grant(store, expires_at=utcnow() + timedelta(hours=1))
    with store.engine.begin() as conn:
        conn.execute(
            update(Grant)
            .where(Grant.id == grant_id)
            .values(expires_at=utcnow() - timedelta(seconds=1))
        )
    assert store.consume_once(grant_id) is False
    assert _grant_state(store, grant_id) == "expired"


def test_ordinary_grant_is_not_consumed(store: Store) -> None:
    grant_id = _seed(store)
    assert store.consume_once(grant_id) is False
    assert _grant_state(store, grant_id) == "active"


def test_concurrent_replicas_consume_a_once_grant_exactly_once(
    store: Store, key: MasterKey, open_store: Callable[[MasterKey | None], Store]
) -> None:
    grant_id = _once_grant(store)
    replicas = [open_store(key) for _ in range(4)]
    start = threading.Barrier(16)
    results: list[bool] = []
    errors: list[BaseException] = []

    def consume(replica: Store) -> None:
        start.wait()
        try:
            results.append(replica.consume_once(grant_id))
        except BaseException as e:  # surfaced by the assertion below, not swallowed
            errors.append(e)

    threads = [threading.Thread(target=consume, args=(replicas[i % 4],)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert errors == []
    assert sorted(results) == [False] * 15 + [True]


# -- the proxy's snapshot --------------------------------------------------------------


def test_snapshot_holds_live_records_with_open_secrets(store: Store) -> None:
    live = _seed(store)
    store.add_principal("gone")
    store.add_grant("gone", ["GET"], credential="gh")
    store.remove_principal("gone")
    revoked = store.add_grant("agent", ["POST"], credential="gh")
    store.revoke_grant(revoked)
    host_only = store.add_grant("agent", ["GET"], hosts=["pypi.org"], paths=["/simple/"])

    snap = store.snapshot()
    assert snap.counter == store.change_counter()
    assert set(snap.token_hashes) == {"agent"}
    assert snap.credentials["gh"].secret == SECRET
    assert snap.unreadable == ()
    grants = {g.id: g for g in snap.grants}
    assert set(grants) == {live, host_only}
    assert grants[live].hosts == (HostPattern("api.github.com"),)
    assert (grants[live].principal, grants[live].credential) == ("agent", "gh")
    assert grants[live].methods == frozenset({"GET"})
    assert grants[host_only].credential is None
    assert grants[host_only].hosts == (HostPattern("pypi.org"),)
    assert grants[host_only].paths == ("/simple/",)


def _expire(store: Store, grant_id: int, ago: timedelta) -> None:
    with store.engine.begin() as conn:
        conn.execute(update(Grant).where(Grant.id == grant_id).values(expires_at=utcnow() - ago))


def test_snapshot_keeps_expired_grants_as_tombstones_for_a_while(store: Store) -> None:
    recent, old = _seed(store), store.add_grant("agent", ["POST"], credential="gh")
    _expire(store, recent, timedelta(seconds=1))
    _expire(store, old, TOMBSTONE_RETENTION + timedelta(seconds=1))
    assert [g.id for g in store.snapshot().grants] == [recent]


def _spent_grants(store: Store) -> tuple[int, int]:
    """A standing grant on /v1/, and a once-grant and an expiring grant beside it."""
    store.add_principal("agent")
    store.add_credential("gh", "bearer", ["api.github.com"], SECRET)
    store.add_grant("agent", ["GET"], credential="gh", paths=["/v1/"])
    once = store.add_grant("agent", ["GET"], credential="gh", paths=["/once/"], once=True)
    expiring = store.add_grant(
        "agent",
        ["GET"],
        credential="gh",
        paths=["/soon/"],
        expires_at=utcnow() + timedelta(hours=1),
    )
    return once, expiring


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        pytest.param("/once/x", Reason.GRANT_CONSUMED, id="a used once-grant says so"),
        pytest.param("/soon/x", Reason.GRANT_EXPIRED, id="an expired grant says so"),
        pytest.param("/other", Reason.PATH_NOT_ALLOWED, id="no grant for the path says so"),
    ],
)
def test_a_fresh_snapshot_gives_a_spent_grant_its_own_reason(
    store: Store, path: str, reason: Reason
) -> None:
    once, expiring = _spent_grants(store)
    assert store.consume_once(once)
    _expire(store, expiring, timedelta(seconds=1))
    # What a restarted proxy, or a replica that reconnects, compiles.
    policy = Policy(store.snapshot())
    request = Request("api.github.com", 443, "https", "GET", path)
    decision = policy.decide("agent", request, utcnow())
    assert (decision.allowed, decision.reason) == (False, reason)


@pytest.mark.parametrize(
    "stored",
    [
        pytest.param(None, id="grant hosts stored as JSON null read as the credential's"),
        pytest.param(null(), id="grant hosts stored as SQL NULL read as the credential's"),
    ],
)
def test_snapshot_grant_without_hosts_has_the_credentials(store: Store, stored: object) -> None:
    grant_id = _seed(store)
    with store.engine.begin() as conn:
        conn.execute(update(Grant).where(Grant.id == grant_id).values(hosts=stored))
    (grant,) = store.snapshot().grants
    assert grant.hosts == (HostPattern("api.github.com"),)


def test_snapshot_shares_what_grants_repeat(store: Store) -> None:
    store.add_principal("agent")
    for _ in range(2):
        store.add_grant("agent", ["GET", "POST"], hosts=["pypi.org"], paths=["/a/", "/b/"])
    first, second = store.snapshot().grants
    assert first.methods is second.methods and first.paths is second.paths
    assert first.hosts is second.hosts


@pytest.mark.parametrize(
    ("column", "value"),
    [
        pytest.param("hosts", ["API.github.com"], id="a stored host the grammar refuses"),
        pytest.param("hosts", ["*.com"], id="a stored wildcard over a public suffix"),
    ],
)
def test_snapshot_refuses_a_grant_the_cli_could_not_have_written(
    store: Store, column: str, value: object
) -> None:
    grant_id = _seed(store)
    with store.engine.begin() as conn:
        conn.execute(update(Grant).where(Grant.id == grant_id).values({column: value}))
    with pytest.raises(InvalidInput, match="invalid host"):
        store.snapshot()


def test_tampered_ciphertext_is_reported_unreadable_and_its_grants_dropped(
    store: Store,
) -> None:
    _seed(store)
    store.add_credential("pypi", "bearer", ["upload.pypi.org"], Secret(b"pypi-token"))
    pypi_grant = store.add_grant("agent", ["POST"], credential="pypi")
    row = _row(store, Credential, "gh")
    with store.engine.begin() as conn:
        conn.execute(
            update(Credential)
            .where(Credential.id == row.id)
            .values(ciphertext=bytes([row.ciphertext[0] ^ 1]) + row.ciphertext[1:])
        )
    snap = store.snapshot()
    assert snap.unreadable == ("gh",)
    assert set(snap.credentials) == {"pypi"}
    assert [g.id for g in snap.grants] == [pypi_grant]


def test_ciphertext_copied_to_another_credential_is_unreadable(store: Store) -> None:
    store.add_credential("gh", "bearer", ["api.github.com"], SECRET)
    store.add_credential("evil", "bearer", ["evil.example"], Secret(b"placeholder"))
    source = _row(store, Credential, "gh")
    with store.engine.begin() as conn:
        conn.execute(
            update(Credential)
            .where(Credential.name == "evil")
            .values(nonce=source.nonce, ciphertext=source.ciphertext)
        )
    snap = store.snapshot()
    assert snap.unreadable == ("evil",)
    assert "evil" not in snap.credentials


# -- the master key --------------------------------------------------------------------


def test_rotating_the_key_reseals_every_secret(
    store: Store, key: MasterKey, open_store: Callable[[MasterKey | None], Store]
) -> None:
    _seed(store)
    store.add_credential("pypi", "bearer", ["upload.pypi.org"], Secret(b"pypi-token"))
    old_fingerprint = store.snapshot().credentials["gh"].fingerprint
    new = MasterKey.generate("new key file")

    assert store.rotate_key(new) == 2

    row = _row(store, Credential, "gh")
    assert row.key_id == new.key_id
    with pytest.raises(SealError):
        key.open(row.key_id, row.nonce, row.ciphertext, "credential/gh")
    with pytest.raises(SealError):
        key.open(key.key_id, row.nonce, row.ciphertext, "credential/gh")
    with pytest.raises(MasterKeyError):
        open_store(key).check_key()

    rotated = open_store(new)
    rotated.check_key()
    snap = rotated.snapshot()
    assert snap.key_id == new.key_id
    assert snap.credentials["gh"].secret == SECRET
    assert snap.credentials["pypi"].secret.reveal() == b"pypi-token"
    assert snap.credentials["gh"].fingerprint == new.fingerprint(SECRET) != old_fingerprint
    assert len(snap.grants) == 1


def test_rotating_with_a_stale_key_is_refused(
    store: Store, open_store: Callable[[MasterKey | None], Store]
) -> None:
    _seed(store)
    stale = open_store(MasterKey.generate("stale key file"))
    with pytest.raises(MasterKeyError, match="stale key file"):
        stale.rotate_key(MasterKey.generate("new"))
    assert store.snapshot().credentials["gh"].secret == SECRET


def test_wrong_key_is_refused_up_front_naming_its_source(
    store: Store, open_store: Callable[[MasterKey | None], Store]
) -> None:
    _seed(store)
    wrong = open_store(MasterKey.generate("key file /etc/credproxy/wrong.key"))
    with pytest.raises(MasterKeyError, match="key file /etc/credproxy/wrong.key") as caught:
        wrong.check_key()
    assert wrong.key is not None and wrong.key.key_id in str(caught.value)


def test_adopting_a_key_does_not_replace_the_stores_key(
    store: Store, open_store: Callable[[MasterKey | None], Store]
) -> None:
    other = open_store(MasterKey.generate("other"))
    with pytest.raises(MasterKeyError):
        other.check_key(adopt=True)
    store.check_key()


# -- what only init may do ------------------------------------------------------------------


def test_a_schema_from_a_newer_credproxy_is_refused_in_one_line(store: Store) -> None:
    with store.engine.begin() as conn:
        conn.exec_driver_sql("UPDATE alembic_version SET version_num = '9999'")
    for attempt in (store.migrate, store.check_ready):
        with pytest.raises(StoreUnavailable, match="at schema 9999, newer than") as info:
            attempt()
        assert "\n" not in str(info.value)


def test_an_sqlite_store_is_never_created_but_by_init(tmp_path: Path, key: MasterKey) -> None:
    path = tmp_path / "gone.db"
    with pytest.raises(StoreUnavailable, match="no store at"):
        Store(f"sqlite:///{path}", key)
    assert not path.exists()
    created = Store(f"sqlite:///{path}", key, create=True)
    created.migrate()
    created.close()
    opened = Store(f"sqlite:///{path}", key)
    assert opened.schema_revision() is not None
    # Deleted while open: a new connection must not bring an empty store into being.
    opened.close()
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    with pytest.raises(StoreUnavailable):
        opened.change_counter()
    assert not path.exists()
