"""The pure decision: compiled grants + request facts -> Decision."""

from __future__ import annotations

import hmac
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import addon.core.policy as policy_module
from addon.core.policy import Policy, Request, Rule
from addon.core.reasons import Reason
from store.records import TOMBSTONE_RETENTION as RETENTION
from store.records import GrantRecord
from store.rules import bodyrules
from store.rules.grammar import parse_host
from tests.fakes import CRED, NOW, grant, policy, snapshot_policy


def req(host="api.test", port=443, scheme="https", method="GET", path="/v1/x", upgrade=False):
    return Request(host, port, scheme, method, path, upgrade)


@pytest.mark.parametrize(
    ("grants", "request_", "expected"),
    [
        pytest.param([grant(1)], req(), 1, id="allow a granted method and path"),
        pytest.param([grant(1)], req(host="other.test"), Reason.NO_GRANT, id="deny another host"),
        pytest.param([grant(1)], req(port=8443), Reason.NO_GRANT, id="deny another port"),
        pytest.param(
            [grant(1)], req(method="POST"), Reason.METHOD_NOT_ALLOWED, id="deny another method"
        ),
        pytest.param(
            [grant(1)],
            req(method="get"),
            Reason.METHOD_NOT_ALLOWED,
            id="methods are case-sensitive",
        ),
        pytest.param(
            [grant(1)],
            req(path="/v1"),
            Reason.PATH_NOT_ALLOWED,
            id="trailing slash pattern is strictly below",
        ),
        pytest.param(
            [grant(1)], req(path="/v1x/a"), Reason.PATH_NOT_ALLOWED, id="prefix is segment-bounded"
        ),
        pytest.param(
            [grant(1)], req(path="/V1/x"), Reason.PATH_NOT_ALLOWED, id="paths are case-sensitive"
        ),
        pytest.param(
            [grant(1, methods=("*",))], req(method="PATCH"), 1, id="star allows every method"
        ),
        pytest.param(
            [grant(1, hosts=("*.wild.test",))],
            req(host="x.wild.test"),
            1,
            id="wildcard matches one label",
        ),
        pytest.param(
            [grant(1, hosts=("*.wild.test",))],
            req(host="a.b.wild.test"),
            Reason.NO_GRANT,
            id="wildcard matches only one label",
        ),
        pytest.param(
            [grant(1, hosts=("*.wild.test",))],
            req(host="wild.test"),
            Reason.NO_GRANT,
            id="wildcard does not match its base",
        ),
        pytest.param(
            [grant(1, hosts=("other.test",))],
            req(host="other.test"),
            Reason.NO_GRANT,
            id="credential hosts bound the grant",
        ),
        pytest.param(
            [grant(1)],
            req(scheme="http", port=80),
            Reason.INSECURE_SCHEME,
            id="never stamp onto cleartext",
        ),
        pytest.param(
            [grant(1, cred=False, hosts=("plain.test",))],
            req(host="plain.test", scheme="http", port=80),
            1,
            id="pass-through grant over http",
        ),
        pytest.param(
            [grant(1, expires=NOW - timedelta(seconds=1))],
            req(),
            Reason.GRANT_EXPIRED,
            id="expired grant",
        ),
        pytest.param(
            [grant(1, expires=NOW + timedelta(seconds=1))], req(), 1, id="grant before expiry"
        ),
        pytest.param(
            [grant(1, once=True, paths=("/v1/x",)), grant(2, paths=("/v2/",))],
            req(),
            1,
            id="an unused once-grant serves beside a grant on another path",
        ),
        pytest.param(
            [
                replace(grant(1, once=True, paths=("/v1/x",)), consumed=True),
                grant(2, paths=("/v2/",)),
            ],
            req(),
            Reason.GRANT_CONSUMED,
            id="a used once-grant says so beside a grant on another path",
        ),
        pytest.param(
            [grant(1, expires=NOW - timedelta(seconds=1)), grant(2, paths=("/v2/",))],
            req(),
            Reason.GRANT_EXPIRED,
            id="an expired grant says so beside a grant on another path",
        ),
        pytest.param(
            [grant(1, expires=NOW - timedelta(seconds=1)), grant(2, methods=("POST",))],
            req(),
            Reason.GRANT_EXPIRED,
            id="an expired grant says so beside a grant for another method",
        ),
        pytest.param(
            [
                grant(1, expires=NOW - timedelta(seconds=1), paths=("/v2/",)),
                grant(2, methods=("POST",)),
            ],
            req(),
            Reason.PATH_NOT_ALLOWED,
            id="an expired grant on another path does not speak for this one",
        ),
        pytest.param(
            [grant(1, expires=NOW - RETENTION)],
            req(),
            Reason.NO_GRANT,
            id="a grant expired longer than the retention is forgotten",
        ),
        pytest.param(
            [grant(1)],
            req(upgrade=True),
            Reason.UPGRADE_NOT_ALLOWED,
            id="upgrade needs a websocket grant",
        ),
        pytest.param(
            [grant(1, websocket=True)], req(upgrade=True), 1, id="websocket grant allows upgrade"
        ),
        pytest.param(
            [grant(1, once=True), grant(2)],
            req(),
            2,
            id="a standing grant is preferred over a once-grant",
        ),
        pytest.param(
            [grant(1, paths=("/",)), grant(2, paths=("/v1/x",))],
            req(),
            2,
            id="the most specific path wins",
        ),
        pytest.param(
            [grant(1, principal="b")],
            req(),
            Reason.NO_GRANT,
            id="another principal's grant does not apply",
        ),
        pytest.param([grant(1)], req(method="HEAD"), 1, id="a GET grant allows HEAD"),
        pytest.param(
            [grant(1, methods=("HEAD",))],
            req(method="GET"),
            Reason.METHOD_NOT_ALLOWED,
            id="a HEAD grant does not allow GET",
        ),
        pytest.param(
            [grant(1, methods=("POST",))],
            req(method="HEAD"),
            Reason.METHOD_NOT_ALLOWED,
            id="a grant without GET does not allow HEAD",
        ),
        pytest.param(
            [grant(1)],
            req(method="OPTIONS"),
            Reason.METHOD_NOT_ALLOWED,
            id="a GET grant allows no other method",
        ),
        pytest.param(
            [grant(1)], req(method="head"), Reason.METHOD_NOT_ALLOWED, id="HEAD is case-sensitive"
        ),
        pytest.param(
            [grant(1, paths=("/v1/*",))],
            req(path="/v1/@s%2Fn"),
            Reason.PATH_NOT_ALLOWED,
            id="a star skips a segment holding an encoded slash",
        ),
        pytest.param(
            [grant(1, paths=("/v1/*",), encoded_slash=True)],
            req(path="/v1/@s%2Fn"),
            1,
            id="a star of an opted-in grant matches a segment holding an encoded slash",
        ),
        pytest.param(
            [grant(1, paths=("/v1/@s%2Fn",))],
            req(path="/v1/@s%2Fn"),
            1,
            id="a literal encoded slash in the pattern matches",
        ),
        pytest.param(
            [grant(1, paths=("/v1/@s/n",), encoded_slash=True)],
            req(path="/v1/@s%2Fn"),
            Reason.PATH_NOT_ALLOWED,
            id="an encoded slash is never a separator, opted in or not",
        ),
        pytest.param(
            [grant(1, paths=("/v1/*",)), grant(2, paths=("/v1/*",), encoded_slash=True)],
            req(path="/v1/@s%2Fn"),
            2,
            id="only the opted-in grant of two serves an encoded slash",
        ),
    ],
)
def test_decide(grants, request_, expected):
    decision = policy(*grants).decide("a", request_, NOW)
    if isinstance(expected, int):
        assert decision.allowed and decision.rule is not None
        assert decision.rule.grant_id == expected
    else:
        assert not decision.allowed and decision.reason is expected


