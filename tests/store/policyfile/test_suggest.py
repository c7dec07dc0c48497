"""Suggestions against a real store: added from denials, narrowed to their use, unused listed,
and the file they make goes through plan and apply as it is."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from store.crypto import MasterKey, Secret
from store.policyfile import reconcile, suggest, suggestfile
from store.policyfile.evidence import Evidence
from store.policyfile.parse import load
from store.repository import Store
from store.rules.grammar import path_matches

T = datetime(2026, 12, 7, 10, tzinfo=UTC)
GH = "api.github.com"


@pytest.fixture
def agent(store: Store) -> Store:
    store.add_principal("agent")
    store.add_credential("github", "bearer", [GH], Secret(b"ghp_SUGGEST_secret"))
    return store


def _suggest(store: Store, evidence: Evidence, **kw: object) -> suggest.Suggestion:
    return suggest.suggest(reconcile.current(store.db), evidence, uses_read=True, **kw)  # type: ignore[arg-type]


def _evidence(store: Store) -> Evidence:
    return Evidence(g.id for g in reconcile.current(store.db).grants)


def _round_trip(store: Store, key: MasterKey, s: suggest.Suggestion, tmp_path: Path) -> None:
    path = tmp_path / "suggested.toml"
    path.write_text(suggestfile.render(s))
    reconcile.apply(store.db, key, load(path))
    assert reconcile.plan(store.db, key, load(path)).empty


def test_a_denied_burst_becomes_one_grant_with_the_credential_that_covers_the_host(
    agent: Store, key: MasterKey, tmp_path: Path
) -> None:
    evidence = _evidence(agent)
    for i in range(1, 6):
        evidence.deny(("agent", GH, 443, "GET", f"/repos/acme/app/issues/{i}"), T, "no-grant")
    evidence.deny(("agent", GH, 443, "DELETE", "/repos/acme/app"), T, "no-grant")  # once only
    s = _suggest(agent, evidence)
    (a,) = s.additions
    assert (a.credential, a.host, a.methods, a.paths) == (
        "github",
        GH,
        ("GET",),
        ("/repos/acme/app/issues/*",),
    )
    assert a.tally.count == 5 and a.tally.reasons == {"no-grant": 5}
    assert s.skipped["denials below --min-denials"] == 1
    text = suggestfile.render(s)
    assert '#   for example: "/repos/acme/app/issues/1"' in text
    _round_trip(agent, key, s, tmp_path)
    (grant,) = agent.list_grants()
    assert (grant.credential, grant.hosts, grant.methods) == ("github", [GH], ["GET"])
    (pattern,) = grant.paths
    assert path_matches(pattern, "/repos/acme/app/issues/3")
    assert not path_matches(pattern, "/repos/acme/app/pulls/3")
    assert not path_matches(pattern, "/repos/acme/app")


def test_methods_share_a_grant_only_when_their_paths_agree(agent: Store) -> None:
    evidence = _evidence(agent)
    for method in ("GET", "POST"):
        evidence.deny(("agent", GH, 443, method, "/a"), T, "no-grant", count=2)
    evidence.deny(("agent", GH, 443, "GET", "/b"), T, "no-grant", count=2)
    evidence.deny(("agent", GH, 443, "HEAD", "/a"), T, "no-grant", count=2)
    s = _suggest(agent, evidence)
    assert sorted((a.methods, a.paths) for a in s.additions) == [
        (("GET",), ("/a", "/b")),
        (("HEAD", "POST"), ("/a",)),
    ]


def test_no_host_is_suggested_that_no_denial_named_and_no_credential_means_pass_through(
    agent: Store, key: MasterKey, tmp_path: Path
) -> None:
    evidence = _evidence(agent)
    evidence.deny(("agent", "pypi.org", 443, "GET", "/simple/httpx/"), T, "no-grant", count=3)
    evidence.deny(("agent", "files.example", 8443, "GET", "/f"), T, "no-grant", count=3)
    s = _suggest(agent, evidence)
    assert sorted((a.host, a.credential) for a in s.additions) == [
        ("files.example:8443", None),
        ("pypi.org", None),
    ]
    assert "no credential covers this host" in suggestfile.render(s)
    _round_trip(agent, key, s, tmp_path)
    assert sorted(h for g in agent.list_grants() for h in g.hosts or []) == [
        "files.example:8443",
        "pypi.org",
    ]


def test_denials_a_grant_now_allows_and_unknown_principals_are_not_suggested(
    agent: Store,
) -> None:
    agent.add_grant("agent", ["GET"], credential="github", paths=["/repos/"])
    evidence = _evidence(agent)
    evidence.deny(("agent", GH, 443, "HEAD", "/repos/x"), T, "no-grant", count=4)
    evidence.deny(("ghost", GH, 443, "GET", "/x"), T, "no-grant", count=4)
    s = _suggest(agent, evidence)
    assert s.additions == ()
    assert s.skipped["denials an active grant now allows"] == 4
    assert s.skipped["denials of principals not in the store"] == 4


def test_an_over_wide_grant_is_narrowed_to_its_use_and_applies_in_place(
    agent: Store, key: MasterKey, tmp_path: Path
) -> None:
    wide = agent.add_grant(
        "agent", ["GET", "POST"], credential="github", paths=["/"], purpose="wide", once=False
    )
    evidence = _evidence(agent)
    for i in (1, 2, 3, 2):
        evidence.use(wide, "GET", f"/repos/acme/app/issues/{i}", T + timedelta(seconds=i))
    evidence.use(wide, "HEAD", "/repos/acme/app/issues/1", T)
    s = _suggest(agent, evidence)
    (cut,) = s.narrowings
    assert (cut.methods, cut.paths, cut.tally.count) == (
        ("GET",),
        ("/repos/acme/app/issues/*",),
        5,
    )
    _round_trip(agent, key, s, tmp_path)
    (grant,) = agent.list_grants()
    assert (grant.id, grant.methods, grant.paths, grant.purpose) == (
        wide,
        ["GET"],
        ["/repos/acme/app/issues/*"],
        "wide",  # everything but methods and paths kept
    )


def test_a_narrowing_never_goes_past_the_grant_it_narrows(agent: Store) -> None:
    listed = ["/x/1", "/x/2", "/x/3"]
    grant = agent.add_grant("agent", ["GET"], credential="github", paths=[*listed, "/y"])
    evidence = _evidence(agent)
    for path in listed:
        evidence.use(grant, "GET", path, T)
    # The rule would draw /x/*, which the grant does not allow: the paths themselves instead.
    (cut,) = _suggest(agent, evidence).narrowings
    assert cut.paths == tuple(listed)


def test_a_grant_whose_use_went_past_max_keys_is_not_narrowed(agent: Store) -> None:
    grant = agent.add_grant("agent", ["GET"], credential="github", paths=["/"])
    evidence = Evidence([grant], max_keys=1)
    evidence.use(grant, "GET", "/a", T)
    evidence.use(grant, "GET", "/b", T)
    s = _suggest(agent, evidence)
    assert s.narrowings == () and s.unused == ()
    assert s.skipped["grant with uses past --max-keys (not narrowed)"] == 1


def test_a_grant_used_on_a_path_no_pattern_can_write_is_not_narrowed(agent: Store) -> None:
    grant = agent.add_grant("agent", ["GET"], credential="github", paths=["/"])
    evidence = _evidence(agent)
    evidence.use(grant, "GET", "/a", T)
    evidence.use(grant, "GET", "/b/*", T)  # a literal star: it cannot be written, nor cut
    assert _suggest(agent, evidence).narrowings == ()


def test_an_unused_grant_is_listed_and_the_file_leaves_it_alone(
    agent: Store, key: MasterKey, tmp_path: Path
) -> None:
    idle = agent.add_grant("agent", ["GET"], credential="github", paths=["/old"])
    s = _suggest(agent, _evidence(agent))
    assert [g.id for g in s.unused] == [idle]
    text = suggestfile.render(s)
    assert f'#   grant "grant-{idle}" (grant {idle}): agent' in text
    path = tmp_path / "s.toml"
    path.write_text(text)
    plan = reconcile.plan(store_db := agent.db, key, load(path))
    assert plan.empty and f"grant grant-{idle}" in plan.untouched
    assert reconcile.current(store_db).grants[0].id == idle


def test_without_use_evidence_nothing_is_narrowed_or_listed(agent: Store) -> None:
    agent.add_grant("agent", ["GET"], credential="github", paths=["/"])
    s = suggest.suggest(reconcile.current(agent.db), _evidence(agent), uses_read=False)
    assert (s.narrowings, s.unused) == ((), ())
    assert "nothing to narrow, nothing listed as unused" in suggestfile.render(s)


def test_a_host_refused_at_connect_is_listed_never_granted(
    agent: Store, key: MasterKey, tmp_path: Path
) -> None:
    evidence = _evidence(agent)
    for _ in range(3):
        evidence.connect(("agent", "uploads.example", 443), T)
    evidence.connect(("agent", GH, 8443), T)
    s = _suggest(agent, evidence)
    assert s.additions == ()
    assert [(h.host, h.credentials, h.tally.count) for h in s.hosts] == [
        ("api.github.com:8443", (), 1),
        ("uploads.example", (), 3),
    ]
    text = suggestfile.render(s)
    assert '#   agent: "uploads.example", 3 CONNECTs' in text
    path = tmp_path / "s.toml"
    path.write_text(text)
    assert reconcile.plan(agent.db, key, load(path)).empty  # comments only: nothing applied


def test_nothing_from_a_path_reaches_the_file_unescaped_even_in_a_comment(
    agent: Store, key: MasterKey, tmp_path: Path
) -> None:
    # The audit reader refuses such a path; the file's writer escapes it all the same.
    hostile = (
        '/x"\n[[grant]]\nid = "evil"\nprincipal = "agent"\nhosts = ["evil.test"]\nmethods = ["GET"]'
    )
    evidence = _evidence(agent)
    evidence.deny(("agent", GH, 443, "GET", "/ok"), T, "no-grant", count=2)
    s = _suggest(agent, evidence)
    hacked = dataclasses.replace(
        s,
        additions=(dataclasses.replace(s.additions[0], examples=(hostile,)),),
    )
    path = tmp_path / "s.toml"
    path.write_text(suggestfile.render(hacked))
    policy = load(path)
    assert [g.key for g in policy.grants] == [s.additions[0].key] and policy.problems == ()
    assert "evil.test" not in [h for g in policy.grants for h in g.hosts]


@pytest.mark.parametrize(
    ("method", "path"),
    [
        pytest.param("GET", "/b", id="a path the grant does not allow (changed since, or forged)"),
        pytest.param("DELETE", "/a", id="a method the grant does not allow"),
    ],
)
def test_use_the_grant_could_not_have_allowed_never_moves_it_elsewhere(
    agent: Store, method: str, path: str
) -> None:
    grant = agent.add_grant("agent", ["GET", "POST"], credential="github", paths=["/a"])
    evidence = _evidence(agent)
    evidence.use(grant, method, path, T)
    s = _suggest(agent, evidence)
    assert s.narrowings == ()
    assert s.skipped["grants whose use the audit shows outside them (not narrowed)"] == 1


def test_a_wildcard_grant_used_on_one_host_is_narrowed_to_it(
    agent: Store, key: MasterKey, tmp_path: Path
) -> None:
    agent.add_credential("wild", "bearer", ["*.example.com"], Secret(b"wild-secret"))
    grant = agent.add_grant("agent", ["GET"], credential="wild", paths=["/v1/"])
    passing = agent.add_grant("agent", ["GET"], hosts=["a.example.org", "b.example.org"])
    evidence = _evidence(agent)
    evidence.use(grant, "GET", "/v1/x", T, ("eu.example.com", 443))
    evidence.use(passing, "GET", "/", T, ("b.example.org", 443))
    s = _suggest(agent, evidence)
    assert sorted((n.grant.id, n.hosts, n.paths) for n in s.narrowings) == [
        (grant, ("eu.example.com",), ("/v1/x",)),
        (passing, ("b.example.org",), ("/",)),
    ]
    assert '#   hosts: "the hosts of credential \\"wild\\"" -> "eu.example.com"' in (
        suggestfile.render(s)
    )
    _round_trip(agent, key, s, tmp_path)
    assert sorted(g.hosts or [] for g in agent.list_grants()) == [
        ["b.example.org"],
        ["eu.example.com"],
    ]


@pytest.mark.parametrize(
    "place",
    [
        pytest.param(("files.example", 80), id="plain http on a host named without its port"),
        pytest.param(None, id="a use whose host the evidence does not say"),
    ],
)
def test_hosts_are_kept_when_the_use_does_not_say_they_can_be_cut(
    agent: Store, place: tuple[str, int] | None
) -> None:
    grant = agent.add_grant("agent", ["GET"], hosts=["files.example", "other.example"])
    evidence = _evidence(agent)
    evidence.use(grant, "GET", "/", T, place)
    assert _suggest(agent, evidence).narrowings == ()
