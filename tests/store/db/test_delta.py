"""Changes read from the change log and applied to a Policy give what a full reload gives."""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import delete, select, update

from addon.core.policy import Policy, Request
from addon.core.reasons import Reason
from addon.schemes.stamping import stamp_for
from store.crypto import MasterKey, Secret
from store.db import changelog, engine
from store.db.models import ChangeLog, Credential, Grant, StoreState, utcnow
from store.errors import CredproxyError
from store.repository import Store
from store.rules.validation import Limits
from tests.stores import SECRET, read_row, seed


def view(policy: Policy) -> dict[str, Any]:
    """Everything a Policy decides with, in a form two policies can be compared by."""
    principals = policy._principals
    return {
        "counter": policy.counter,
        "key_id": policy.key_id,
        "tokens": policy._tokens,
        "principal_ids": policy._principal_names,
        "principal_by_name": policy._principal_ids,
        "limits": policy._limits,
        "sessions": {name: found for name, found in policy._sessions.items() if found},
        "session_owner": policy._session_owner,
        "credentials": policy._credentials,
        "credential_ids": policy._credential_names,
        "unreadable": policy.unreadable,
        "path_secrets": sorted(s.reveal() for s in policy.path_secrets),
        "owner": policy._owner,
        "rules": {name: p.rules for name, p in principals.items()},
        "exact": {name: _index(p.exact) for name, p in principals.items()},
        "wildcard": {name: _index(p.wildcard) for name, p in principals.items()},
        "coverage": {gid: found for gid, found in policy._coverage.items() if found},
    }


def _index(index: dict[str, list[Any]]) -> dict[str, list[int]]:
    return {host: sorted(r.grant_id for r in rules) for host, rules in index.items() if rules}


def caught_up(store: Store, policy: Policy) -> Policy:
    """`policy` with the store's changes since its counter applied, as the proxy does."""
    delta = store.delta(policy.counter)
    assert delta is not None, "the change log could not say what changed"
    policy.apply(delta)
    return policy


# -- random sequences of changes ---------------------------------------------------------

PRINCIPALS = ("agent", "intern", "ci")
CREDENTIALS = ("gh", "pypi", "bot")
HOSTS = ("api.github.com", "*.pypi.org", "api.telegram.org")
PATH_OPTIONS = {"placeholder": "PLACEHOLDER_1", "position": ["/bot{}"]}


def _add_credential(store: Store, name: str, secret: bytes) -> None:
    if name == "bot":
        store.add_credential(
            name, "path", [HOSTS[2]], Secret(secret.hex().encode()), options=PATH_OPTIONS
        )
    else:
        hosts = [HOSTS[CREDENTIALS.index(name)]]
        store.add_credential(name, "bearer", hosts, _sealed(name, secret))


def _sealed(name: str, secret: bytes) -> Secret:
    """pypi's secret is JSON, as a refreshed credential's is (credential exchange)."""
    return Secret(b'{"r":"%s"}' % secret if name == "pypi" else secret)


def _grant_ids(store: Store) -> list[int]:
    return [g.id for g in store.list_grants()]


def _token_ids(store: Store) -> list[int]:
    return [t.id for t in store.list_tokens()]