def test_connect_gate_names_host_and_port():
    p = policy(grant(1), grant(2, hosts=("*.wild.test",)))
    assert p.may_connect("a", "api.test", 443)
    assert p.may_connect("a", "x.wild.test", 443)
    assert not p.may_connect("a", "api.test", 8443)
    assert not p.may_connect("a", "evil.test", 443)
    assert not p.may_connect("b", "api.test", 443)


def test_authenticate_compares_tokens():
    p = policy()
    assert p.authenticate("a", "tok-a")
    assert not p.authenticate("a", "tok-b")
    assert not p.authenticate("nobody", "tok-a")


def test_connect_gate_admits_spent_grants_so_the_request_gets_the_reason():
    p = policy(grant(1, once=True), grant(2, hosts=("*.wild.test",), expires=NOW))
    assert p.may_connect("a", "api.test", 443)
    assert p.may_connect("a", "x.wild.test", 443)


def reference_decide(p: Policy, principal: str, request: Request, now: datetime) -> Any:
    """The decision as the issue states it, stage by stage, each stage filtering the last:
    the model that Policy.decide's single pass must agree with."""
    rules = p._principals.get(principal)
    matching = rules.candidates(request.host, request.port, request.scheme) if rules else ()
    if not matching:
        return None  # decided before the stages; covered by the table above
    # Expired and used grants are tombstones, checked last: one that would have served the
    # request names its state. One expired longer than the retention is forgotten.
    stages = [
        (Reason.NO_GRANT, lambda r: r.expires_at is None or r.expires_at > now - RETENTION),
        (Reason.METHOD_NOT_ALLOWED, lambda r: allows(r.methods, request.method)),
        (Reason.PATH_NOT_ALLOWED, lambda r: r.longest_path(request.path) >= 0),
        (Reason.UPGRADE_NOT_ALLOWED, lambda r: not request.upgrade or r.websocket),
        (Reason.INSECURE_SCHEME, lambda r: request.scheme == "https" or r.credential is None),
        (Reason.GRANT_EXPIRED, lambda r: r.expires_at is None or r.expires_at > now),
        (Reason.GRANT_CONSUMED, lambda r: not r.consumed),
    ]
    left = list(matching)
    for reason, keep in stages:
        left = [r for r in left if keep(r)]
        if not left:
            return reason
    rule = min(
        left,
        key=lambda r: (r.once, -r.longest_path(request.path), r.credential is None, r.grant_id),
    )
    return rule.grant_id


