"""Access requests: recorded by the proxy or asked for by an agent, decided by the owner."""

from __future__ import annotations

import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NamedTuple

import pytest
from mitmproxy.test import tflow

from addon.observe import audit
from addon.proxy.access import AccessRequests
from addon.proxy.live import LivePolicy
from store.crypto import Secret
from store.db.models import utcnow
from store.errors import InvalidInput, NotFound
from store.records import AccessRequestEntry
from store.repository import Store
from store.rules.grammar import HostPattern
from store.tables.access_requests import MAX_PENDING_PER_PRINCIPAL
from tests.clihelp import Call, Cli

SECRET = Secret(b"ghp_0123456789abcdef")
ISSUES = "/repos/acme/widgets/issues"


@pytest.fixture
def seeded(store: Store) -> Store:
    """Principals `agent` and `other`, and bearer credential `gh` on api.github.com."""
    store.add_principal("agent")
    store.add_principal("other")
    store.add_credential("gh", "bearer", ["api.github.com"], SECRET)
    return store


def _record(store: Store, **overrides: Any) -> int:
    args: dict[str, Any] = {
        "principal": "agent",
        "host": "api.github.com",
        "port": 443,
        "method": "POST",
        "path": ISSUES,
    } | overrides
    recorded = store.record_access_request(**args)
    assert recorded is not None
    request_id, state = recorded
    assert state == "pending"
    return request_id


def _request(store: Store, request_id: int) -> AccessRequestEntry:
    (found,) = [r for r in store.list_access_requests() if r.id == request_id]
    return found


# -- recording -------------------------------------------------------------------------


def test_a_repeated_denial_bumps_the_count_of_one_request(seeded: Store) -> None:
    first = _record(seeded)
    assert _record(seeded) == first
    (request,) = seeded.list_access_requests()
    assert (request.count, request.source, request.purpose) == (2, "auto", None)
    assert request.last_seen >= request.first_seen
    assert _record(seeded, method="GET") != first


def test_an_explicit_ask_for_a_pending_request_adds_its_purpose(seeded: Store) -> None:
    first = _record(seeded)
    again = _record(seeded, purpose="file the nightly report", explicit=True)
    assert again == first
    request = _request(seeded, first)
    assert (request.count, request.source) == (2, "explicit")
    assert request.purpose == "file the nightly report"


async def _ask_repeatedly(store: Store, times: int, **body: str) -> list[Any]:
    """`times` identical explicit asks through the proxy's endpoint, one after another."""
    live = LivePolicy(store)
    access = AccessRequests(live, audit.logger())
    writes = []
    record = store.record_access_request

    def counted(*args: Any) -> Any:
        writes.append(args)
        return record(*args)

    store.record_access_request = counted  # type: ignore[method-assign]
    ask = {"host": "api.github.com", "method": "POST", "path": ISSUES} | body
    replies = []
    try:
        for _ in range(times):
            flow = tflow.tflow()
            flow.request.method = "POST"
            flow.request.content = json.dumps(ask).encode()
            replies.append(await access.handle(flow, "agent", "/access-requests"))
    finally:
        live.close()
    return [(r.status_code, json.loads(r.content)) for r in replies] + [len(writes)]


async def test_identical_explicit_asks_make_one_store_write_per_window(seeded: Store) -> None:
    *replies, writes = await _ask_repeatedly(seeded, 12, purpose="file the report")
    assert writes == 1
    (first_status, first), *rest = replies
    assert first_status == 202
    assert all(reply == (202, {"id": first["id"], "state": "pending"}) for reply in rest)
    (request,) = seeded.list_access_requests()
    assert (request.id, request.count, request.source) == (first["id"], 1, "explicit")


async def test_a_refused_explicit_ask_is_not_remembered(seeded: Store) -> None:
    *replies, writes = await _ask_repeatedly(seeded, 3, purpose="two\nlines")
    assert [status for status, _ in replies] == [400, 400, 400]
    assert writes == 3
    assert seeded.list_access_requests() == []


def test_a_decided_request_is_not_reused(seeded: Store) -> None:
    first = _record(seeded)
    seeded.deny_access_request(first)
    second = _record(seeded)
    assert second != first
    assert [r.state for r in seeded.list_access_requests()] == ["denied", "pending"]


