"""Token budgets in the store: the grant's limits, charges summed exactly across writers."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import update
from sqlalchemy.orm import Session

from store.crypto import MasterKey
from store.db.models import Grant
from store.errors import InvalidInput, NotFound
from store.policyfile import reconcile
from store.policyfile.parse import load
from store.repository import Store
from store.rules import budgets, validation
from tests.fakes import POLICY
from tests.stores import SECRET


def _budgeted(store: Store, *specs: str) -> int:
    store.add_principal("agent")
    store.add_credential("llm", "bearer", ["api.openai.com"], SECRET)
    limits = validation.limits(None, None, budget=specs)
    return store.add_grant("agent", ["POST"], credential="llm", limits=limits)


@pytest.mark.parametrize(
    "spec",
    [
        pytest.param("total=0/day", id="zero tokens"),
        pytest.param("total=100/week", id="a window that is none of hour, day, month"),
        pytest.param("prompt=100/day", id="a kind that is none of input, output, total"),
        pytest.param("total=100", id="no window"),
        pytest.param("total=1e5/day", id="not a whole number"),
        pytest.param("total=99999999999999999/day", id="above the largest budget"),
    ],
)
def test_a_bad_budget_is_refused_in_one_line(spec: str) -> None:
    with pytest.raises(InvalidInput, match="budget"):
        budgets.parse([spec])


def test_a_kind_twice_in_one_window_is_refused() -> None:
    with pytest.raises(InvalidInput, match="twice"):
        budgets.parse(["total=5/day", "total=6/day"])


@pytest.mark.parametrize(
    ("window", "now", "key", "end"),
    [
        pytest.param("hour", "2026-12-07T14:59:59", "hour:2026-12-07T14", "2026-12-07T15:00:00"),
        pytest.param("day", "2026-12-31T23:00:00", "day:2026-12-31", "2027-01-01T00:00:00"),
        pytest.param("month", "2026-12-07T10:00:00", "month:2026-12", "2027-01-01T00:00:00"),
        pytest.param("month", "2027-01-31T10:00:00", "month:2027-01", "2027-02-01T00:00:00"),
    ],
)
def test_windows_are_utc_hours_days_and_months(window: str, now: str, key: str, end: str) -> None:
    at = datetime.fromisoformat(now).replace(tzinfo=UTC)
    assert budgets.window_key(window, at) == key
    assert budgets.window_end(window, at) == datetime.fromisoformat(end).replace(tzinfo=UTC)


def test_a_grants_budget_reaches_the_proxys_snapshot_and_the_listing(store: Store) -> None:
    grant_id = _budgeted(store, "output=500/hour", "total=2000/day")
    (grant,) = store.snapshot().grants
    assert grant.budget is not None
    assert [str(limit) for limit in grant.budget.limits] == ["output=500/hour", "total=2000/day"]
    (entry,) = store.list_grants()
    assert entry.budget == "output=500/hour, total=2000/day"
    now = datetime.now(UTC)
    store.charge_budget(grant_id, [budgets.window_key("day", now)], 300, 100, False)
    listed = {(e.kind, e.window): e for e in store.list_budgets()}
    assert listed["total", "day"].used == 400
    assert listed["total", "day"].remaining == 1600
    assert listed["total", "day"].requests == 1
    assert listed["output", "hour"].used == 0  # charged to the day's window only


def test_charges_from_many_writers_sum_exactly(
    store: Store, open_store: Callable[[MasterKey | None], Store], key: MasterKey
) -> None:
    grant_id = _budgeted(store, "total=1000000/day")
    other = open_store(key)  # another replica's connection pool
    windows = ["day:2026-12-07", "hour:2026-12-07T14"]
    barrier = threading.Barrier(8)

    def charge(s: Store) -> None:
        barrier.wait()
        for _ in range(10):
            s.charge_budget(grant_id, windows, 3, 5, estimated=False)

    threads = [threading.Thread(target=charge, args=(s,)) for s in [store, other] * 4]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    used = store.budget_used(grant_id, windows)
    assert {w: (u.input_tokens, u.output_tokens, u.requests) for w, u in used.items()} == {
        w: (240, 400, 80) for w in windows
    }


def test_a_budget_round_trips_through_a_policy_file(
    store: Store, key: MasterKey, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GITHUB_TOKEN", "ghp_policy_secret_1")
    path = tmp_path / "policy.toml"
    path.write_text(POLICY + 'budget = ["total=200000/day", "output=5000/hour"]\n')
    reconcile.apply(store.db, key, load(path))
    (grant,) = store.list_grants()
    assert grant.budget == "output=5000/hour, total=200000/day"
    exported = tmp_path / "exported.toml"
    exported.write_text(reconcile.export(store.db))
    assert 'budget = ["output=5000/hour", "total=200000/day"]' in exported.read_text()
    assert reconcile.plan(store.db, key, load(exported), prune=True).empty


def test_a_bad_budget_in_a_policy_file_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "policy.toml"
    path.write_text(POLICY + 'budget = ["total=lots/day"]\n')
    (problem,) = load(path).problems
    assert "budget" in problem and ":" in problem


def test_a_grant_whose_budget_cannot_be_read_is_never_served_without_it(store: Store) -> None:
    grant_id = _budgeted(store, "total=10/day")
    with Session(store.engine) as session, session.begin():
        session.execute(update(Grant).where(Grant.id == grant_id).values(budget='["lots"]'))
    assert store.snapshot().grants == ()


def test_a_budget_replaced_keeps_what_was_charged_and_reaches_the_proxy(store: Store) -> None:
    grant_id = _budgeted(store, "total=100/day")
    now = datetime.now(UTC)
    store.charge_budget(grant_id, [budgets.window_key("day", now)], 90, 10, False)
    counter = store.change_counter()
    assert store.set_grant_budget(grant_id, ["total=300/day"]) == "total=300/day"
    assert store.change_counter() > counter
    (grant,) = store.snapshot().grants
    assert grant.budget == budgets.parse(["total=300/day"])
    (entry,) = store.list_budgets()
    assert (entry.limit, entry.used, entry.remaining) == (300, 100, 200)
    assert store.set_grant_budget(grant_id, []) is None
    assert store.snapshot().grants[0].budget is None
    store.revoke_grant(grant_id)
    with pytest.raises(NotFound):
        store.set_grant_budget(grant_id, ["total=1/day"])


@pytest.mark.parametrize(
    ("spec", "micros", "shown"),
    [
        pytest.param("spend=5/day", 5_000_000, "spend=5/day", id="whole dollars"),
        pytest.param("spend=2.50/hour", 2_500_000, "spend=2.5/hour", id="cents"),
        pytest.param("spend=0.000125/month", 125, "spend=0.000125/month", id="micro-dollars"),
    ],
)
def test_a_spend_limit_is_kept_in_micro_dollars(spec: str, micros: int, shown: str) -> None:
    budget = budgets.parse([spec])
    assert budget is not None
    (limit,) = budget.limits
    assert (limit.kind, limit.tokens, str(limit)) == ("spend", micros, shown)


@pytest.mark.parametrize(
    "spec", ["spend=0/day", "spend=1.0000001/day", "spend=-1/day", "spend=1e3/day"]
)
def test_a_bad_spend_limit_is_refused(spec: str) -> None:
    with pytest.raises(InvalidInput, match="budget"):
        budgets.parse([spec])


def test_spend_is_charged_and_listed_beside_tokens(store: Store) -> None:
    grant_id = _budgeted(store, "spend=0.01/day", "total=1000/day")
    key = budgets.window_key("day", datetime.now(UTC))
    store.charge_budget(grant_id, [key], 100, 20, False, spend_micros=450)
    store.charge_budget(grant_id, [key], 100, 20, False, spend_micros=450)
    assert store.budget_used(grant_id, [key])[key].of("spend") == 900
    listed = {e.kind: e for e in store.list_budgets()}
    assert (listed["spend"].limit, listed["spend"].used, listed["spend"].remaining) == (
        10_000,
        900,
        9_100,
    )


def test_a_cap_of_max_tokens_is_kept_in_the_budget_and_reaches_the_proxy(store: Store) -> None:
    store.add_principal("agent")
    store.add_credential("llm", "bearer", ["api.openai.com"], SECRET)
    limits = validation.limits(None, None, budget=["output=500/day"], cap_max_tokens=True)
    grant_id = store.add_grant("agent", ["POST"], credential="llm", limits=limits)
    (grant,) = store.snapshot().grants
    assert grant.budget is not None and grant.budget.cap
    (entry,) = store.list_grants()
    assert (entry.budget, entry.cap_max_tokens) == ("output=500/day, max_tokens capped", True)
    # Raising the budget keeps the cap; only the flag changes it; clearing removes both.
    assert store.set_grant_budget(grant_id, ["output=900/day"]) == (
        "output=900/day, max_tokens capped"
    )
    assert store.set_grant_budget(grant_id, [], cap=False) == "output=900/day"
    assert store.snapshot().grants[0].budget == budgets.parse(["output=900/day"])
    assert store.set_grant_budget(grant_id, [], cap=True) == "output=900/day, max_tokens capped"
    assert store.set_grant_budget(grant_id, []) is None
    with pytest.raises(InvalidInput, match="no budget"):
        store.set_grant_budget(grant_id, [], cap=True)


@pytest.mark.parametrize(
    "stored",
    [
        pytest.param('{"limits": ["output=5/day"], "cap_max_tokens": false}', id="cap false"),
        pytest.param('{"limits": ["output=5/day"]}', id="no cap key"),
        pytest.param('{"limits": ["output=5/day"], "cap_max_tokens": 1}', id="cap not true"),
        pytest.param('{"limits": [], "cap_max_tokens": true}', id="no limits"),
        pytest.param('{"limits": ["input=5/day"], "cap_max_tokens": true}', id="nothing to cap"),
        pytest.param(
            '{"limits": ["output=5/day"], "cap_max_tokens": true, "x": 1}', id="another key"
        ),
    ],
)
def test_a_capping_budget_that_is_not_canonical_leaves_its_grant_out(
    store: Store, stored: str
) -> None:
    grant_id = _budgeted(store, "output=10/day")
    with Session(store.engine) as session, session.begin():
        session.execute(update(Grant).where(Grant.id == grant_id).values(budget=stored))
    assert store.snapshot().grants == ()


def test_a_capping_budget_round_trips_through_a_policy_file(
    store: Store, key: MasterKey, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GITHUB_TOKEN", "ghp_policy_secret_1")
    path = tmp_path / "policy.toml"
    path.write_text(POLICY + 'budget = ["output=5000/hour"]\ncap_max_tokens = true\n')
    reconcile.apply(store.db, key, load(path))
    (grant,) = store.list_grants()
    assert grant.cap_max_tokens
    exported = tmp_path / "exported.toml"
    exported.write_text(reconcile.export(store.db))
    assert "cap_max_tokens = true" in exported.read_text()
    assert reconcile.plan(store.db, key, load(exported), prune=True).empty
    path.write_text(POLICY + 'budget = ["output=5000/hour"]\n')
    assert not reconcile.plan(store.db, key, load(path), prune=True).empty


@pytest.mark.parametrize(
    "keys",
    [
        pytest.param("cap_max_tokens = true\n", id="without a budget"),
        pytest.param('budget = ["input=5/day"]\ncap_max_tokens = true\n', id="input only"),
        pytest.param('budget = ["output=5/day"]\ncap_max_tokens = "yes"\n', id="not a boolean"),
    ],
)
def test_a_bad_cap_in_a_policy_file_names_its_key(tmp_path: Path, keys: str) -> None:
    path = tmp_path / "policy.toml"
    path.write_text(POLICY + keys)
    (problem,) = load(path).problems
    assert "cap_max_tokens" in problem
