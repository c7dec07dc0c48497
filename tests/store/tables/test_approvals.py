"""Requests held for approval, in the store: recorded, decided, expired, covering later ones."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest

from addon.core.policy import Policy
from store.db.models import utcnow
from store.errors import InvalidInput
from store.repository import Store
from store.rules import validation
from store.tables.rates import Bucket
from tests.clihelp import Call, Cli
from tests.stores import SECRET

PATH = "/v1/items"


def _grant(store: Store, approval: str, hold: str | None = None) -> int:
    store.add_principal("agent")
    store.add_credential("gh", "bearer", ["api.github.com"], SECRET)
    limits = validation.limits(None, None, approval=approval, hold=hold)
    return store.add_grant("agent", ["GET"], credential="gh", limits=limits)


def _hold(store: Store, grant_id: int, share: bool, path: str = PATH) -> tuple[int, bool]:
    return store.hold_request("agent", grant_id, "api.github.com", 443, "GET", path, 60, share)


@pytest.mark.parametrize(
    ("approval", "hold", "says"),
    [
        pytest.param("every", None, "invalid approval 'every': use each or first", id="bad mode"),
        pytest.param(None, "30s", "a hold goes with an approval", id="a hold needs an approval"),
        pytest.param("each", "0s", "invalid hold '0s'", id="no zero hold"),
        pytest.param("each", "11m", "invalid hold '11m'", id="at most ten minutes"),
        pytest.param("each", "-5", "invalid hold '-5'", id="no negative hold"),
    ],
)
def test_bad_approval_settings_are_refused(approval: str | None, hold: str | None, says: str):
    with pytest.raises(InvalidInput, match=says):
        validation.limits(None, None, approval=approval, hold=hold)


def test_a_grant_keeps_its_approval_and_hold_and_the_snapshot_carries_them(store: Store) -> None:
    grant_id = _grant(store, "first", "90s")
    (entry,) = store.list_grants()
    assert (entry.approval, entry.hold) == ("first", 90)
    (record,) = store.snapshot().grants
    assert (record.id, record.approval, record.hold) == (grant_id, "first", 90)
    assert validation.limits(None, None, approval="each").hold == validation.DEFAULT_HOLD


def test_each_hold_is_its_own_request_and_holds_are_not_access_requests(store: Store) -> None:
    grant_id = _grant(store, "each")
    first, created = _hold(store, grant_id, share=False)
    second, again = _hold(store, grant_id, share=False)
    assert created and again and first != second
    recorded = store.record_access_request("agent", "api.github.com", 443, "GET", PATH)
    assert recorded is not None and recorded[0] not in (first, second)
    kinds = {r.id: r.kind for r in store.list_access_requests("pending")}
    assert kinds == {first: "hold", second: "hold", recorded[0]: "access"}


def test_first_holds_of_a_kind_share_one_request(store: Store) -> None:
    grant_id = _grant(store, "first")
    first, _ = _hold(store, grant_id, share=True)
    joined, created = _hold(store, grant_id, share=True)
    other, other_created = _hold(store, grant_id, share=True, path="/v1/other")
    assert (joined, created) == (first, False)
    assert other_created and other != first


def test_approving_a_hold_adds_no_grant_and_denying_ends_it(store: Store) -> None:
    grant_id = _grant(store, "each")
    approved, _ = _hold(store, grant_id, share=False)
    denied, _ = _hold(store, grant_id, share=False)
    counter = store.change_counter()
    assert store.approve_request(approved) == ("hold", grant_id)
    store.deny_access_request(denied, "no")
    assert store.change_counter() == counter + 2  # every proxy hears of both
    assert store.hold_states([approved, denied]) == {approved: "approved", denied: "denied"}
    assert [g.id for g in store.list_grants()] == [grant_id]


@pytest.mark.parametrize(
    ("options", "says"),
    [
        pytest.param({"credential": "gh"}, "credential goes with access requests", id="credential"),
        pytest.param({"path": "/v1/"}, "path goes with access requests", id="path"),
        pytest.param({"once": True}, "once goes with access requests", id="once"),
        pytest.param({"next_uses": 3}, "--next and --for go with grants held", id="next on each"),
    ],
)
def test_a_hold_of_an_each_grant_takes_no_grant_options(
    store: Store, options: dict, says: str
) -> None:
    held, _ = _hold(store, _grant(store, "each"), share=False)
    with pytest.raises(InvalidInput, match=says):
        store.approve_request(held, **options)
    assert store.hold_states([held]) == {held: "pending"}


def test_an_access_request_takes_no_next(store: Store) -> None:
    _grant(store, "each")
    recorded = store.record_access_request("agent", "api.github.com", 443, "GET", "/v2")
    assert recorded is not None
    with pytest.raises(InvalidInput, match="--next and --for go with held requests"):
        store.approve_request(recorded[0], next_uses=2)


def test_settling_expires_a_pending_hold_and_keeps_a_decision(store: Store) -> None:
    grant_id = _grant(store, "each")
    waiting, _ = _hold(store, grant_id, share=False)
    decided, _ = _hold(store, grant_id, share=False)
    store.approve_request(decided)
    assert store.settle_hold(waiting) == "expired"
    assert store.settle_hold(decided) == "approved"
    with pytest.raises(InvalidInput, match="is expired, not pending"):
        store.approve_request(waiting)


def test_an_approval_of_first_covers_its_kind_in_the_snapshot(store: Store) -> None:
    grant_id = _grant(store, "first")
    forever, _ = _hold(store, grant_id, share=True)
    timed, _ = _hold(store, grant_id, share=True, path="/v1/timed")
    counted, _ = _hold(store, grant_id, share=True, path="/v1/counted")
    store.approve_request(forever)
    store.approve_request(timed, cover_until=utcnow() + timedelta(minutes=5))
    store.approve_request(counted, next_uses=2)
    policy = Policy(store.snapshot())
    now = utcnow()

    def cover(path: str, method: str = "GET", when=now):  # type: ignore[no-untyped-def]
        return policy.covering(grant_id, method, "api.github.com", 443, path, when)

    assert cover(PATH) is not None and cover(PATH).id == forever
    assert cover(PATH, "POST") is None and cover("/v1/items/x") is None
    assert cover("/v1/timed").id == timed
    assert cover("/v1/timed", when=now + timedelta(minutes=6)) is None
    assert cover("/v1/counted").counted


def test_a_counted_approval_serves_exactly_its_number_across_callers(store: Store) -> None:
    grant_id = _grant(store, "first")
    held, _ = _hold(store, grant_id, share=True)
    store.approve_request(held, next_uses=3)
    counter = store.change_counter()
    with ThreadPoolExecutor(8) as pool:
        won = list(pool.map(lambda _: store.use_approval(held), range(12)))
    assert won.count(True) == 3
    assert store.change_counter() == counter + 1  # only the last use moves it
    assert (
        Policy(store.snapshot()).covering(grant_id, "GET", "api.github.com", 443, PATH, utcnow())
        is None
    )


def test_an_approval_of_a_revoked_grant_covers_nothing(store: Store) -> None:
    grant_id = _grant(store, "first")
    held, _ = _hold(store, grant_id, share=True)
    store.approve_request(held)
    store.revoke_grant(grant_id)
    assert store.snapshot().coverage == {}


def test_removing_the_principal_denies_its_holds(store: Store) -> None:
    held, _ = _hold(store, _grant(store, "each"), share=False)
    store.remove_principal("agent")
    assert store.hold_states([held]) == {held: "denied"}


# -- shared rate buckets (run --shared-rates) ----------------------------------------------


def test_shared_buckets_admit_exactly_their_burst_across_callers(store: Store) -> None:
    bucket = Bucket("grant:1:5/h:5", 5 / 3600, 5.0)
    now = 1_000_000.0
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: store.take_rates([bucket], now), range(16)))
    assert answers.count(None) == 5
    refused = [a for a in answers if a is not None]
    assert {index for index, _ in refused} == {0}
    assert all(710 < wait <= 720 for _, wait in refused)  # a fifth of an hour: one token
    assert store.take_rates([bucket], now + 720) is None  # refilled by one


def test_a_shared_take_spends_from_every_bucket_or_from_none(store: Store) -> None:
    wide = Bucket("principal:agent:100/s:100", 100.0, 100.0)
    narrow = Bucket("grant:2:1/h:1", 1 / 3600, 1.0)
    now = 2_000_000.0
    assert store.take_rates([wide, narrow], now) is None
    index, _ = store.take_rates([wide, narrow], now) or (None, None)
    assert index == 1
    # The refused request spent nothing of the wide bucket: 99 are left, not 98.
    assert all(store.take_rates([wide], now) is None for _ in range(99))
    assert store.take_rates([wide], now) is not None


# -- the CLI --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cli(tmp_path_factory: pytest.TempPathFactory) -> Cli:
    cli = Cli(tmp_path_factory.mktemp("approvals-cli"))
    cli.ok(Call(("init",)))
    cli.ok(Call(("principal", "add", "agent")))
    cli.ok(Call(("credential", "add", "gh", "--scheme", "bearer", "--host", "api.test"), b"s3"))
    return cli


@pytest.mark.parametrize(
    ("args", "says"),
    [
        pytest.param(("--approval", "always"), "argument --approval: invalid choice", id="mode"),
        pytest.param(("--hold", "30s"), "--hold goes with --approval", id="hold alone"),
        pytest.param(("--approval", "each", "--hold", "11m"), "invalid --hold '11m'", id="long"),
        pytest.param(("--approval", "each", "--hold", "nan"), "invalid --hold 'nan'", id="nan"),
    ],
)
def test_grant_add_refuses_bad_approvals_in_one_line(
    cli: Cli, args: tuple[str, ...], says: str
) -> None:
    done = cli.run(Call(("grant", "add", "agent", "--credential", "gh", "--method", "GET", *args)))
    assert done.returncode == 2
    assert says in done.stderr and done.stderr.count("\n") == 1
    assert "Traceback" not in done.stderr
    assert cli.store().list_grants() == []


def test_grant_add_and_list_show_the_approval(cli: Cli) -> None:
    args = ("--credential", "gh", "--method", "GET", "--approval", "first", "--hold", "2m")
    (added,) = cli.ok(Call(("grant", "add", "agent", *args, "--json")))
    (listed,) = cli.ok(Call(("grant", "list", "--json")))
    [row] = [g for g in json.loads(listed) if g["id"] == json.loads(added)["id"]]
    assert (row["approval"], row["hold"]) == ("first", 120)
    cli.ok(Call(("grant", "revoke", str(row["id"]))))


def test_request_list_shows_what_a_held_body_asked(cli: Cli) -> None:
    args = ("--credential", "gh", "--method", "POST", "--path", "/graphql", "--approval", "each")
    (added,) = cli.ok(Call(("grant", "add", "agent", *args, "--graphql", "mutation", "--json")))
    grant_id = json.loads(added)["id"]
    store = cli.store()
    held, _ = store.hold_request(
        "agent", grant_id, "api.test", 443, "POST", "/graphql", 60, False, "mutation addComment"
    )
    store.close()
    as_json, as_table = cli.ok(
        Call(("request", "list", "--json")),
        Call(
            (
                "request",
                "list",
            )
        ),
    )
    [row] = [r for r in json.loads(as_json) if r["id"] == held]
    assert (row["kind"], row["operation"]) == ("hold", "mutation addComment")
    head, *rows = as_table.splitlines()
    assert "operation" in head.split()
    [line] = [line for line in rows if line.split()[0] == str(held)]
    assert "mutation addComment" in line
    cli.ok(Call(("request", "deny", str(held))), Call(("grant", "revoke", str(grant_id))))


def test_concurrent_first_holds_of_a_kind_share_one_request(store: Store) -> None:
    grant_id = _grant(store, "first")
    with ThreadPoolExecutor(8) as pool:
        held = list(pool.map(lambda _: _hold(store, grant_id, share=True), range(8)))
    assert len({request_id for request_id, _ in held}) == 1
    assert [created for _, created in held].count(True) == 1


def test_a_hold_whose_clients_all_left_expires_and_an_approval_comes_too_late(
    store: Store,
) -> None:
    grant_id = _grant(store, "first")
    shared, _ = _hold(store, grant_id, share=True)
    assert _hold(store, grant_id, share=True) == (shared, False)  # two wait on it
    store.leave_hold(shared)
    assert store.hold_states([shared]) == {shared: "pending"}  # one still waits
    store.leave_hold(shared)
    assert store.hold_states([shared]) == {shared: "expired"}
    with pytest.raises(InvalidInput, match="expired, not pending"):
        store.approve_request(shared)
    # A decision that landed first stands.
    each = _grant_again(store)
    decided, _ = _hold(store, each, share=False)
    store.approve_request(decided)
    store.leave_hold(decided)
    assert store.hold_states([decided]) == {decided: "approved"}


def _grant_again(store: Store) -> int:
    limits = validation.limits(None, None, approval="each")
    return store.add_grant("agent", ["GET"], credential="gh", limits=limits)


def test_an_approval_racing_the_deadline_either_wins_whole_or_is_refused(store: Store) -> None:
    from threading import Barrier

    from store.errors import CredproxyError

    grant_id = _grant(store, "each")
    for _ in range(15):
        request_id, _ = _hold(store, grant_id, share=False)
        barrier = Barrier(2)

        def approve(rid: int = request_id, barrier: Barrier = barrier) -> bool:
            barrier.wait()
            try:
                store.approve_request(rid)
            except (InvalidInput, CredproxyError):
                return False
            return True

        def settle(rid: int = request_id, barrier: Barrier = barrier) -> str:
            barrier.wait()
            return store.settle_hold(rid)

        with ThreadPoolExecutor(2) as pool:
            approved, settled = pool.submit(approve), pool.submit(settle)
            # The holder goes on exactly when the owner was told the approval took.
            assert (settled.result() == "approved") == approved.result()
        assert store.hold_states([request_id])[request_id] == settled.result()


def test_two_owners_approving_one_access_request_at_once_make_one_grant(store: Store) -> None:
    from threading import Barrier

    from store.errors import CredproxyError

    store.add_principal("agent")
    store.add_credential("gh", "bearer", ["api.github.com"], SECRET)
    for i in range(10):
        recorded = store.record_access_request("agent", "api.github.com", 443, "GET", f"/r/{i}")
        assert recorded is not None
        barrier = Barrier(2)

        def approve(rid: int = recorded[0], barrier: Barrier = barrier) -> bool:
            barrier.wait()
            try:
                store.approve_request(rid, credential="gh")
            except (InvalidInput, CredproxyError):
                return False
            return True

        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(lambda _: approve(), range(2)))
        grants = [g for g in store.list_grants() if g.paths == [f"/r/{i}"]]
        assert (results.count(True), len(grants)) == (1, 1)


def test_an_approval_of_first_covers_no_other_host_port_grant_or_principal(store: Store) -> None:
    grant_id = _grant(store, "first")
    held, _ = _hold(store, grant_id, share=True)
    store.approve_request(held)
    limits = validation.limits(None, None, approval="first")
    sibling = store.add_grant("agent", ["GET"], credential="gh", limits=limits)
    store.add_principal("other")
    others = store.add_grant("other", ["GET"], credential="gh", limits=limits)
    policy = Policy(store.snapshot())
    now = utcnow()
    assert policy.covering(grant_id, "GET", "api.github.com", 443, PATH, now) is not None
    assert policy.covering(grant_id, "GET", "api.github.com", 8443, PATH, now) is None
    assert policy.covering(grant_id, "GET", "uploads.github.com", 443, PATH, now) is None
    assert policy.covering(grant_id, "HEAD", "api.github.com", 443, PATH, now) is None
    for gid in (sibling, others):
        assert policy.covering(gid, "GET", "api.github.com", 443, PATH, now) is None


def test_an_approval_under_each_never_covers_once_the_grant_becomes_first(store: Store) -> None:
    from sqlalchemy import update

    from store.db.models import Grant

    grant_id = _grant(store, "each")
    held, _ = _hold(store, grant_id, share=False)
    store.approve_request(held)  # one request, as `each` asks
    with store.db.change() as session:  # a policy file switches the grant, in place
        session.execute(update(Grant).where(Grant.id == grant_id).values(approval="first"))
    policy = Policy(store.snapshot())
    assert policy.covering(grant_id, "GET", "api.github.com", 443, PATH, utcnow()) is None


def test_a_hold_over_a_spent_budget_shares_nothing_and_covers_nothing(store: Store) -> None:
    grant_id = _grant(store, "first")
    plain, _ = _hold(store, grant_id, share=True)

    def over() -> tuple[int, bool]:
        return store.hold_request(
            "agent", grant_id, "api.github.com", 443, "GET", PATH, 60, True, None, "total=9/day"
        )

    (a, created_a), (b, created_b) = over(), over()
    assert created_a and created_b and len({plain, a, b}) == 3  # none joins another
    assert _hold(store, grant_id, share=True) == (plain, False)  # nor a plain hold one over
    with pytest.raises(InvalidInput, match="not with a request held over its budget"):
        store.approve_request(a, next_uses=3)
    store.approve_request(a)
    (row,) = [r for r in store.list_access_requests() if r.id == a]
    assert (row.state, row.kind, row.budget_spent) == ("approved", "hold", "total=9/day")
    # Let go alone: it covers no later request of its kind, even under `first`.
    assert (
        Policy(store.snapshot()).covering(grant_id, "GET", "api.github.com", 443, PATH, utcnow())
        is None
    )