def test_pending_requests_are_capped_per_principal(seeded: Store) -> None:
    ids = [_record(seeded, path=f"/p/{i}") for i in range(MAX_PENDING_PER_PRINCIPAL)]
    assert seeded.record_access_request("agent", "api.github.com", 443, "POST", "/p/new") is None
    # A repeat of a pending request is still counted; another principal is not limited.
    assert _record(seeded, path="/p/0") == ids[0]
    _record(seeded, principal="other", path="/p/new")
    assert len(seeded.list_access_requests("pending")) == MAX_PENDING_PER_PRINCIPAL + 1
    # A decision makes room.
    seeded.deny_access_request(ids[0])
    _record(seeded, path="/p/new")


def test_recording_is_no_policy_change_but_a_decision_is(seeded: Store) -> None:
    counter = seeded.change_counter()
    request_id = _record(seeded)
    _record(seeded)
    _record(seeded, purpose="why", explicit=True)
    assert seeded.change_counter() == counter
    # Proxies reload on a denial too, to write its audit line.
    seeded.deny_access_request(request_id, "no")
    assert seeded.change_counter() == counter + 1


def test_an_unknown_or_removed_principal_is_not_found(seeded: Store) -> None:
    with pytest.raises(NotFound, match="'nobody'"):
        _record(seeded, principal="nobody")
    seeded.remove_principal("other")
    with pytest.raises(NotFound, match="'other'"):
        _record(seeded, principal="other")


BAD_REQUESTS = [
    pytest.param({"method": "post"}, "invalid method", id="a lower-case method is refused"),
    pytest.param({"method": "*"}, "one method", id="the any-method wildcard is refused"),
    pytest.param({"port": 0}, "invalid port", id="port 0 is refused"),
    pytest.param({"port": 65536}, "invalid port", id="a port above 65535 is refused"),
    pytest.param({"path": "repos"}, "invalid path", id="a path without a leading slash"),
    pytest.param({"path": "/" + "a" * 2048}, "invalid path", id="a path over 2048 characters"),
    pytest.param({"path": "/a\x1b[2J"}, "invalid path", id="a path with an escape sequence"),
    pytest.param({"path": "/a b"}, "invalid path", id="a path with a space"),
    pytest.param({"path": "/caf\u00e9"}, "invalid path", id="a path that is not ASCII"),
    pytest.param({"purpose": "x" * 1001}, "invalid purpose", id="a purpose over 1000 characters"),
    pytest.param(
        {"purpose": "ok\nAPPROVED by admin"}, "invalid purpose", id="a purpose of two lines"
    ),
    pytest.param(
        {"purpose": "abc\u202edcba"}, "invalid purpose", id="a purpose with a bidi override"
    ),
    pytest.param(
        {"host": "*.github.com", "explicit": True}, "invalid host", id="an asked-for wildcard"
    ),
    pytest.param(
        {"host": "api.github.com:8443", "explicit": True},
        "invalid host",
        id="an asked-for host with a port in it",
    ),
    pytest.param(
        {"host": "API.github.com", "explicit": True},
        "invalid host",
        id="an asked-for upper-case host",
    ),
    pytest.param(
        {"host": "exa mple.com", "explicit": True},
        "invalid host",
        id="an asked-for host with a space",
    ),
    pytest.param(
        {"host": "::0:1", "explicit": True},
        "invalid host",
        id="an asked-for IPv6 address not in canonical form",
    ),
]


@pytest.mark.parametrize(("overrides", "says"), BAD_REQUESTS)
def test_a_malformed_request_is_refused_and_not_stored(
    seeded: Store, overrides: dict[str, Any], says: str
) -> None:
    with pytest.raises(InvalidInput, match=says):
        _record(seeded, **overrides)
    assert seeded.list_access_requests() == []


def test_an_asked_for_ipv6_host_is_approved_in_brackets(seeded: Store) -> None:
    request_id = _record(seeded, host="2001:db8::1", port=8443, explicit=True, purpose="x")
    grant_id = seeded.approve_access_request(request_id)
    (grant,) = seeded.list_grants()
    assert (grant.id, grant.hosts) == (grant_id, ["[2001:db8::1]:8443"])


# -- reading ---------------------------------------------------------------------------


def test_a_principal_reads_only_its_own_requests(seeded: Store) -> None:
    mine = _record(seeded)
    theirs = _record(seeded, principal="other")
    request = seeded.get_access_request("agent", mine)
    assert request is not None
    assert (request.principal, request.state, request.path) == ("agent", "pending", ISSUES)
    assert seeded.get_access_request("agent", theirs) is None
    assert seeded.get_access_request("other", mine) is None
    assert seeded.get_access_request("agent", 10_000) is None


def test_a_removed_principal_reads_nothing(seeded: Store) -> None:
    request_id = _record(seeded, principal="other")
    seeded.remove_principal("other")
    assert seeded.get_access_request("other", request_id) is None