def _apply_op(store: Store, op: tuple[Any, ...]) -> None:
    kind, *args = op
    if kind == "principal":
        store.add_principal(args[0], Limits("60/m", 5) if args[1] else Limits())
    elif kind == "remove_principal":
        store.remove_principal(args[0])
    elif kind == "limits":
        store.set_principal_limits(args[0], Limits("10/s") if args[1] else Limits())
    elif kind == "token":
        expires = utcnow() + timedelta(hours=1) if args[1] else None
        store.add_token(args[0], expires)
    elif kind == "revoke_token":
        ids = _token_ids(store)
        if ids:
            store.revoke_token(ids[args[0] % len(ids)])
    elif kind == "credential":
        _add_credential(store, args[0], args[1])
    elif kind == "rotate":
        if args[0] == "bot":
            store.rotate_credential(args[0], Secret(args[1].hex().encode()))
        else:
            store.rotate_credential(args[0], _sealed(args[0], args[1]))
    elif kind == "remove_credential":
        store.remove_credential(args[0])
    elif kind == "grant":
        principal, credential, mode, expiry = args
        expires = utcnow() + timedelta(hours=1) if expiry == "future" else None
        hosts = [] if credential else ["pypi.org"]
        store.add_grant(
            principal,
            ["GET"],
            credential=credential,
            hosts=hosts,
            paths=["/v1/"],
            once=mode == "once",
            expires_at=expires,
            limits=Limits(max_uses=2) if mode == "uses" else Limits(),
        )
    elif kind in ("revoke", "consume", "use"):
        ids = _grant_ids(store)
        if ids:
            grant_id = ids[args[0] % len(ids)]
            {"revoke": store.revoke_grant, "consume": store.consume_once, "use": store.use_grant}[
                kind
            ](grant_id)
    elif kind == "hold":
        principal, decision = args
        first = [g for g in store.list_grants(principal) if g.approval == "first"]
        if not first:
            store.add_grant(
                principal, ["GET"], hosts=["pypi.org"], limits=Limits(approval="first", hold=60)
            )
            return
        grant = first[-1]
        held, _ = store.hold_request(principal, grant.id, "pypi.org", 443, "GET", "/x", 60, True)
        if decision == "deny":
            store.deny_access_request(held)
        else:
            store.approve_request(held, next_uses=2 if decision == "counted" else None)
    elif kind == "use_approval":
        counted = [r.id for r in store.list_access_requests() if r.cover_uses is not None]
        if counted:
            store.use_approval(counted[args[0] % len(counted)])
    elif kind == "exchange":
        (found,) = [c for c in store.list_credentials() if c.name == "pypi"] or [None]
        if found is not None:
            sealed = {"n": args[1].decode()} if args[2] else None
            store.exchange_credential("pypi", found.fingerprint, lambda data: (0, sealed))
    elif kind == "request":
        found = store.record_access_request(args[0], "api.github.com", 443, "GET", "/v1/x")
        if found is not None and args[1]:
            store.approve_access_request(found[0], credential="gh", once=True)
        elif found is not None:
            store.deny_access_request(found[0])


_principal = st.sampled_from(PRINCIPALS)
_credential = st.sampled_from(CREDENTIALS)
_secret = st.text(string.ascii_letters + string.digits, min_size=12, max_size=16).map(str.encode)
OPS = st.one_of(
    st.tuples(st.just("principal"), _principal, st.booleans()),
    st.tuples(st.just("remove_principal"), _principal),
    st.tuples(st.just("limits"), _principal, st.booleans()),
    st.tuples(st.just("token"), _principal, st.booleans()),
    st.tuples(st.just("revoke_token"), st.integers(0, 20)),
    st.tuples(st.just("credential"), _credential, _secret),
    st.tuples(st.just("rotate"), _credential, _secret),
    st.tuples(st.just("remove_credential"), _credential),
    st.tuples(
        st.just("grant"),
        _principal,
        st.one_of(st.none(), _credential),
        st.sampled_from(["standing", "once", "uses"]),
        st.sampled_from(["none", "future"]),
    ),
    st.tuples(st.sampled_from(["revoke", "consume", "use"]), st.integers(0, 40)),
    st.tuples(st.just("request"), _principal, st.booleans()),
    st.tuples(st.just("hold"), _principal, st.sampled_from(["approve", "counted", "deny"])),
    st.tuples(st.just("use_approval"), st.integers(0, 10)),
    st.tuples(st.just("exchange"), st.just("pypi"), _secret, st.booleans()),
)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(batches=st.lists(st.lists(OPS, min_size=1, max_size=6), min_size=1, max_size=4))
def test_changes_applied_one_delta_at_a_time_equal_a_full_reload(
    store: Store, batches: list[list[tuple[Any, ...]]]
) -> None:
    policy = Policy(store.snapshot())
    for batch in batches:
        for op in batch:
            try:
                _apply_op(store, op)
            except CredproxyError:
                pass  # an op the store refuses (no such principal, ...) changes nothing
        caught_up(store, policy)
        assert view(policy) == view(Policy(store.snapshot()))


