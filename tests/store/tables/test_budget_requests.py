"""Budget requests: a spent budget recorded as an access request of kind budget, and the owner
raising the grant's budget by approving it (`request approve ID --budget ...`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest

from store.errors import InvalidInput
from store.records import AccessRequestEntry
from store.repository import Store
from store.rules import validation
from tests.clihelp import Call, Cli

OPENAI = ("api.openai.test", 443, "POST", "/v1/chat/completions")


@pytest.fixture
def budgeted(store: Store) -> tuple[Store, int]:
    """Principal `agent` with grant (returned) of budget total=250/day."""
    store.add_principal("agent")
    store.add_principal("other")
    limits = validation.limits(None, None, budget=("total=250/day",))
    grant_id = store.add_grant("agent", ["POST"], hosts=["api.openai.test"], limits=limits)
    return store, grant_id


def _spent(store: Store, grant_id: int, spent: str = "total=250/day") -> int:
    request_id, state = store.record_budget_request("agent", grant_id, *OPENAI, spent)
    assert state == "pending"
    return request_id


def _entry(store: Store, request_id: int) -> AccessRequestEntry:
    (found,) = [r for r in store.list_access_requests() if r.id == request_id]
    return found


def test_a_spent_budget_is_one_pending_request_per_grant(budgeted: tuple[Store, int]) -> None:
    store, grant_id = budgeted
    first = _spent(store, grant_id)
    again = _spent(store, grant_id, "total=250/day, output=10/hour")
    assert again == first
    found = _entry(store, first)
    assert (found.kind, found.grant_id, found.count, found.state) == (
        "budget",
        grant_id,
        2,
        "pending",
    )
    assert found.budget_spent == "total=250/day, output=10/hour"  # what is spent now
    assert (found.host, found.method, found.path, found.purpose) == (
        "api.openai.test",
        "POST",
        "/v1/chat/completions",
        None,
    )


def test_a_budget_request_is_not_joined_to_an_access_request(
    budgeted: tuple[Store, int],
) -> None:
    store, grant_id = budgeted
    recorded = store.record_access_request("agent", *OPENAI)
    assert recorded is not None
    assert _spent(store, grant_id) != recorded[0]


def test_approving_with_a_budget_replaces_it_and_names_both(budgeted: tuple[Store, int]) -> None:
    store, grant_id = budgeted
    request_id = _spent(store, grant_id)
    changes = store.change_counter()
    got = store.approve_budget_request(
        request_id, ["output=50/hour", "total=400/day"], "console:alice"
    )
    assert got == (grant_id, "total=250/day", "output=50/hour, total=400/day")
    (grant,) = store.list_grants()
    assert grant.budget == "output=50/hour, total=400/day"
    found = _entry(store, request_id)
    assert (found.state, found.decided_by) == ("approved", "console:alice")
    assert (found.budget_was, found.budget_set) == (
        "total=250/day",
        "output=50/hour, total=400/day",
    )
    assert store.change_counter() > changes  # every proxy reloads the grant
    # Decided: the next refusal is a new request.
    assert _spent(store, grant_id) != request_id


@pytest.mark.parametrize(
    ("specs", "says"),
    [
        pytest.param([], "a budget is needed", id="no budget at all"),
        pytest.param(["total=lots/day"], "invalid budget", id="a budget that does not parse"),
        pytest.param(["total=1/day", "total=2/day"], "twice", id="the same kind and window twice"),
    ],
)
def test_a_bad_budget_leaves_the_request_and_the_grant(
    budgeted: tuple[Store, int], specs: list[str], says: str
) -> None:
    store, grant_id = budgeted
    request_id = _spent(store, grant_id)
    with pytest.raises(InvalidInput, match=says):
        store.approve_budget_request(request_id, specs)
    assert _entry(store, request_id).state == "pending"
    assert store.list_grants()[0].budget == "total=250/day"


def test_plain_approval_of_a_budget_request_is_refused(budgeted: tuple[Store, int]) -> None:
    store, grant_id = budgeted
    request_id = _spent(store, grant_id)
    with pytest.raises(InvalidInput, match=f"raise grant {grant_id}'s budget"):
        store.approve_request(request_id)
    assert _entry(store, request_id).state == "pending"
    assert [g.id for g in store.list_grants()] == [grant_id]  # no new grant


def test_a_budget_goes_with_budget_requests_only(budgeted: tuple[Store, int]) -> None:
    store, grant_id = budgeted
    recorded = store.record_access_request("agent", *OPENAI)
    assert recorded is not None
    held, _ = store.hold_request("agent", grant_id, *OPENAI, 60, False)
    for request_id in (held, recorded[0]):
        with pytest.raises(InvalidInput, match="goes with budget requests"):
            store.approve_budget_request(request_id, ["total=1/day"])
        assert _entry(store, request_id).state == "pending"
    assert store.list_grants()[0].budget == "total=250/day"


def test_the_budget_of_a_revoked_grant_is_not_raised(budgeted: tuple[Store, int]) -> None:
    store, grant_id = budgeted
    request_id = _spent(store, grant_id)
    store.revoke_grant(grant_id)
    with pytest.raises(InvalidInput, match="revoked"):
        store.approve_budget_request(request_id, ["total=400/day"])
    store.deny_access_request(request_id, "revoked", "cli:root")
    assert (_entry(store, request_id).state, _entry(store, request_id).decided_by) == (
        "denied",
        "cli:root",
    )


# -- the CLI ---------------------------------------------------------------------------


@dataclass
class Round:
    cli: Cli
    grant_id: int
    ids: dict[str, int]
    outputs: dict[str, Any]


@pytest.fixture(scope="module")
def cli_round(tmp_path_factory: pytest.TempPathFactory) -> Round:
    cli = Cli(tmp_path_factory.mktemp("budget-requests"))
    cli.ok(Call(("init",)))
    cli.ok(Call(("principal", "add", "agent")))
    store = cli.store()
    try:
        limits = validation.limits(None, None, budget=("total=250/day",))
        grant_id = store.add_grant("agent", ["POST"], hosts=["api.openai.test"], limits=limits)
        ids = {"raise": _spent(store, grant_id)}
        other = store.add_grant("agent", ["POST"], hosts=["api.anthropic.test"], limits=limits)
        ids["plain"] = _spent(store, other)
    finally:
        store.close()
    listed, table = cli.ok(Call(("request", "list", "--json")), Call(("request", "list")))
    (approved,) = cli.ok(
        Call(
            (
                "request",
                "approve",
                str(ids["raise"]),
                "--budget",
                "total=400/day",
                "--budget",
                "output=50/hour",
                "--json",
            )
        )
    )
    (text,) = cli.ok(Call(("request", "list", "--state", "approved", "--json")))
    outputs = {
        "listed": json.loads(listed),
        "table": table,
        "approved": json.loads(approved),
        "after": json.loads(text),
    }
    return Round(cli, grant_id, ids, outputs)


def test_cli_list_shows_a_budget_request(cli_round: Round) -> None:
    rows = {r["id"]: r for r in cli_round.outputs["listed"]}
    row = rows[cli_round.ids["raise"]]
    assert (row["kind"], row["grant_id"], row["budget_spent"], row["state"]) == (
        "budget",
        cli_round.grant_id,
        "total=250/day",
        "pending",
    )
    header = cli_round.outputs["table"].splitlines()[0].split()
    assert "kind" in header and "budget_spent" in header
    assert "budget" in cli_round.outputs["table"]


def test_cli_approve_with_budgets_raises_the_grant(cli_round: Round) -> None:
    assert cli_round.outputs["approved"] == {
        "id": cli_round.ids["raise"],
        "grant_id": cli_round.grant_id,
        "state": "approved",
        "kind": "budget",
        "budget_was": "total=250/day",
        "budget": "output=50/hour, total=400/day",
    }
    (row,) = cli_round.outputs["after"]
    assert row["decided_by"].startswith("cli")
    assert (row["budget_was"], row["budget"]) == ("total=250/day", "output=50/hour, total=400/day")
    store = cli_round.cli.store()
    try:
        budgets = {g.id: g.budget for g in store.list_grants()}
    finally:
        store.close()
    assert budgets[cli_round.grant_id] == "output=50/hour, total=400/day"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        pytest.param(
            ("{plain}",), "approve it with --budget", id="plain approve of a budget request"
        ),
        pytest.param(
            ("{plain}", "--budget", "total=1/day", "--credential", "x"),
            "--credential does not go with --budget",
            id="--budget with --credential",
        ),
        pytest.param(
            ("{plain}", "--budget", "total=1/day", "--next", "2"),
            "--next does not go with --budget",
            id="--budget with --next",
        ),
        pytest.param(("{plain}", "--budget", "tokens=5"), "invalid --budget", id="a bad budget"),
        pytest.param(("{raise}", "--budget", "total=9/day"), "not pending", id="decided already"),
    ],
)
def test_cli_bad_budget_approvals_are_one_line_and_status_2(
    cli_round: Round, args: tuple[str, ...], says: str
) -> None:
    result = cli_round.cli.run(
        Call(("request", "approve", *(a.format(**cli_round.ids) for a in args)))
    )
    assert "Traceback" not in result.stderr
    assert (result.returncode, result.stdout) == (2, "")
    (line,) = result.stderr.splitlines()
    assert says in line
    store = cli_round.cli.store()
    try:
        (plain,) = [r for r in store.list_access_requests() if r.id == cli_round.ids["plain"]]
    finally:
        store.close()
    assert plain.state == "pending"


def test_approving_a_budget_request_keeps_the_grants_max_tokens_cap(
    budgeted: tuple[Store, int],
) -> None:
    """As `grant budget` does: raising a capped grant's budget never turns its cap off."""
    store, grant_id = budgeted
    store.set_grant_budget(grant_id, ["total=250/day"], True)
    request_id = _spent(store, grant_id)
    store.approve_budget_request(request_id, ["total=400/day"])
    (grant,) = store.list_grants()
    assert grant.budget is not None and "capped" in grant.budget
