"""The credentials table: sealed secrets, their schemes and hosts, rotation and removal."""

import contextlib
import json
import threading
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from store.crypto import MasterKey, Secret
from store.db.models import Credential
from store.errors import Conflict, InvalidInput, NotFound
from store.repository import Store
from tests.stores import SECRET, grant_state, read_row, seed

# -- credentials -----------------------------------------------------------------------


def test_credential_is_sealed_and_listed_with_its_fingerprint(store: Store, key: MasterKey) -> None:
    fingerprint = store.add_credential("gh", "bearer", ["api.github.com", "*.example.net"], SECRET)
    (listed,) = store.list_credentials()
    assert (listed.name, listed.scheme, listed.fingerprint) == ("gh", "bearer", fingerprint)
    assert listed.hosts == ["*.example.net", "api.github.com"]
    row = read_row(store, Credential, "gh")
    assert SECRET.reveal() not in row.ciphertext
    assert key.open(row.key_id, row.nonce, row.ciphertext, "credential/gh") == SECRET


def test_duplicate_credential_is_a_conflict(store: Store) -> None:
    store.add_credential("gh", "bearer", ["api.github.com"], SECRET)
    with pytest.raises(Conflict, match="'gh' already exists"):
        store.add_credential("gh", "bearer", ["api.github.com"], Secret(b"other"))