def test_the_list_filters_by_state(seeded: Store) -> None:
    pending, denied, approved = (_record(seeded, path=f"/p/{i}") for i in range(3))
    seeded.deny_access_request(denied)
    seeded.approve_access_request(approved, credential="gh")
    assert [r.id for r in seeded.list_access_requests()] == [pending, denied, approved]
    assert [r.id for r in seeded.list_access_requests("pending")] == [pending]
    assert [r.id for r in seeded.list_access_requests("denied")] == [denied]
    assert [r.id for r in seeded.list_access_requests("approved")] == [approved]
    with pytest.raises(InvalidInput, match="invalid state"):
        seeded.list_access_requests("open")


# -- approving -------------------------------------------------------------------------


def test_approval_creates_a_working_grant_and_links_it(seeded: Store) -> None:
    request_id = _record(seeded, purpose="file issues", explicit=True)
    counter = seeded.change_counter()
    grant_id = seeded.approve_access_request(request_id, credential="gh")
    assert seeded.change_counter() == counter + 1
    (grant,) = seeded.snapshot().grants
    assert grant.id == grant_id
    assert (grant.principal, grant.credential) == ("agent", "gh")
    assert grant.hosts == (HostPattern("api.github.com"),)
    assert (grant.methods, grant.paths) == (frozenset({"POST"}), (ISSUES,))
    assert (grant.once, grant.websocket, grant.expires_at) == (False, False, None)
    request = _request(seeded, request_id)
    assert (request.state, request.grant_id) == ("approved", grant_id)
    assert request.decided_at is not None
    (listed,) = seeded.list_grants()
    assert listed.purpose == f"access request {request_id}: file issues"


def test_approval_can_narrow_the_path_and_the_lifetime(seeded: Store) -> None:
    once = _record(seeded)
    timed = _record(seeded, method="GET", path="/repos/acme")
    expires = utcnow() + timedelta(hours=2)
    seeded.approve_access_request(once, credential="gh", path=f"{ISSUES}/1", once=True)
    seeded.approve_access_request(timed, credential="gh", path="/repos/acme/", expires_at=expires)
    by_method = {next(iter(g.methods)): g for g in seeded.snapshot().grants}
    assert (by_method["POST"].paths, by_method["POST"].once) == ((f"{ISSUES}/1",), True)
    assert (by_method["GET"].paths, by_method["GET"].expires_at) == (("/repos/acme/",), expires)


def test_a_requested_path_holding_an_encoded_slash_is_approved_as_a_literal(
    seeded: Store,
) -> None:
    request_id = _record(seeded, method="GET", path="/api/v4/projects/group%2Fproject")
    seeded.approve_access_request(request_id, credential="gh")
    (grant,) = seeded.snapshot().grants
    assert (grant.paths, grant.encoded_slash) == (("/api/v4/projects/group%2Fproject",), False)


def test_approval_without_a_credential_names_the_host_and_port(seeded: Store) -> None:
    request_id = _record(seeded, host="example.com", port=8443, method="GET", path="/")
    seeded.approve_access_request(request_id)
    (grant,) = seeded.snapshot().grants
    assert (grant.credential, grant.hosts) == (None, (HostPattern("example.com", 8443),))


def _unchanged(store: Store) -> tuple[Any, ...]:
    return store.change_counter(), store.list_grants(), store.list_access_requests()


FAILED_APPROVALS = [
    pytest.param(
        {"host": "evil.example.net"},
        {"credential": "gh"},
        "outside",
        id="a host outside the credential's hosts",
    ),
    pytest.param(
        {"port": 8443},
        {"credential": "gh"},
        "outside",
        id="a port the credential is not for",
    ),
    pytest.param({}, {"credential": "nope"}, "'nope'", id="an unknown credential"),
    pytest.param(
        {},
        {"credential": "gh", "path": "repos"},
        "invalid path pattern",
        id="a --path that is no path pattern",
    ),
    pytest.param(
        {"path": "/a/%2E%2E"},
        {"credential": "gh"},
        "invalid path pattern",
        id="an escaped path, which only a --path can approve",
    ),
    pytest.param(
        {"path": "/repos/*/issues"},
        {"credential": "gh"},
        "'\\*' segment",
        id="a '*' segment, which a grant would read as a wildcard",
    ),
    pytest.param(
        {},
        {"credential": "gh", "expires_at": utcnow() - timedelta(seconds=1)},
        "past",
        id="an expiry in the past",
    ),
]


