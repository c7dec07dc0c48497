"""The grants table: what a grant may name, revocation, and once-grants used exactly once."""

import threading
from collections.abc import Callable
from datetime import timedelta

import pytest
from sqlalchemy import update

from store.crypto import MasterKey
from store.db.models import Grant, utcnow
from store.errors import InvalidInput, NotFound
from store.repository import Store
from store.rules import validation
from store.rules.grammar import HostPattern
from tests.stores import SECRET, grant_state, seed

# -- grants ----------------------------------------------------------------------------


def test_grant_defaults_to_the_credentials_hosts_and_the_root_path(store: Store) -> None:
    grant_id = seed(store)
    (grant,) = store.list_grants()
    assert grant.id == grant_id
    assert (grant.hosts, grant.methods, grant.paths) == (None, ["GET"], ["/"])
    assert (grant.once, grant.websocket, grant.state) == (False, False, "active")


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
            {"credential": "gh", "hosts": ["evil.example"]},
            InvalidInput,
            "outside",
            id="host outside the credential's hosts",
        ),
        pytest.param(
            {"credential": "gh", "hosts": ["api.github.com:8443"]},
            InvalidInput,
            "outside",
            id="credential host on another port",
        ),
        pytest.param(
            {"credential": "gh", "hosts": ["*.github.com"]},
            InvalidInput,
            "outside",
            id="wildcard wider than the credential's host",
        ),
        pytest.param({}, InvalidInput, "needs at least one host", id="no credential and no host"),
        pytest.param(
            {"principal": "ghost", "credential": "gh"}, NotFound, "ghost", id="unknown principal"
        ),
        pytest.param({"credential": "nope"}, NotFound, "nope", id="unknown credential"),
        pytest.param(
            {"credential": "gh", "expires_at": utcnow() - timedelta(seconds=1)},
            InvalidInput,
            "past",
            id="expiry in the past",
        ),
        pytest.param(
            {"credential": "gh", "methods": []}, InvalidInput, "at least one method", id="no method"
        ),
        pytest.param(
            {"credential": "gh", "methods": ["*", "GET"]},
            InvalidInput,
            "every method",
            id="star with another method",
        ),
        pytest.param(
            {"hosts": ["*.com"]},
            InvalidInput,
            "public suffix",
            id="host-only grant over *.com",
        ),
        pytest.param(
            {"credential": "gh", "paths": ["/@s%2Fn"], "encoded_slash": True},
            InvalidInput,
            "no path has one",
            id="encoded_slash without a star path",
        ),
        pytest.param(
            {"credential": "gh", "paths": ["/a%2F..%2Fb"]},
            InvalidInput,
            "between two names",
            id="a dot-dot part beside an encoded slash",
        ),
    ],
)
def test_bad_grant_is_refused_and_changes_nothing(
    store: Store, kwargs: dict[str, object], error: type[Exception], reason: str
) -> None:
    seed(store)
    before = (store.list_grants(), store.change_counter())
    kwargs = {"principal": "agent", "methods": ["GET"], **kwargs}
    with pytest.raises(error, match=reason):
        store.add_grant(**kwargs)  # type: ignore[arg-type]
    assert (store.list_grants(), store.change_counter()) == before


def test_encoded_slash_is_stored_listed_and_read_into_the_snapshot(store: Store) -> None:
    plain = seed(store)
    opted = store.add_grant(
        "agent", ["GET"], credential="gh", paths=["/@s%2fn", "/r/*/x"], encoded_slash=True
    )
    listed = {g.id: (g.paths, g.encoded_slash) for g in store.list_grants()}
    assert listed == {plain: (["/"], False), opted: (["/@s%2Fn", "/r/*/x"], True)}
    read = {g.id: (g.paths, g.encoded_slash) for g in store.snapshot().grants}
    assert read == {plain: (("/",), False), opted: (("/@s%2Fn", "/r/*/x"), True)}


def test_revoking_an_unknown_grant_is_not_found(store: Store) -> None:
    with pytest.raises(NotFound, match="no grant with id 999"):
        store.revoke_grant(999)