@pytest.mark.parametrize(
    ("scheme", "secret", "options", "reason"),
    [
        pytest.param(
            "header", b"k", {}, "a header name goes with", id="header scheme needs --header"
        ),
        pytest.param(
            "bearer",
            b"k",
            {"header_name": "X-Key"},
            "a header name goes with",
            id="bearer refuses --header",
        ),
        pytest.param(
            "query", b"k", {}, "a parameter name goes with", id="query scheme needs --param"
        ),
        pytest.param("basic", b"userpass", {}, "user:password", id="basic needs user:password"),
        pytest.param("header", b"k", {"header_name": "Host"}, "forbidden", id="header is not Host"),
        pytest.param(
            "header",
            b"k",
            {"header_name": "Proxy-Authorization"},
            "forbidden",
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
        pytest.param([], "at least one host", id="no host"),
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
    old_ciphertext = read_row(store, Credential, "gh").ciphertext
    after = store.rotate_credential("gh", Secret(b"ghp_new"))
    row = read_row(store, Credential, "gh")
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
    grant_id = seed(store)
    assert store.remove_credential("gh") == 1
    row = read_row(store, Credential, "gh")
    assert (row.key_id, row.nonce, row.ciphertext) == (None, None, None)
    assert store.list_credentials() == []
    assert grant_state(store, grant_id) == "revoked"
    store.add_credential("gh", "bearer", ["api.github.com"], SECRET)


@pytest.mark.parametrize("change", ["rotate", "remove"])
def test_a_rotation_or_removal_during_a_token_exchange_is_never_overwritten(
    store: Store, open_store: Callable[[MasterKey | None], Store], key: MasterKey, change: str
):
    """oauth2-refresh seals a rotated refresh token back (store.credentials.exchange) after
    calling the token endpoint. An operator's rotate or remove meanwhile must win: on SQLite
    the read took no lock, and the exchange's write went by primary key alone, so it put the
    old credential's refresh token back under the new fingerprint, or re-sealed a secret
    `remove` had destroyed."""
    first = {"client_id": "a", "client_secret": "s", "refresh_token": "refresh-first"}
    options = {"token_url": "https://auth.example.com/t"}
    fingerprint = store.add_credential(
        "rt", "oauth2-refresh", ["api.example.com"], Secret(json.dumps(first).encode()),
        options=options,
    )  # fmt: skip
    other = open_store(key)
    done = threading.Event()
    operator = {"client_id": "a", "client_secret": "s", "refresh_token": "refresh-operator"}

    def change_it() -> None:
        if change == "rotate":
            other.rotate_credential("rt", Secret(json.dumps(operator).encode()))
        else:
            other.remove_credential("rt")
        done.set()

    worker = threading.Thread(target=change_it)

    def step(data: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        worker.start()
        done.wait(1)  # PostgreSQL: the change waits on the row lock, so not done yet
        return "exchanged", {**data, "refresh_token": "refresh-from-the-old-credential"}

    try:
        store.exchange_credential("rt", fingerprint, step, hold=5)
    except Conflict:
        pass
    worker.join(15)
    assert done.is_set()
    with Session(store.engine) as session:
        row = session.scalars(select(Credential).where(Credential.name == "rt")).one()
        removed, destroyed = row.removed_at is not None, row.ciphertext is None
    if change == "remove":
        assert removed and destroyed, "the exchange sealed a removed credential's secret back"
    else:
        sealed = json.loads(store.snapshot().credentials["rt"].secret.reveal())
        kept = sealed["refresh_token"] == "refresh-operator"
        assert kept, "the operator's rotation was overwritten by the exchange"


def test_two_processes_never_present_one_refresh_token_twice(
    store: Store, open_store: Callable[[MasterKey | None], Store], key: MasterKey
):
    """Two stores on one database (two `--workers`, or two replicas) refresh the same
    credential at once: the second must read the refresh token the first sealed back. On
    SQLite (no row lock) both used to read the first one, and a provider that rotates on use
    saw it twice (reuse detection revokes the whole family)."""
    first = {"client_id": "a", "client_secret": "s", "refresh_token": "refresh-0"}
    fingerprint = store.add_credential(
        "rt", "oauth2-refresh", ["api.example.com"], Secret(json.dumps(first).encode()),
        options={"token_url": "https://auth.example.com/t"},
    )  # fmt: skip
    presented: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(2)

    def step(data: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        with lock:
            presented.append(data["refresh_token"])
            n = len(presented)
        threading.Event().wait(0.3)  # the token endpoint's call
        return "ok", {**data, "refresh_token": f"refresh-{n}"}

    def worker(s: Store) -> None:
        start.wait(5)
        with contextlib.suppress(Conflict):
            s.exchange_credential("rt", fingerprint, step, hold=5)

    threads = [threading.Thread(target=worker, args=(s,)) for s in (store, open_store(key))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    twice = len(presented) != len(set(presented))
    assert not twice, "one refresh token was presented twice"
    assert len(presented) == 2


# -- secrets held elsewhere ----------------------------------------------------------------


def test_a_reference_is_stored_in_place_of_a_sealed_secret(store: Store) -> None:
    assert (
        store.add_credential(
            "gh", "bearer", ["api.github.com"], None, secret_ref="file:/run/secrets/gh"
        )
        == "file:/run/secrets/gh"
    )
    (listed,) = store.list_credentials()
    assert (listed.secret_ref, listed.fingerprint) == ("file:/run/secrets/gh", "")
    row: Any = read_row(store, Credential, "gh")
    assert (row.key_id, row.nonce, row.ciphertext) == (None, None, None)
    snapshot = store.snapshot()
    record = snapshot.credentials["gh"]
    # The store holds no secret for it: nothing the proxy could stamp until it resolves one.
    assert (record.secret_ref, record.available, snapshot.unreadable) == (
        "file:/run/secrets/gh",
        False,
        (),
    )


def test_rotate_moves_a_credential_between_sealed_and_referenced(
    store: Store, key: MasterKey
) -> None:
    seed(store)
    assert store.rotate_credential("gh", None, "vault:secret/gh#token") == "vault:secret/gh#token"
    row: Any = read_row(store, Credential, "gh")
    assert (row.ciphertext, row.secret_ref) == (None, "vault:secret/gh#token")
    fp = store.rotate_credential("gh", Secret(b"sealed-again"))
    row = read_row(store, Credential, "gh")
    assert (row.secret_ref, row.fingerprint) == (None, fp)
    assert store.snapshot().credentials["gh"].available


@pytest.mark.parametrize(
    ("scheme", "ref", "reason"),
    [
        pytest.param("bearer", "gh-token-pasted", "starts with file:", id="a reference parses"),
        pytest.param(
            "oauth2-refresh",
            "file:/run/secrets/tokens",
            "cannot hold a secret reference",
            id="a refresh-token credential is sealed",
        ),
    ],
)
def test_a_reference_that_does_not_parse_is_refused(
    store: Store, scheme: str, ref: str, reason: str
) -> None:
    options = {"token_url": "https://auth.example/token"} if scheme == "oauth2-refresh" else {}
    with pytest.raises(InvalidInput, match=reason):
        store.add_credential(
            "gh", scheme, ["api.github.com"], None, options=options, secret_ref=ref
        )
    assert store.list_credentials() == []


def test_a_master_key_rotation_keeps_references_readable(
    store: Store, open_store: Callable[[MasterKey | None], Store]
) -> None:
    seed(store)
    store.add_credential("ref", "bearer", ["example.com"], None, secret_ref="file:/run/s")
    new = MasterKey.generate("new")
    assert store.rotate_key(new) == 1
    snapshot = open_store(new).snapshot()
    assert snapshot.credentials["ref"].secret_ref == "file:/run/s" and not snapshot.unreadable


def test_a_reference_written_without_the_master_key_is_never_read(store: Store) -> None:
    """Whoever can write the database but has no key must not point a credential at a file
    of the proxy's own (its master key, its CA key): such a row is unreadable."""
    store.add_credential("ref", "bearer", ["example.com"], None, secret_ref="file:/run/s")
    with store.engine.begin() as connection:
        connection.execute(
            update(Credential)
            .where(Credential.name == "ref")
            .values(secret_ref="file:/etc/credproxy/credproxy.key")
        )
    snapshot = store.snapshot()
    assert "ref" not in snapshot.credentials and snapshot.unreadable == ("ref",)