@pytest.mark.parametrize(("recorded", "approval", "says"), FAILED_APPROVALS)
def test_a_failed_approval_leaves_the_request_pending_and_no_grant(
    seeded: Store, recorded: dict[str, Any], approval: dict[str, Any], says: str
) -> None:
    request_id = _record(seeded, **recorded)
    before = _unchanged(seeded)
    with pytest.raises((InvalidInput, NotFound), match=says):
        seeded.approve_access_request(request_id, **approval)
    assert _unchanged(seeded) == before
    assert _request(seeded, request_id).state == "pending"


def test_a_request_is_decided_once(seeded: Store) -> None:
    approved, denied = _record(seeded), _record(seeded, method="GET")
    grant_id = seeded.approve_access_request(approved, credential="gh")
    seeded.deny_access_request(denied, "not needed")
    before = _unchanged(seeded)
    with pytest.raises(InvalidInput, match=f"request {approved} is approved, not pending"):
        seeded.approve_access_request(approved, credential="gh")
    with pytest.raises(InvalidInput, match=f"request {approved} is approved, not pending"):
        seeded.deny_access_request(approved)
    with pytest.raises(InvalidInput, match=f"request {denied} is denied, not pending"):
        seeded.approve_access_request(denied, credential="gh")
    with pytest.raises(InvalidInput, match=f"request {denied} is denied, not pending"):
        seeded.deny_access_request(denied)
    assert _unchanged(seeded) == before
    assert [g.id for g in seeded.list_grants()] == [grant_id]


def test_an_unknown_request_is_not_found(seeded: Store) -> None:
    with pytest.raises(NotFound, match="no access request with id 42"):
        seeded.approve_access_request(42, credential="gh")
    with pytest.raises(NotFound, match="no access request with id 42"):
        seeded.deny_access_request(42)


# -- denying ---------------------------------------------------------------------------


def test_denial_records_the_reason(seeded: Store) -> None:
    request_id = _record(seeded)
    seeded.deny_access_request(request_id, "use the read-only token")
    request = _request(seeded, request_id)
    assert (request.state, request.decision_reason) == ("denied", "use the read-only token")
    assert (request.grant_id, request.decided_at is not None) == (None, True)
    assert seeded.snapshot().grants == ()


def test_a_reason_is_one_printable_line(seeded: Store) -> None:
    request_id = _record(seeded)
    with pytest.raises(InvalidInput, match="invalid reason"):
        seeded.deny_access_request(request_id, "no\x1b[1A")
    assert _request(seeded, request_id).state == "pending"


def test_removing_a_principal_denies_its_pending_requests(seeded: Store) -> None:
    approved, pending = _record(seeded), _record(seeded, method="GET")
    theirs = _record(seeded, principal="other")
    seeded.approve_access_request(approved, credential="gh")
    seeded.remove_principal("agent")
    states = {r.id: (r.state, r.decision_reason) for r in seeded.list_access_requests()}
    assert states == {
        approved: ("approved", None),
        pending: ("denied", "principal removed"),
        theirs: ("pending", None),
    }


# -- the CLI ---------------------------------------------------------------------------


@dataclass
class Round:
    cli: Cli
    ids: dict[str, int]
    approved: dict[str, Any]
    denied: dict[str, Any]
    listed: list[dict[str, Any]]
    pending: list[dict[str, Any]]
    table: str
    grants: list[dict[str, Any]]


def _store_state(cli: Cli) -> tuple[Any, ...]:
    store = cli.store()
    try:
        return _unchanged(store)
    finally:
        store.close()


@pytest.fixture(scope="module")
def cli_round(tmp_path_factory: pytest.TempPathFactory) -> Round:
    """An operator's store with four requests; one approved and one denied through the CLI."""
    cli = Cli(tmp_path_factory.mktemp("requests"))
    cli.ok(Call(("init",)))
    cli.ok(
        Call(("principal", "add", "agent")),
        Call(
            ("credential", "add", "gh", "--scheme", "bearer", "--host", "api.github.com"),
            b"ghp_secret\n",
        ),
    )
    store = cli.store()
    try:
        ids = {
            name: _record(store, path=f"/repos/acme/{name}", purpose=name, explicit=True)
            for name in ("approve", "deny", "pending")
        }
        ids["outside"] = _record(store, host="evil.example.net")
    finally:
        store.close()
    approved, denied = cli.ok(
        Call(
            (
                "request",
                "approve",
                str(ids["approve"]),
                "--credential",
                "gh",
                "--expires",
                "2h",
                "--json",
            )
        ),
        Call(("request", "deny", str(ids["deny"]), "--reason", "not this one", "--json")),
    )
    listed, pending, table, grants = cli.ok(
        Call(("request", "list", "--json")),
        Call(("request", "list", "--state", "pending", "--json")),
        Call(("request", "list")),
        Call(("grant", "list", "--json")),
    )
    return Round(
        cli=cli,
        ids=ids,
        approved=json.loads(approved),
        denied=json.loads(denied),
        listed=json.loads(listed),
        pending=json.loads(pending),
        table=table,
        grants=json.loads(grants),
    )