# -- single changes, and when the log cannot say ---------------------------------------------


def test_a_once_use_is_applied_as_one_grant(store: Store) -> None:
    store.add_principal("agent")
    store.add_credential("gh", "bearer", ["api.github.com"], SECRET)
    once = store.add_grant("agent", ["GET"], credential="gh", paths=["/once/"], once=True)
    policy = Policy(store.snapshot())
    rules_before = policy._principals["agent"]
    assert store.consume_once(once)
    delta = store.delta(policy.counter)
    assert delta is not None
    assert (delta.changes, list(delta.grants), delta.principals) == (1, [once], {})
    policy.apply(delta)
    # The principal got new rules; the old object is as a request in flight saw it.
    assert policy._principals["agent"] is not rules_before
    assert not rules_before.rules[once].consumed
    request = Request("api.github.com", 443, "https", "GET", "/once/x")
    assert policy.decide("agent", request, utcnow()).reason == Reason.GRANT_CONSUMED


def test_expiry_needs_no_change(store: Store) -> None:
    store.add_principal("agent")
    store.add_credential("gh", "bearer", ["api.github.com"], SECRET)
    soon = utcnow() + timedelta(minutes=5)
    store.add_grant("agent", ["GET"], credential="gh", paths=["/soon/"], expires_at=soon)
    policy = caught_up(store, Policy(store.snapshot()))
    request = Request("api.github.com", 443, "https", "GET", "/soon/x")
    assert policy.decide("agent", request, utcnow()).allowed
    later = soon + timedelta(seconds=1)
    assert policy.decide("agent", request, later).reason == Reason.GRANT_EXPIRED


def test_rotation_reaches_every_grant_of_the_credential_and_its_stamp(store: Store) -> None:
    seed(store)
    store.add_principal("intern")
    store.add_grant("intern", ["GET"], credential="gh")
    policy = Policy(store.snapshot())
    old = policy._credentials["gh"]
    old_stamp = stamp_for(policy, old)
    request = Request("api.github.com", 443, "https", "GET", "/")
    assert policy.decide("agent", request, utcnow()).rule.credential is old  # type: ignore[union-attr]
    store.rotate_credential("gh", Secret(b"ghp_rotated0123456789"))
    caught_up(store, policy)
    new = policy._credentials["gh"]
    decided = policy.decide("agent", request, utcnow()).rule
    assert decided is not None and decided.credential is new
    assert new.secret == Secret(b"ghp_rotated0123456789")
    for name in ("agent", "intern"):
        (rule,) = policy._principals[name].rules.values()
        assert rule.credential is new
    assert stamp_for(policy, new).secret == b"ghp_rotated0123456789"
    # A request decided before the rotation still stamps what it was decided with.
    assert stamp_for(policy, old).secret == old_stamp.secret == SECRET.reveal()


def test_revocation_and_removal_drop_rules_and_tokens(store: Store) -> None:
    grant = seed(store)
    store.add_token("agent", None)
    policy = Policy(store.snapshot())
    store.revoke_grant(grant)
    caught_up(store, policy)
    assert "agent" not in policy._principals
    store.add_grant("agent", ["GET"], credential="gh")
    store.remove_principal("agent")
    caught_up(store, policy)
    assert view(policy) == view(Policy(store.snapshot()))
    assert list(policy.principals()) == [] and policy._sessions == {}


def test_an_unreadable_credential_is_named_and_its_grants_dropped(store: Store) -> None:
    seed(store)
    policy = Policy(store.snapshot())
    row = read_row(store, Credential, "gh")
    with store.db.change() as session:  # a tampered row, logged as a change to it
        session.execute(
            engine.covered(
                update(Credential)
                .where(Credential.id == row.id)
                .values(ciphertext=bytes([row.ciphertext[0] ^ 1]) + row.ciphertext[1:])
            )
        )
        engine.changed(session, changelog.CREDENTIAL, row.id)
    caught_up(store, policy)
    assert policy.unreadable == ("gh",) and policy.grant_count == 0
    assert view(policy) == view(Policy(store.snapshot()))