def allows(methods: frozenset[str] | None, method: str) -> bool:
    """The method stage as the README states it: exact, '*' for all, GET allows HEAD."""
    if methods is None:
        return True
    return method in methods or (method == "HEAD" and "GET" in methods)


grant_records = st.builds(
    lambda gid, methods, paths, cred, once, ws, expires, consumed, slash: replace(
        grant(gid, methods=methods, paths=paths, cred=cred, once=once, websocket=ws),
        expires_at=expires,
        consumed=consumed,
        encoded_slash=slash,
    ),
    st.integers(1, 10**6),
    st.sampled_from([("GET",), ("GET", "POST"), ("*",), ("DELETE",), ("HEAD",)]),
    st.lists(
        st.sampled_from(["/", "/v1/", "/v1/x", "/v1/*/y", "/v2", "/v1/a%2Fb"]),
        min_size=1,
        max_size=3,
    ),
    st.booleans(),
    st.booleans(),
    st.booleans(),
    st.sampled_from(
        [
            None,
            NOW - RETENTION,
            NOW - RETENTION + timedelta(seconds=1),
            NOW - timedelta(seconds=1),
            NOW,
            NOW + timedelta(seconds=1),
        ]
    ),
    st.booleans(),
    st.booleans(),
)


@settings(max_examples=400, deadline=None)
@given(
    st.lists(grant_records, min_size=1, max_size=5, unique_by=lambda g: g.id),
    st.sampled_from(["GET", "POST", "DELETE", "HEAD"]),
    st.sampled_from(["/", "/v1/x", "/v1/a/y", "/v2", "/v3", "/v1/a%2Fb/y", "/v1/a%2Fb"]),
    st.sampled_from(["https", "http"]),
    st.booleans(),
)
def test_the_single_pass_decides_like_the_stage_by_stage_model(
    grants: list[GrantRecord], method: str, path: str, scheme: str, upgrade: bool
) -> None:
    p = policy(*grants)
    request = req(scheme=scheme, method=method, path=path, upgrade=upgrade)
    expected = reference_decide(p, "a", request, NOW)
    decision = p.decide("a", request, NOW)
    if expected is None:
        return
    if isinstance(expected, Reason):
        assert (decision.allowed, decision.reason) == (False, expected)
    else:
        assert decision.allowed and decision.rule is not None
        assert decision.rule.grant_id == expected


# -- authentication -----------------------------------------------------------------------


def test_tokens_are_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    p = snapshot_policy()
    assert p.authenticate("a", "tok-a")
    assert calls, "the token was not compared with hmac.compare_digest"
    calls.clear()
    assert not p.authenticate("nobody", "tok-a")
    assert calls, "an unknown name must cost a comparison too (no timing oracle on names)"


def test_an_unknown_name_never_authenticates_whatever_the_comparison_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(policy_module, "token_matches", lambda token, token_hash: True)
    assert not snapshot_policy().authenticate("nobody", "anything")


# -- no credential over cleartext, once, expiry, ranking, the candidates cache ------------


def test_decide_never_stamps_onto_cleartext_even_when_the_port_matches() -> None:
    decision = policy(grant(1, hosts=("api.test:443",))).decide(
        "a", req(scheme="http", port=443), NOW
    )
    assert not decision.allowed and decision.reason is Reason.INSECURE_SCHEME