def test_cli_approve_prints_the_request_and_its_new_grant(cli_round: Round) -> None:
    (grant,) = cli_round.grants
    assert cli_round.approved == {
        "id": cli_round.ids["approve"],
        "grant_id": grant["id"],
        "state": "approved",
        "kind": "access",
    }
    assert (grant["principal"], grant["credential"], grant["hosts"]) == (
        "agent",
        "gh",
        ["api.github.com"],
    )
    assert (grant["methods"], grant["paths"]) == (["POST"], ["/repos/acme/approve"])
    assert grant["expires_at"] is not None


def test_cli_deny_and_list_show_the_decisions(cli_round: Round) -> None:
    ids = cli_round.ids
    assert cli_round.denied == {"id": ids["deny"], "state": "denied"}
    listed = {r["id"]: r for r in cli_round.listed}
    assert listed[ids["approve"]]["grant_id"] == cli_round.approved["grant_id"]
    assert (listed[ids["deny"]]["state"], listed[ids["deny"]]["decision_reason"]) == (
        "denied",
        "not this one",
    )
    assert [r["id"] for r in cli_round.pending] == [ids["pending"], ids["outside"]]
    header, *rows = cli_round.table.splitlines()
    assert header.split()[:3] == ["id", "principal", "method"]
    assert len(rows) == 4


class Bad(NamedTuple):
    args: tuple[str, ...]  # "{deny}" stands for the id of the request named "deny"
    says: tuple[str, ...]


BAD_INPUT = {
    "an unknown request": Bad(
        ("request", "approve", "999", "--credential", "gh"), ("no access request with id 999",)
    ),
    "approving a denied request": Bad(
        ("request", "approve", "{deny}", "--credential", "gh"), ("is denied, not pending",)
    ),
    "approving an approved request again": Bad(
        ("request", "approve", "{approve}", "--credential", "gh"), ("is approved, not pending",)
    ),
    "denying an approved request": Bad(
        ("request", "deny", "{approve}"), ("is approved, not pending",)
    ),
    "--once with --expires": Bad(
        ("request", "approve", "{pending}", "--once", "--expires", "1h"), ("not allowed with",)
    ),
    "a host outside the credential's hosts": Bad(
        ("request", "approve", "{outside}", "--credential", "gh"), ("outside", "evil.example.net")
    ),
    "a --path that is no path pattern": Bad(
        ("request", "approve", "{pending}", "--credential", "gh", "--path", "a"),
        ("invalid path pattern",),
    ),
    "an expiry in the past": Bad(
        ("request", "approve", "{pending}", "--expires", "2000-01-01T00:00:00Z"), ("past",)
    ),
    "an id that is no number": Bad(("request", "deny", "seven"), ("must be a whole number",)),
    "an unknown state": Bad(("request", "list", "--state", "open"), ("invalid choice",)),
}


@dataclass
class BadRound:
    results: dict[str, subprocess.CompletedProcess[str]]
    before: tuple[Any, ...]
    after: tuple[Any, ...]


@pytest.fixture(scope="module")
def bad_round(cli_round: Round) -> BadRound:
    """Every bad command, run concurrently after the good ones."""
    cli = cli_round.cli
    before = _store_state(cli)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        futures = {
            name: pool.submit(cli.run, Call(tuple(a.format(**cli_round.ids) for a in bad.args)))
            for name, bad in BAD_INPUT.items()
        }
        results = {name: f.result() for name, f in futures.items()}
    return BadRound(results, before, _store_state(cli))


@pytest.mark.parametrize("name", [pytest.param(n, id=n) for n in BAD_INPUT])
def test_cli_bad_input_is_one_line_and_status_2(bad_round: BadRound, name: str) -> None:
    result = bad_round.results[name]
    assert "Traceback" not in result.stderr
    assert (result.returncode, result.stdout) == (2, "")
    (line,) = result.stderr.splitlines()
    assert line.startswith("credproxy")
    for phrase in BAD_INPUT[name].says:
        assert phrase in line


def test_cli_bad_input_changes_nothing(bad_round: BadRound) -> None:
    assert bad_round.after == bad_round.before
    _, grants, requests = bad_round.after
    assert len(grants) == 1
    assert [r.state for r in requests] == ["approved", "denied", "pending", "pending"]