@pytest.mark.parametrize(
    "hole",
    [
        pytest.param(delete(ChangeLog), id="a log pruned past the counter"),
        pytest.param(update(ChangeLog).values(kind="all"), id="a change logged as ALL"),
        pytest.param(
            update(StoreState).values(change_counter=StoreState.change_counter + 1),
            id="a counter moved with nothing logged",
        ),
    ],
)
def test_when_the_log_cannot_say_the_delta_is_none(store: Store, hole: Any) -> None:
    seed(store)
    counter = store.change_counter()
    store.add_grant("agent", ["POST"], credential="gh")
    assert store.delta(counter) is not None
    with store.engine.begin() as connection:
        connection.execute(hole)
    assert store.delta(counter) is None


def test_a_write_that_notes_nothing_is_logged_as_all(store: Store) -> None:
    seed(store)
    counter = store.change_counter()
    with store.db.change() as session:
        session.execute(update(Grant).values(paths=["/elsewhere/"]))
    assert store.delta(counter) is None
    with store.db.reading() as connection:
        rows = connection.execute(ChangeLog.__table__.select()).all()
    assert (counter + 1, "all", 0) in [tuple(r) for r in rows]


def test_the_log_is_pruned_to_what_a_replica_may_still_need(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(changelog, "LOG_KEPT", 3)
    monkeypatch.setattr(changelog, "PRUNE_EVERY", 2)
    store.add_principal("agent")
    for _ in range(6):
        store.add_grant("agent", ["GET"], hosts=["pypi.org"])
    counter = store.change_counter()
    with store.db.reading() as connection:
        kept = sorted({r.counter for r in connection.execute(ChangeLog.__table__.select())})
    assert kept[0] > counter - 4 and kept[-1] == counter
    assert store.delta(1) is None  # too far behind: a full reload
    assert store.delta(counter - 2) is not None


def test_the_master_key_rotated_is_a_full_reload(store: Store) -> None:
    seed(store)
    counter = store.change_counter()
    store.rotate_key(MasterKey.generate("new"))
    assert store.delta(counter) is None


def test_a_change_committed_during_the_delta_read_is_never_half_seen(
    store: Store, key: MasterKey, open_store: Callable[[MasterKey | None], Store]
) -> None:
    """As the full read: a write landing between the delta's SELECTs is not half seen."""
    from sqlalchemy import event

    store.add_principal("agent")
    store.add_principal("intern")
    store.add_credential("prod", "bearer", ["api.x.com", "admin.x.com"], SECRET)
    policy = Policy(store.snapshot())
    store.add_grant("agent", ["GET"], credential="prod")
    other = open_store(key)
    fired: list[bool] = []

    def between(conn, cursor, statement, *args) -> None:  # type: ignore[no-untyped-def]
        if not fired and "FROM grants" in statement:
            fired.append(True)
            # Another shell, meanwhile: the credential narrowed, the grant moved to intern.
            other.remove_credential("prod")
            other.add_credential("prod", "bearer", ["api.x.com"], SECRET)
            other.add_grant("intern", ["GET"], credential="prod")

    event.listen(store.engine, "after_cursor_execute", between)
    try:
        caught_up(store, policy)
    finally:
        event.remove(store.engine, "after_cursor_execute", between)
    assert fired
    # The state at the delta's counter, whole: the grant to agent; the rest comes next.
    assert policy.counter < store.change_counter()
    assert list(policy._principals) == ["agent"]
    (rule,) = policy._principals["agent"].rules.values()
    assert rule.credential is not None and len(rule.credential.hosts) == 2
    caught_up(store, policy)
    assert view(policy) == view(Policy(store.snapshot()))
    assert list(policy._principals) == ["intern"]


def test_a_name_removed_and_added_again_in_one_delta_is_the_new_row(store: Store) -> None:
    seed(store)
    store.add_token("agent", None)
    policy = Policy(store.snapshot())
    store.remove_principal("agent")
    store.remove_credential("gh")
    store.add_principal("agent")
    store.add_credential("gh", "bearer", ["api.github.com"], Secret(b"ghp_second0123456789"))
    store.add_grant("agent", ["POST"], credential="gh")
    caught_up(store, policy)
    assert view(policy) == view(Policy(store.snapshot()))
    (rule,) = policy._principals["agent"].rules.values()
    assert rule.methods == frozenset({"POST"}) and rule.credential is not None
    assert rule.credential.secret == Secret(b"ghp_second0123456789")
    assert policy._sessions == {}


def test_more_rows_than_a_full_read_costs_is_a_full_read(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    from store.db import delta

    seed(store)
    counter = store.change_counter()
    store.add_grant("agent", ["POST"], credential="gh")
    store.add_grant("agent", ["PUT"], credential="gh")
    monkeypatch.setattr(delta, "MAX_ROWS", 1)
    assert store.delta(counter) is None
    monkeypatch.setattr(delta, "MAX_ROWS", 2)
    assert store.delta(counter) is not None


# -- writes that note the wrong rows ---------------------------------------------------------
# Whatever a write notes, the rows it wrote reach the replicas: an ORM row written is noted
# as its kind, and a bulk UPDATE or DELETE of a table the proxy reads is logged as ALL unless
# the write vouches that its notes cover it (engine.covered).


def _wrong_note_orm(store: Store, grant: int, token: int) -> None:
    with store.db.change() as session:
        row = session.get(Grant, grant)
        assert row is not None
        row.paths = ["/elsewhere/"]  # the grant narrowed, the token noted
        engine.changed(session, changelog.TOKEN, token)


def _wrong_note_bulk(store: Store, grant: int, token: int) -> None:
    with store.db.change() as session:
        session.execute(update(Grant).values(revoked_at=utcnow()))  # every grant revoked
        engine.changed(session, changelog.GRANT, grant + 1)  # one of them noted


def _wrong_kind(store: Store, grant: int, token: int) -> None:
    with store.db.change() as session:
        row = session.get(Grant, grant)
        assert row is not None
        row.methods = ["DELETE"]
        engine.changed(session, changelog.TOKEN, 999)  # a token's kind, and no such token


def _credential_unnoted(store: Store, grant: int, token: int) -> None:
    with store.db.change() as session:
        row = session.scalars(select(Credential).where(Credential.name == "gh")).one()
        row.removed_at = utcnow()  # removed by hand; a grant noted instead
        engine.changed(session, changelog.GRANT, grant)


@pytest.mark.parametrize(
    "write",
    [
        pytest.param(_wrong_note_orm, id="an ORM row written, another kind noted"),
        pytest.param(_wrong_note_bulk, id="a bulk UPDATE, one row noted"),
        pytest.param(_wrong_kind, id="a grant written, noted as a token"),
        pytest.param(_credential_unnoted, id="a credential written, its grant noted"),
    ],
)
def test_a_write_that_notes_the_wrong_rows_never_leaves_a_replica_stale(
    store: Store, write: Callable[[Store, int, int], None]
) -> None:
    grant = seed(store)
    store.add_grant("agent", ["POST"], credential="gh")
    token, _ = store.add_token("agent", None)
    policy = Policy(store.snapshot())
    write(store, grant, token)
    delta = store.delta(policy.counter)
    if delta is not None:
        policy.apply(delta)
    else:
        policy = Policy(store.snapshot())
    assert view(policy) == view(Policy(store.snapshot()))


# -- writes that used to be read whole by every replica ---------------------------------------


def test_approvals_of_held_requests_and_their_last_counted_use_are_deltas(store: Store) -> None:
    store.add_principal("agent")
    grant = store.add_grant(
        "agent", ["GET"], hosts=["pypi.org"], limits=Limits(approval="first", hold=60)
    )
    policy = Policy(store.snapshot())
    held, _ = store.hold_request("agent", grant, "pypi.org", 443, "GET", "/x", 60, True)
    store.approve_request(held, next_uses=2)
    delta = store.delta(policy.counter)
    assert delta is not None and delta.decisions and delta.coverage is not None
    policy.apply(delta)
    assert policy.covering(grant, "GET", "pypi.org", 443, "/x", utcnow()) is not None
    assert store.use_approval(held) and store.use_approval(held)  # the last one: a change
    caught_up(store, policy)
    assert policy.covering(grant, "GET", "pypi.org", 443, "/x", utcnow()) is None
    assert view(policy) == view(Policy(store.snapshot()))


def test_an_exchange_is_a_change_to_its_credential_only_when_it_seals_back(store: Store) -> None:
    store.add_principal("agent")
    fingerprint = store.add_credential("j", "bearer", ["api.x.com"], Secret(b'{"r":"one"}'))
    store.add_grant("agent", ["GET"], credential="j")
    policy = Policy(store.snapshot())
    counter = store.change_counter()
    assert store.exchange_credential("j", fingerprint, lambda data: (1, None)) == 1
    assert store.change_counter() == counter  # nothing sealed: nothing for the replicas
    store.exchange_credential("j", fingerprint, lambda data: (2, {"r": "two"}))
    delta = store.delta(policy.counter)
    assert delta is not None and list(delta.credentials) == [1]
    policy.apply(delta)
    assert policy._credentials["j"].secret == Secret(b'{"r":"two"}')
    assert view(policy) == view(Policy(store.snapshot()))


def test_a_change_rebuilds_only_the_index_entries_it_touches() -> None:
    """A principal with many grants: one grant's change costs in proportion to it, the other
    entries of the principal's index are shared (never copied, never changed)."""
    import dataclasses

    from store.records import Delta, GrantRecord, Snapshot
    from store.rules.grammar import parse_host

    grants = tuple(
        GrantRecord(
            gid,
            "agent",
            None,
            (parse_host(f"h{gid % 50}.example.com"), parse_host("*.x.org")),
            frozenset({"GET"}),
            ("/",),
            True,
            False,
            None,
        )
        for gid in range(1, 501)
    )
    snapshot = Snapshot(1, "k", {"agent": "0" * 64}, {}, grants, (), principal_ids={1: "agent"})
    policy = Policy(snapshot)
    before = policy._principals["agent"]
    consumed = dataclasses.replace(grants[6], consumed=True)  # on h7.example.com and *.x.org
    added = dataclasses.replace(grants[0], id=501, hosts=(parse_host("new.example.com"),))
    policy.apply(Delta(2, "k", 2, {}, {}, {}, {consumed.id: consumed, added.id: added, 3: None}))
    after = policy._principals["agent"]
    assert after is not before and not before.rules[7].consumed  # a decision's copy stands
    assert after.rules[7].consumed and 3 not in after.rules and 501 in after.rules
    touched = {"h7.example.com", "h3.example.com", "new.example.com"}
    for host, rules in after.exact.items():
        assert (rules is before.exact.get(host)) is (host not in touched), host
    assert after.wildcard[".x.org"] is not before.wildcard[".x.org"]
    assert view(policy) == view(
        Policy(
            dataclasses.replace(
                snapshot,
                counter=2,
                grants=(*grants[:2], *grants[3:6], consumed, *grants[7:], added),
            )
        )
    )


def _random_op(rng: random.Random) -> tuple[Any, ...]:
    kind = rng.choice(
        ["principal", "remove_principal", "limits", "token", "revoke_token", "credential"]
        + ["rotate", "remove_credential", "grant", "grant", "grant", "revoke", "consume"]
        + ["use", "request", "hold", "use_approval", "exchange"]
    )
    secret = "".join(rng.choices(string.ascii_letters, k=14)).encode()
    return {
        "principal": (kind, rng.choice(PRINCIPALS), rng.random() < 0.5),
        "remove_principal": (kind, rng.choice(PRINCIPALS)),
        "limits": (kind, rng.choice(PRINCIPALS), rng.random() < 0.5),
        "token": (kind, rng.choice(PRINCIPALS), rng.random() < 0.5),
        "revoke_token": (kind, rng.randrange(20)),
        "credential": (kind, rng.choice(CREDENTIALS), secret),
        "rotate": (kind, rng.choice(CREDENTIALS), secret),
        "remove_credential": (kind, rng.choice(CREDENTIALS)),
        "grant": (
            kind,
            rng.choice(PRINCIPALS),
            rng.choice([None, *CREDENTIALS]),
            rng.choice(["standing", "once", "uses"]),
            rng.choice(["none", "future"]),
        ),
        "revoke": (kind, rng.randrange(40)),
        "consume": (kind, rng.randrange(40)),
        "use": (kind, rng.randrange(40)),
        "request": (kind, rng.choice(PRINCIPALS), rng.random() < 0.5),
        "hold": (kind, rng.choice(PRINCIPALS), rng.choice(["approve", "counted", "deny"])),
        "use_approval": (kind, rng.randrange(10)),
        "exchange": (kind, "pypi", secret, rng.random() < 0.5),
    }[kind]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_deltas_read_while_another_replica_writes_add_up_to_a_full_reload(
    store: Store, key: MasterKey, open_store: Callable[[MasterKey | None], Store], seed: int
) -> None:
    """Real interleavings: one thread writes, a replica reads deltas (or the whole store,
    when the log cannot say) as fast as it can; once the writes stop and it has caught up,
    its policy is the full reload's."""
    import threading

    replica = open_store(key)
    policy = Policy(replica.snapshot())
    done = threading.Event()
    failures: list[BaseException] = []

    def write() -> None:
        rng = random.Random(seed)
        try:
            for _ in range(300):
                try:
                    _apply_op(store, _random_op(rng))
                except CredproxyError:
                    pass
        except BaseException as e:  # surfaced below
            failures.append(e)
        finally:
            done.set()

    writer = threading.Thread(target=write)
    writer.start()
    applied = full = 0
    while True:
        finished = done.is_set()
        delta = replica.delta(policy.counter)
        if delta is None:
            policy, full = Policy(replica.snapshot()), full + 1
        else:
            policy.apply(delta)
            applied += 1
        if finished and policy.counter == replica.change_counter():
            break
    writer.join()
    assert failures == []
    assert applied > 1
    assert view(policy) == view(Policy(replica.snapshot()))


@pytest.mark.parametrize("read", ["full", "delta"])
def test_a_read_under_writes_that_never_stop_is_one_consistent_state(
    store: Store, key: MasterKey, open_store: Callable[[MasterKey | None], Store], read: str
) -> None:
    """A write lands between the SELECTs of every read, as under a steady stream of changes
    at 100,000 grants (a full read takes seconds): the read must still finish, as the one
    state of the store at its counter, not give up (every replica would go stale)."""
    from sqlalchemy import event

    seed(store)
    store.add_principal("intern")
    replica = open_store(key)
    policy = Policy(replica.snapshot())
    store.add_grant("agent", ["POST"], credential="gh")
    other = open_store(key)
    states = {store.change_counter(): view(Policy(store.snapshot()))}
    writes: list[int] = []

    def between(conn, cursor, statement, *args) -> None:  # type: ignore[no-untyped-def]
        if "FROM grants" in statement and len(writes) < 20:
            # Another shell, meanwhile: a grant to intern; the state it leaves is kept.
            writes.append(other.add_grant("intern", ["GET"], credential="gh"))
            states[other.change_counter()] = view(Policy(other.snapshot()))

    event.listen(replica.engine, "after_cursor_execute", between)
    try:
        if read == "full":
            policy = Policy(replica.snapshot())
        else:
            delta = replica.delta(policy.counter)
            assert delta is not None
            policy.apply(delta)
    finally:
        event.remove(replica.engine, "after_cursor_execute", between)
    assert writes
    assert view(policy) == states[policy.counter]


def test_a_change_logged_as_all_is_one_row(store: Store) -> None:
    seed(store)
    store.add_credential("pypi", "bearer", ["pypi.org"], SECRET)
    counter = store.change_counter()
    store.rotate_key(MasterKey.generate("new"))  # every credential re-sealed, and the key's row
    with store.db.reading() as connection:
        rows = connection.execute(
            select(ChangeLog.kind, ChangeLog.row_id).where(
                ChangeLog.counter > counter, ChangeLog.kind != changelog.MARK
            )
        ).all()
    assert [tuple(r) for r in rows] == [("all", 0)]