# -- once-grants -----------------------------------------------------------------------


def _once_grant(store: Store, **kwargs: object) -> int:
    store.add_principal("agent")
    store.add_credential("gh", "bearer", ["api.github.com"], SECRET)
    return store.add_grant("agent", ["POST"], credential="gh", once=True, **kwargs)  # type: ignore[arg-type]


def test_once_grant_is_consumed_exactly_once(store: Store) -> None:
    grant_id = _once_grant(store)
    assert store.consume_once(grant_id) is True
    assert store.consume_once(grant_id) is False
    assert grant_state(store, grant_id) == "consumed"
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
    assert grant_state(store, grant_id) == "expired"


def test_ordinary_grant_is_not_consumed(store: Store) -> None:
    grant_id = seed(store)
    assert store.consume_once(grant_id) is False
    assert grant_state(store, grant_id) == "active"


def test_concurrent_replicas_consume_a_once_grant_exactly_once(
    store: Store, key: MasterKey, open_store: Callable[[MasterKey | None], Store]
) -> None:
    grant_id = _once_grant(store)
    counter = store.change_counter()
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
    # One change for every replica to apply: the 15 that lost changed nothing.
    assert store.change_counter() == counter + 1


# -- use counts and rates ------------------------------------------------------------------


def _counted_grant(store: Store, uses: int) -> int:
    store.add_principal("agent")
    store.add_credential("gh", "bearer", ["api.github.com"], SECRET)
    return store.add_grant(
        "agent", ["GET"], credential="gh", limits=validation.limits("60/m", 5, uses)
    )


def test_a_use_counted_grant_lets_exactly_its_uses_through_then_reads_consumed(
    store: Store,
) -> None:
    grant_id = _counted_grant(store, 3)
    counter = store.change_counter()
    assert [store.use_grant(grant_id) for _ in range(5)] == [True, True, True, False, False]
    # Only the last use is a change every proxy must see.
    assert store.change_counter() == counter + 1
    (entry,) = store.list_grants()
    assert (entry.uses, entry.max_uses, entry.state) == (3, 3, "consumed")
    assert (entry.rate, entry.burst) == ("60/m", 5)
    (record,) = store.snapshot().grants
    assert (record.consumed, record.max_uses, record.rate and record.rate.text) == (
        True,
        3,
        "60/m",
    )


def test_concurrent_replicas_spend_exactly_max_uses(
    store: Store, key: MasterKey, open_store: Callable[[MasterKey | None], Store]
) -> None:
    grant_id = _counted_grant(store, 5)
    replicas = [open_store(key) for _ in range(4)]
    start = threading.Barrier(32)

    def use(i: int) -> bool:
        start.wait()
        return replicas[i % 4].use_grant(grant_id)

    threads_results: list[bool] = []
    threads = [
        threading.Thread(target=lambda i=i: threads_results.append(use(i))) for i in range(32)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert threads_results.count(True) == 5


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(("10/w", None, None, False), "invalid rate '10/w'", id="an unknown unit"),
        pytest.param(("0/s", None, None, False), "invalid rate '0/s'", id="a zero rate"),
        pytest.param((None, 5, None, False), "a burst goes with a rate", id="burst alone"),
        pytest.param((None, None, 2, True), "once is max-uses 1", id="once and max-uses"),
    ],
)
def test_bad_limits_are_refused(args: tuple, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(InvalidInput, match=message):
        validation.limits(*args)


def test_a_principal_limit_reaches_the_snapshot_and_can_be_cleared(store: Store) -> None:
    store.add_principal("agent", validation.limits("600/m", 20))
    (entry,) = store.list_principals()
    assert (entry.rate, entry.burst) == ("600/m", 20)
    rate, burst = store.snapshot().principal_limits["agent"]
    assert (rate.count, rate.period, burst) == (600, 60.0, 20)
    store.set_principal_limits("agent", validation.NO_LIMITS)
    assert store.snapshot().principal_limits == {}
