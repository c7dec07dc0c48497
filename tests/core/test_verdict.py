"""The pure verdict: facts of a request + tunnel + policy + clock -> Verdict, without a proxy."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from addon.core.reasons import Reason
from addon.core.verdict import Facts, HeaderScan, Tunnel, Verdict, verdict
from store.rules.grammar import BadAuthority, canonicalize, normalize_host
from tests.fakes import NOW, grant, policy

TUNNEL = Tunnel("a", "api.test", 443)
POLICY = policy(
    grant(1, methods=("GET", "POST")),
    grant(2, cred=False, hosts=("plain.test",), paths=("/",)),
    grant(3, cred=False, hosts=("ws.test",), paths=("/",), websocket=True),
)


def facts(
    fields: tuple[tuple[bytes, bytes], ...] = ((b"Host", b"api.test"),),
    *,
    scheme: str = "https",
    host: str = "api.test",
    port: int = 443,
    authority: str = "",
    method: bytes = b"GET",
    target: bytes = b"/v1/x",
    is_http2: bool = False,
    client_tls: bool = True,
    client_sni: str | None = "api.test",
) -> Facts:
    return Facts(
        scheme=scheme,
        host=host,
        port=port,
        authority=authority,
        method=method,
        target=target,
        headers=HeaderScan.scan(fields),
        is_http2=is_http2,
        client_tls=client_tls,
        client_sni=client_sni,
    )


def plain(host: str = "plain.test", **kw: Any) -> Facts:
    """An absolute-form plain-http request to the proxy (no tunnel)."""
    fields = kw.pop("fields", ((b"Host", host.encode()),))
    kw = {"scheme": "http", "port": 80, "client_tls": False, "client_sni": None, **kw}
    return facts(fields, host=host, **kw)


def judge(f: Facts, tunnel: Tunnel | None = TUNNEL, principal: str = "a") -> Verdict:
    return verdict(f, principal, tunnel, POLICY, NOW)


def outcome(v: Verdict) -> tuple[str, str] | int:
    """The grant id of an allowed verdict, or (reason, detail)."""
    if v.rule is not None:
        return v.rule.grant_id
    if v.internal:
        return ("internal", "")
    assert v.reason is not None
    return (v.reason.value, v.detail)


H = (b"Host", b"api.test")
BAD = "bad-request"
MISMATCH = "host-mismatch"


@pytest.mark.parametrize(
    ("f", "tunnel", "expected"),
    [
        pytest.param(facts(), TUNNEL, 1, id="allow a granted request inside its tunnel"),
        pytest.param(plain(), None, 2, id="allow a granted plain-http request"),
        pytest.param(
            facts(scheme="ftp"),
            TUNNEL,
            (BAD, "unsupported scheme"),
            id="deny an unsupported scheme",
        ),
        pytest.param(
            plain(host="bad host"), None, (BAD, "invalid host"), id="deny a host that is no name"
        ),
        pytest.param(
            facts((H, H)), TUNNEL, (BAD, "duplicate Host header"), id="deny a duplicate Host"
        ),
        pytest.param(
            facts(port=8443),
            TUNNEL,
            (MISMATCH, "request does not go to the CONNECT authority"),
            id="deny another port than the tunnel's",
        ),
        pytest.param(
            facts(((b"Host", b"evil.test"),)),
            TUNNEL,
            (MISMATCH, "Host header or authority names another host"),
            id="deny a Host header naming another host",
        ),
        pytest.param(
            facts((), is_http2=True, authority="evil.test"),
            TUNNEL,
            (MISMATCH, "Host header or authority names another host"),
            id="deny an h2 authority naming another host",
        ),
        pytest.param(
            facts(()), TUNNEL, (BAD, "missing Host header"), id="deny HTTP/1 without a Host header"
        ),
        pytest.param(
            facts((), authority="api.test"),
            TUNNEL,
            (BAD, "missing Host header"),
            id="deny HTTP/1 with only an absolute-form authority",
        ),
        pytest.param(
            facts((), is_http2=True, authority="api.test"),
            TUNNEL,
            1,
            id="allow h2 with only its authority",
        ),
        pytest.param(
            facts(((b"Host", b"api.test:x"),)),
            TUNNEL,
            (BAD, "invalid Host header or authority"),
            id="deny a Host header that does not parse",
        ),
        pytest.param(
            facts(),
            replace(TUNNEL, sni_mismatch=True),
            (MISMATCH, "TLS SNI names another host"),
            id="deny a tunnel whose SNI named another host",
        ),
        pytest.param(
            plain(client_tls=True, client_sni="plain.test"),
            None,
            (MISMATCH, "TLS to the proxy without CONNECT"),
            id="deny TLS to the proxy without CONNECT",
        ),
        pytest.param(
            facts(client_tls=False, client_sni=None),
            None,
            (BAD, "https requests must use CONNECT"),
            id="deny https without CONNECT",
        ),
        pytest.param(
            facts(method=b"G(T"), TUNNEL, (BAD, "invalid method"), id="deny a method not a token"
        ),
        pytest.param(
            facts(target=b"/v1/a%2F"),
            TUNNEL,
            (BAD, "empty or dot part around an encoded slash"),
            id="deny a trailing encoded slash",
        ),
        pytest.param(
            facts((H, (b"Content-Length", b"1"), (b"Transfer-Encoding", b"chunked"))),
            TUNNEL,
            (BAD, "both Content-Length and Transfer-Encoding"),
            id="deny Content-Length with Transfer-Encoding",
        ),
        pytest.param(
            facts((H, (b"Content-Length", b"1"), (b"Content-Length", b"2"))),
            TUNNEL,
            (BAD, "conflicting Content-Length headers"),
            id="deny conflicting Content-Lengths",
        ),
        pytest.param(
            facts((H, (b"X-A", b"a\rb"))),
            TUNNEL,
            (BAD, "control character in a header value"),
            id="deny a bare CR in a header value",
        ),
        pytest.param(
            facts((H, (b"X A", b"1"))),
            TUNNEL,
            (BAD, "invalid header name"),
            id="deny a header name that is no token",
        ),
        pytest.param(
            facts(method=b"DELETE"),
            TUNNEL,
            ("method-not-allowed", "no grant allows this method here"),
            id="deny a method no grant allows",
        ),
        pytest.param(
            facts(target=b"/v2/x"),
            TUNNEL,
            ("path-not-allowed", "no grant allows this path"),
            id="deny a path no grant allows",
        ),
        pytest.param(
            facts((H, (b"X-HTTP-Method-Override", b"DELETE"))),
            TUNNEL,
            ("method-not-allowed", "the method override is not granted"),
            id="deny a method override the grant does not allow",
        ),
        pytest.param(
            facts((H, (b"X_Method_Override", b"POST"))),
            TUNNEL,
            1,
            id="allow a method override the stamped grant allows",
        ),
        pytest.param(
            facts((H, (b"X-Method-Override", b"P(ST"))),
            TUNNEL,
            (BAD, "invalid method"),
            id="deny a method override that is no token",
        ),
        pytest.param(
            facts((H, (b"X-HTTP-Method-Override", b"HEAD"))),
            TUNNEL,
            1,
            id="allow a HEAD override where GET is granted",
        ),
        pytest.param(facts(method=b"HEAD"), TUNNEL, 1, id="allow HEAD where GET is granted"),
        pytest.param(
            facts(target=b"/v1/@scope%2fname"),
            TUNNEL,
            1,
            id="allow an encoded slash inside a segment under a granted prefix",
        ),
        pytest.param(
            facts(target=b"/v2%2F..%2Fv1/x"),
            TUNNEL,
            (BAD, "empty or dot part around an encoded slash"),
            id="deny dot-dot hidden between encoded slashes",
        ),
        pytest.param(
            facts(target=b"/v1/a%2F%2Fb"),
            TUNNEL,
            (BAD, "empty or dot part around an encoded slash"),
            id="deny an empty part between encoded slashes",
        ),
        pytest.param(
            facts(target=b"/v1/a%2F%5Cb"),
            TUNNEL,
            (BAD, "backslash"),
            id="deny an encoded backslash beside an encoded slash",
        ),
        pytest.param(
            facts((H, (b"X-Original-URL", b"/admin"))),
            TUNNEL,
            (BAD, "path-override headers are not allowed"),
            id="deny a path-override header",
        ),
        pytest.param(
            plain(host="credproxy.internal", target=b"/access-requests"),
            None,
            ("internal", ""),
            id="pass the internal endpoint outside a tunnel",
        ),
        pytest.param(
            plain(
                host="credproxy.internal",
                fields=((b"Host", b"credproxy.internal"), (b"Content-Encoding", b"gzip")),
            ),
            None,
            (BAD, "credproxy.internal takes no Content-Encoding"),
            id="deny a compressed body to the internal endpoint",
        ),
        pytest.param(
            plain(
                host="credproxy.internal",
                fields=((b"Host", b"credproxy.internal"), (b"Content-Encoding", b"")),
            ),
            None,
            (BAD, "credproxy.internal takes no Content-Encoding"),
            id="deny an empty Content-Encoding to the internal endpoint",
        ),
        pytest.param(
            plain(
                host="credproxy.internal",
                fields=((b"Host", b"credproxy.internal"), (b"Transfer-Encoding", b"chunked")),
            ),
            None,
            ("body-too-large", "send a Content-Length to credproxy.internal"),
            id="deny a chunked body to the internal endpoint",
        ),
        pytest.param(
            plain(
                host="credproxy.internal",
                fields=((b"Host", b"credproxy.internal"), (b"Content-Length", b"16385")),
            ),
            None,
            ("body-too-large", "bodies to credproxy.internal are 16384 bytes at most"),
            id="deny a body over the internal endpoint's limit",
        ),
        pytest.param(
            plain(
                host="credproxy.internal",
                fields=((b"Host", b"credproxy.internal"), (b"Content-Length", b"")),
            ),
            None,
            ("body-too-large", "bodies to credproxy.internal are 16384 bytes at most"),
            id="deny an empty Content-Length to the internal endpoint",
        ),
        pytest.param(
            plain(host="ws.test", fields=((b"Host", b"ws.test"), (b"Upgrade", b"websocket"))),
            None,
            3,
            id="allow an upgrade a websocket grant allows",
        ),
        pytest.param(
            plain(fields=((b"Host", b"plain.test"), (b"Upgrade", b"websocket"))),
            None,
            ("upgrade-not-allowed", "no grant allows protocol upgrades here"),
            id="deny an upgrade no grant allows",
        ),
        pytest.param(
            facts(scheme="http", port=80, host="api.test", client_tls=False, client_sni=None),
            None,
            ("insecure-scheme", "credentials are only sent over https"),
            id="deny cleartext to a host granted with a credential",
        ),
        # Several checks fail: the first in the order names the reason.
        pytest.param(
            plain(host="bad host", fields=((b"Host", b"a"), (b"Host", b"b"))),
            None,
            (BAD, "invalid host"),
            id="the host is checked before a duplicate Host",
        ),
        pytest.param(
            facts(port=8443, method=b"G(T"),
            TUNNEL,
            (MISMATCH, "request does not go to the CONNECT authority"),
            id="the destination is checked before the method",
        ),
        pytest.param(
            facts(method=b"G(T", target=b"/v1/a%2F.."),
            TUNNEL,
            (BAD, "invalid method"),
            id="the method is checked before the path",
        ),
        pytest.param(
            facts((H, (b"Content-Length", b"1"), (b"Transfer-Encoding", b"x")), target=b"x"),
            TUNNEL,
            (BAD, "not origin-form"),
            id="the path is checked before the framing",
        ),
        pytest.param(
            facts((H, (b"Content-Length", b"1"), (b"Transfer-Encoding", b"x")), method=b"DELETE"),
            TUNNEL,
            (BAD, "both Content-Length and Transfer-Encoding"),
            id="the framing is checked before the grant",
        ),
        pytest.param(
            facts((H, (b"X-Original-URL", b"/")), method=b"DELETE"),
            TUNNEL,
            ("method-not-allowed", "no grant allows this method here"),
            id="the grant is checked before the overrides",
        ),
    ],
)
def test_the_verdict(f: Facts, tunnel: Tunnel | None, expected: Any) -> None:
    assert outcome(judge(f, tunnel)) == expected


def test_only_the_grant_decision_is_marked_as_one_an_access_request_may_follow() -> None:
    assert judge(facts(target=b"/v2/x")).decided
    assert not judge(facts((H, (b"X-HTTP-Method-Override", b"DELETE")))).decided
    assert not judge(facts(method=b"G(T")).decided


def test_a_refusal_names_what_was_known_when_it_was_refused() -> None:
    early = judge(plain(host="bad host"), None)
    assert (early.host, early.port, early.path) == (None, None, None)
    bound = judge(facts(target=b"/v1/a%2F.."))
    assert (bound.host, bound.port, bound.path) == ("api.test", 443, None)
    late = judge(facts((H, (b"Content-Length", b"1"), (b"Content-Length", b"2"))))
    assert (late.host, late.port, late.path) == ("api.test", 443, "/v1/x")


def test_an_allowed_verdict_carries_the_canonical_path_and_the_query() -> None:
    v = judge(facts(target=b"/v1/a/../x?q=1"))
    assert v.allowed and (v.path, v.query, v.method) == ("/v1/x", b"q=1", "GET")


def test_an_encoded_slash_is_forwarded_encoded_in_upper_case() -> None:
    v = judge(facts(target=b"/v1/@scope%2fname?x=%2f"))
    assert v.allowed and (v.path, v.query) == ("/v1/@scope%2Fname", b"x=%2f")


# -- properties ------------------------------------------------------------------------------

NAMES = st.sampled_from(["api.test", "evil.test", "x.wild.test", "API.test", "api.test.", "a"])
PORTS = st.sampled_from([None, 443, 8443, 80])
FIELD_NAMES = st.sampled_from(
    [b"Host", b"host", b"Content-Length", b"Transfer-Encoding", b"X-HTTP-Method-Override",
     b"X_Http_Method", b"X-Rewrite-URL", b"Upgrade", b"X-A", b"X A", b""]
)  # fmt: skip
FIELD_VALUES = st.one_of(
    st.sampled_from([b"api.test", b"1", b"2", b"chunked", b"DELETE", b"GET", b"/", b"a\rb"]),
    st.binary(max_size=8),
)
FIELDS = st.lists(st.tuples(FIELD_NAMES, FIELD_VALUES), max_size=5).map(tuple)
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _normal(host: str) -> str | None:
    try:
        return normalize_host(host)
    except BadAuthority:
        return None


def _authority(name: str, port: int | None) -> bytes:
    return (name if port is None else f"{name}:{port}").encode()


@SETTINGS
@given(
    fields=FIELDS,
    method=st.one_of(st.sampled_from([b"GET", b"POST", b"get", b"DELETE"]), st.binary(max_size=6)),
    target=st.one_of(st.sampled_from([b"/v1/x", b"/v1/%2e/x", b"*", b"/v1/x?a"]), st.binary()),
    is_http2=st.booleans(),
    authority=st.sampled_from(["", "api.test", "evil.test", "api.test:8443"]),
    in_tunnel=st.booleans(),
)
def test_the_verdict_is_total_and_an_allowed_one_is_consistent(
    fields: tuple[tuple[bytes, bytes], ...],
    method: bytes,
    target: bytes,
    is_http2: bool,
    authority: str,
    in_tunnel: bool,
) -> None:
    """Whatever the bytes, a Verdict comes back; when it allows, every name the request
    carries is the host it goes to, the method is a granted token, and nothing is ambiguous."""
    f = facts(fields, method=method, target=target, is_http2=is_http2, authority=authority)
    v = judge(f, TUNNEL if in_tunnel else None)
    if not v.allowed:
        assert v.reason is not None or v.internal
        return
    assert v.rule is not None and in_tunnel  # https outside a tunnel is never allowed
    scan = f.headers
    assert all(h.lower() in (b"api.test", b"api.test:443") for h in scan.get_all(b"host"))
    assert authority in ("", "api.test")
    assert not (scan.get_all(b"content-length") and b"transfer-encoding" in scan.index)
    assert len(set(scan.get_all(b"content-length"))) <= 1
    assert scan.problem is None
    assert v.method is not None and v.rule.allows_method(v.method)
    assert v.path is not None and canonicalize(v.path.encode())[0] == v.path
    assert not any(name in (b"x-original-url", b"x-rewrite-url") for name, _ in scan.overrides())


@SETTINGS
@given(name=NAMES, port=PORTS)
def test_a_host_header_naming_another_host_is_never_allowed(name: str, port: int | None) -> None:
    v = judge(facts(((b"Host", _authority(name, port)),)))
    names_the_tunnel = name.lower().rstrip(".") == "api.test" and port in (None, 443)
    if not names_the_tunnel:
        assert not v.allowed
        assert v.reason in (Reason.HOST_MISMATCH, Reason.BAD_REQUEST)


@SETTINGS
@given(host=NAMES, port=st.sampled_from([443, 8443, 80]))
def test_a_request_inside_a_tunnel_goes_only_to_its_authority(host: str, port: int) -> None:
    v = judge(facts(((b"Host", _authority(host, port)),), host=host, port=port))
    if (_normal(host), port) != ("api.test", 443):
        assert not v.allowed


@SETTINGS
@given(
    length=st.binary(min_size=0, max_size=4),
    coding=st.binary(min_size=0, max_size=8),
    before=FIELDS,
)
def test_content_length_with_transfer_encoding_is_always_a_bad_request(
    length: bytes, coding: bytes, before: tuple[tuple[bytes, bytes], ...]
) -> None:
    fields = (H, (b"Content-Length", length), (b"Transfer-Encoding", coding))
    clean = tuple(f for f in before if f[0].lower() not in (b"host", b"x-original-url"))
    v = judge(facts(clean + fields))
    assert v.reason is Reason.BAD_REQUEST


@SETTINGS
@given(method=st.sampled_from(["DELETE", "PUT", "PATCH", "head", "get", "OPTIONS"]))
def test_an_override_to_a_method_not_granted_is_denied(method: str) -> None:
    for name in (b"X-HTTP-Method-Override", b"x-http-method", b"X_Method_Override"):
        v = judge(facts((H, (name, method.encode()))))
        assert not v.allowed and v.reason is Reason.METHOD_NOT_ALLOWED


@SETTINGS
@given(value=st.binary(max_size=10), name=st.sampled_from([b"X-Original-URL", b"x_rewrite_url"]))
def test_a_path_override_is_never_allowed(value: bytes, name: bytes) -> None:
    v = judge(facts((H, (name, value))))
    assert not v.allowed and v.reason is Reason.BAD_REQUEST


@SETTINGS
@given(sni_mismatch=st.booleans(), tls=st.booleans(), sni=st.sampled_from([None, "api.test"]))
def test_a_tunnel_whose_sni_named_another_host_is_never_allowed(
    sni_mismatch: bool, tls: bool, sni: str | None
) -> None:
    v = judge(facts(client_tls=tls, client_sni=sni), replace(TUNNEL, sni_mismatch=sni_mismatch))
    assert v.allowed is not sni_mismatch
