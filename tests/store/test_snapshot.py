"""The proxy's snapshot: live records, tombstones, and rows it refuses to read."""

from collections.abc import Callable
from datetime import timedelta

import pytest
from sqlalchemy import null, update

from addon.core.policy import Policy, Request
from addon.core.reasons import Reason
from store.crypto import MasterKey, Secret
from store.db.models import Credential, Grant, utcnow
from store.errors import InvalidInput
from store.records import TOMBSTONE_RETENTION
from store.repository import Store
from store.rules.grammar import HostPattern
from tests.stores import SECRET, read_row, seed

# -- the proxy's snapshot --------------------------------------------------------------


def test_snapshot_holds_live_records_with_open_secrets(store: Store) -> None:
    live = seed(store)
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
    recent, old = seed(store), store.add_grant("agent", ["POST"], credential="gh")
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
    grant_id = seed(store)
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
    grant_id = seed(store)
    with store.engine.begin() as conn:
        conn.execute(update(Grant).where(Grant.id == grant_id).values({column: value}))
    with pytest.raises(InvalidInput, match="invalid host"):
        store.snapshot()


def test_tampered_ciphertext_is_reported_unreadable_and_its_grants_dropped(
    store: Store,
) -> None:
    seed(store)
    store.add_credential("pypi", "bearer", ["upload.pypi.org"], Secret(b"pypi-token"))
    pypi_grant = store.add_grant("agent", ["POST"], credential="pypi")
    row = read_row(store, Credential, "gh")
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
    source = read_row(store, Credential, "gh")
    with store.engine.begin() as conn:
        conn.execute(
            update(Credential)
            .where(Credential.name == "evil")
            .values(nonce=source.nonce, ciphertext=source.ciphertext)
        )
    snap = store.snapshot()
    assert snap.unreadable == ("evil",)
    assert "evil" not in snap.credentials


def test_a_change_committed_between_the_snapshots_selects_is_never_half_seen(
    store: Store, key: MasterKey, open_store: Callable[[MasterKey | None], Store]
) -> None:
    """A write landing mid-read: the snapshot is the state at its counter (here the old one,
    read in one transaction), never a mix of both; the next read is the new one."""
    from sqlalchemy import event

    store.add_principal("agent")
    store.add_principal("intern")
    store.add_credential("prod", "bearer", ["api.x.com", "admin.x.com"], SECRET)
    store.add_grant("agent", ["GET"], credential="prod")
    other = open_store(key)
    fired: list[bool] = []

    def between(conn, cursor, statement, *args) -> None:  # type: ignore[no-untyped-def]
        if not fired and "FROM credentials" in statement:
            fired.append(True)
            # Another shell, meanwhile: the credential narrowed, the grant moved to intern.
            other.remove_credential("prod")
            other.add_credential("prod", "bearer", ["api.x.com"], SECRET)
            other.add_grant("intern", ["GET"], credential="prod")

    counter = store.change_counter()
    event.listen(store.engine, "after_cursor_execute", between)
    try:
        snapshot = store.snapshot()
    finally:
        event.remove(store.engine, "after_cursor_execute", between)
    assert fired
    assert snapshot.counter == counter < store.change_counter()
    assert [(g.principal, [str(h) for h in g.hosts]) for g in snapshot.grants] == [
        ("agent", ["admin.x.com", "api.x.com"])
    ]
    after = store.snapshot()
    assert [(g.principal, [str(h) for h in g.hosts]) for g in after.grants] == [
        ("intern", ["api.x.com"])
    ]