def test_a_credentials_bare_host_means_port_443_even_for_http() -> None:
    # The grant's bare host means port 80 for http; the credential's bare host is 443 only.
    rule = Rule(
        grant_id=1,
        credential=CRED,
        hosts=(parse_host("api.test"),),
        methods=None,
        paths=("/",),
        once=False,
        websocket=False,
        expires_at=None,
    )
    assert rule.allows_host("api.test", 443, "https")
    assert not rule.allows_host("api.test", 80, "http")


def test_a_consumed_once_grant_is_refused_from_the_snapshot() -> None:
    decision = policy(replace(grant(1, once=True), consumed=True)).decide("a", req(), NOW)
    assert not decision.allowed and decision.reason is Reason.GRANT_CONSUMED


def test_a_grant_expiring_now_is_expired() -> None:
    decision = policy(grant(1, expires=NOW)).decide("a", req(), NOW)
    assert not decision.allowed and decision.reason is Reason.GRANT_EXPIRED
    later = policy(grant(1, expires=NOW + timedelta(microseconds=1))).decide("a", req(), NOW)
    assert later.allowed


def test_the_longest_matching_pattern_of_a_grant_ranks_it() -> None:
    # Grant 1's best match (/v1/x, 5 chars) beats grant 2's /v1/ (4); ranking by any other
    # pattern of grant 1 (its "/") would pick grant 2.
    p = policy(grant(1, paths=("/", "/v1/x")), grant(2, paths=("/v1/",)))
    decision = p.decide("a", req(path="/v1/x"), NOW)
    assert decision.allowed and decision.rule is not None and decision.rule.grant_id == 1


def test_the_candidates_cache_keeps_hosts_ports_schemes_and_principals_apart() -> None:
    p = policy(
        grant(1, hosts=("api.test",)),
        grant(2, cred=False, hosts=("plain.test",), paths=("/",), principal="b"),
    )
    # Warm the cache with one decision, then ask what must differ from it.
    assert p.decide("a", req(), NOW).allowed
    assert p.decide("a", req(host="other.test"), NOW).reason is Reason.NO_GRANT
    assert p.decide("a", req(port=8443), NOW).reason is Reason.NO_GRANT
    assert p.decide("a", req(scheme="http", port=443), NOW).reason is Reason.INSECURE_SCHEME
    assert p.decide("b", req(host="plain.test", scheme="http", port=80), NOW).allowed
    assert p.decide("b", req(host="plain.test", port=443), NOW).allowed
    # plain.test means port 443 for https but port 80 for http: the cached https answer
    # must not let cleartext through on 443.
    assert not p.decide("b", req(host="plain.test", scheme="http", port=443), NOW).allowed
    assert p.decide("a", req(host="plain.test", port=443), NOW).reason is Reason.NO_GRANT
    assert not p.may_connect("a", "plain.test", 443)
    assert p.may_connect("b", "plain.test", 443)
    assert not p.may_connect("b", "api.test", 443)


# -- grants with a body rule: the body chooses between them ---------------------------------

QUERIES = bodyrules.parse("graphql", {"query": "*"})


def test_a_body_ruled_grant_leaves_the_choice_to_the_body_with_the_plain_grant_last():
    p = policy(
        replace(grant(1, methods=("POST",)), body=QUERIES),
        replace(grant(2, methods=("POST",)), max_uses=1),
    )
    d = p.decide("a", req(method="POST"), NOW)
    assert d.allowed and [r.grant_id for r in d.pending] == [1, 2]


def test_a_plain_grant_preferred_to_the_body_ruled_one_needs_no_body():
    """A standing grant without a body rule allows any body: the body need not be read."""
    p = policy(
        replace(grant(1, methods=("POST",)), body=QUERIES, max_uses=1),
        grant(2, methods=("POST",)),
    )
    d = p.decide("a", req(method="POST"), NOW)
    assert d.allowed and d.rule is not None and d.rule.grant_id == 2 and d.pending == ()


def test_body_ruled_grants_alone_are_all_pending_in_preference_order():
    p = policy(
        replace(grant(1, methods=("POST",), paths=("/v1/",)), body=QUERIES),
        replace(grant(2, methods=("POST",), paths=("/v1/x",)), body=QUERIES),
    )
    d = p.decide("a", req(method="POST"), NOW)
    assert [r.grant_id for r in d.pending] == [2, 1]  # the more specific path first


def test_a_spent_body_ruled_grant_is_not_pending():
    p = policy(replace(grant(1, methods=("POST",)), body=QUERIES, consumed=True, once=True))
    assert p.decide("a", req(method="POST"), NOW).reason == Reason.GRANT_CONSUMED
