import ipaddress
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from publicsuffix2 import PSL_FILE, PublicSuffixList

from store.errors import InvalidInput
from store.rules.grammar import (
    DETAILS,
    PCHAR,
    BadAuthority,
    BadPath,
    HostPattern,
    _canonical_path,
    _is_public_suffix,
    canonicalize,
    is_ip,
    normalize_host,
    parse_authority,
    parse_expiry,
    parse_host,
    path_matches,
    validate_header_name,
    validate_method,
    validate_name,
    validate_path_pattern,
)

NOW = datetime(2030, 6, 1, 12, 0, tzinfo=UTC)


# -- Names, methods, header names -----------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        pytest.param("ci-runner.01_x", True, id="accept lower case, digits and ._-"),
        pytest.param("a" * 63, True, id="accept 63 characters"),
        pytest.param("a" * 64, False, id="refuse 64 characters"),
        pytest.param("Agent", False, id="refuse upper case"),
        pytest.param("-agent", False, id="refuse a leading hyphen"),
        pytest.param("agent:x", False, id="refuse a colon, which would break the proxy URL"),
        pytest.param("", False, id="refuse empty"),
    ],
)
def test_validate_name(name: str, ok: bool) -> None:
    if ok:
        assert validate_name("principal", name) == name
    else:
        with pytest.raises(InvalidInput, match="invalid principal name"):
            validate_name("principal", name)


@pytest.mark.parametrize(
    ("method", "ok"),
    [
        pytest.param("GET", True, id="accept GET"),
        pytest.param("PROPFIND", True, id="accept an extension method"),
        pytest.param("*", True, id="accept star for every method"),
        pytest.param("get", False, id="refuse lower case"),
        pytest.param("Get", False, id="refuse mixed case"),
        pytest.param("", False, id="refuse empty"),
        pytest.param("G ET", False, id="refuse a space"),
        pytest.param("GET\r\n", False, id="refuse CRLF"),
        pytest.param("GET,POST", False, id="refuse a list in one value"),
    ],
)
def test_validate_method(method: str, ok: bool) -> None:
    if ok:
        assert validate_method(method) == method
    else:
        with pytest.raises(InvalidInput, match="invalid method"):
            validate_method(method)


def test_lower_case_method_error_suggests_the_upper_case() -> None:
    with pytest.raises(InvalidInput, match="did you mean 'GET'"):
        validate_method("get")


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        pytest.param("X-Api-Key", True, id="accept a custom header"),
        pytest.param("Authorization", True, id="accept Authorization"),
        pytest.param("host", False, id="refuse host"),
        pytest.param("Host", False, id="refuse Host in any case"),
        pytest.param("Content-Length", False, id="refuse content-length"),
        pytest.param("transfer-encoding", False, id="refuse transfer-encoding"),
        pytest.param("Connection", False, id="refuse connection"),
        pytest.param("Proxy-Authorization", False, id="refuse proxy-authorization"),
        pytest.param("cookie", False, id="refuse cookie"),
        pytest.param("X Api", False, id="refuse a space"),
        pytest.param("X-Key:", False, id="refuse a colon"),
        pytest.param("X-Key\r\nX-Evil", False, id="refuse CRLF"),
        pytest.param("", False, id="refuse empty"),
    ],
)
def test_validate_header_name(name: str, ok: bool) -> None:
    if ok:
        assert validate_header_name(name) == name
    else:
        with pytest.raises(InvalidInput, match="header name"):
            validate_header_name(name)


# -- IP literals and authorities as they arrive -----------------------------------------------


@settings(max_examples=500, deadline=None)
@given(
    st.one_of(
        st.ip_addresses().map(str),
        st.text("0123456789.:abcdefABCDEF%x\u0661\u00b2", max_size=24),
        st.text(max_size=12),
    )
)
def test_is_ip_agrees_with_ipaddress(text: str) -> None:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        expected = False
    else:
        expected = True
    assert is_ip(text) is expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("api.test", ("api.test", None), id="a host name"),
        pytest.param("API.Test:8443", ("api.test", 8443), id="case folded, with port"),
        pytest.param("localhost:65535", ("localhost", 65535), id="highest port"),
        pytest.param("127.0.0.1:1", ("127.0.0.1", 1), id="IPv4 literal"),
        pytest.param("[::1]", ("::1", None), id="IPv6 literal"),
        pytest.param("[2001:DB8:0::1]:443", ("2001:db8::1", 443), id="IPv6 made canonical"),
        pytest.param("xn--bcher-kva.de", ("xn--bcher-kva.de", None), id="punycode"),
    ],
)
def test_parse_authority_accepts(text: str, expected: tuple[str, int | None]) -> None:
    assert parse_authority(text) == expected


@pytest.mark.parametrize(
    ("text", "detail"),
    [
        pytest.param("user@api.test", "userinfo in authority", id="userinfo"),
        pytest.param("[::1", "unclosed bracket", id="unclosed bracket"),
        pytest.param("[api.test]:443", "brackets without IPv6", id="brackets around a name"),
        pytest.param("::1", "unbracketed IPv6", id="IPv6 without brackets"),
        pytest.param("api.test:", "invalid port", id="empty port"),
        pytest.param("api.test:0", "invalid port", id="port zero"),
        pytest.param("api.test:0443", "invalid port", id="leading zero"),
        pytest.param("api.test:65536", "invalid port", id="port above 65535"),
        pytest.param("api.test:https", "invalid port", id="named port"),
        pytest.param("api.test:\u0664\u0664\u0663", "invalid port", id="non-ASCII digits"),
        pytest.param("api.test:\u00b2", "invalid port", id="a superscript digit"),
        pytest.param("api.test:" + "1" * 5000, "invalid port", id="a port of 5000 digits"),
        pytest.param("[::1]x", "invalid port", id="junk after the bracket"),
        pytest.param("[::zz]", "invalid IPv6 literal", id="bad IPv6"),
        pytest.param("api..test", "invalid host name", id="empty label"),
        pytest.param("exa mple.com", "invalid host name", id="space"),
        pytest.param("b\u00fccher.de", "invalid host name", id="non-ASCII"),
        pytest.param("api.\u212aey.test", "invalid host name", id="KELVIN SIGN folds to k"),
        pytest.param("a" * 64 + ".test", "invalid host name", id="label longer than 63"),
        pytest.param("", "invalid host name", id="empty"),
    ],
)
def test_parse_authority_refuses(text: str, detail: str) -> None:
    with pytest.raises(BadAuthority) as caught:
        parse_authority(text)
    assert str(caught.value) == detail


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        pytest.param("API.test", "api.test", id="a name is lower-cased"),
        pytest.param("2001:DB8:0:0::1", "2001:db8::1", id="bracket-less IPv6 made canonical"),
        pytest.param("01.2.3.4", "01.2.3.4", id="a name of digits is still a name"),
    ],
)
def test_normalize_host(host: str, expected: str) -> None:
    assert normalize_host(host) == expected


port_texts = st.one_of(
    st.integers(min_value=-1, max_value=70000).map(str),
    st.text("0123456789\u0661\u00b2x", max_size=7),
)


@settings(max_examples=500, deadline=None)
@given(port_texts)
def test_the_cli_and_the_proxy_read_ports_alike(port: str) -> None:
    try:
        expected: int | None = parse_authority(f"api.test:{port}")[1]
    except BadAuthority:
        expected = None
    try:
        got: int | None = parse_host(f"api.test:{port}").port
    except InvalidInput:
        got = None
    assert got == expected


def _labels(draw_from: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.lists(draw_from, min_size=1, max_size=4).map(".".join)


host_specs = st.one_of(
    st.builds(
        lambda name, port: name + port,
        _labels(st.sampled_from(["api", "a-b", "xn--bcher-kva", "0x7f", "1", "github", "uk"])),
        st.sampled_from(["", ":443", ":8443", ":1", ":65535"]),
    ),
    st.ip_addresses(v=4).map(str),
    st.builds(
        lambda address, port: f"[{address}]{port}",
        st.ip_addresses(v=6),
        st.sampled_from(["", ":443", ":8443"]),
    ),
    st.text("abAB01.-:[]*", max_size=16),
)


@settings(max_examples=500, deadline=None)
@given(host_specs)
def test_every_host_the_cli_accepts_the_proxy_reads_as_itself(spec: str) -> None:
    """A grant's host is compared with what normalize_host makes of the request's host."""
    try:
        pattern = parse_host(spec)
    except InvalidInput:
        return
    if pattern.wildcard:
        return
    assert normalize_host(pattern.host) == pattern.host
    assert parse_authority(str(pattern)) == (pattern.host, pattern.port)


# -- Host patterns, as operators write them ---------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        pytest.param("api.github.com", HostPattern("api.github.com"), id="plain host name"),
        pytest.param("api.github.com:8443", HostPattern("api.github.com", 8443), id="with port"),
        pytest.param("*.example.com", HostPattern("*.example.com"), id="leftmost wildcard"),
        pytest.param("*.a.github.io", HostPattern("*.a.github.io"), id="wildcard below a suffix"),
        pytest.param("localhost", HostPattern("localhost"), id="single label"),
        pytest.param("xn--bcher-kva.de", HostPattern("xn--bcher-kva.de"), id="punycode"),
        pytest.param("10.0.0.1:80", HostPattern("10.0.0.1", 80), id="canonical IPv4"),
        pytest.param("[::1]", HostPattern("::1"), id="IPv6 in brackets"),
        pytest.param("[2001:db8::1]:443", HostPattern("2001:db8::1", 443), id="IPv6 with port"),
        pytest.param("example.com:65535", HostPattern("example.com", 65535), id="highest port"),
    ],
)
def test_parse_host_accepts(spec: str, expected: HostPattern) -> None:
    assert parse_host(spec) == expected
    assert parse_host(str(expected)) == expected


@pytest.mark.parametrize(
    "spec",
    [
        pytest.param("*.com", id="wildcard over a TLD"),
        pytest.param("*.co.uk", id="wildcard over a public suffix"),
        pytest.param("*.github.io", id="wildcard over a private public suffix"),
        pytest.param("*.localhost", id="wildcard over a bare label"),
        pytest.param("*", id="bare star"),
        pytest.param("*.*.example.com", id="two wildcards"),
        pytest.param("a.*.example.com", id="wildcard not leftmost"),
        pytest.param("api*.example.com", id="partial-label wildcard"),
        pytest.param("example.com:0443", id="port with a leading zero"),
        pytest.param("example.com:0", id="port zero"),
        pytest.param("example.com:65536", id="port above 65535"),
        pytest.param("example.com:", id="empty port"),
        pytest.param("example.com:https", id="named port"),
        pytest.param("API.github.com", id="upper case"),
        pytest.param("127.1", id="short IPv4"),
        pytest.param("0x7f.1", id="hex IPv4"),
        pytest.param("2130706433", id="IPv4 as one decimal number"),
        pytest.param("0x7f000001", id="IPv4 as one hex number"),
        pytest.param("127.0.0.0x1", id="IPv4 with a hex last part"),
        pytest.param("017.0.0.1", id="octal IPv4"),
        pytest.param("bücher.de", id="non-ASCII host name"),
        pytest.param("::1", id="IPv6 without brackets"),
        pytest.param("[::1", id="unclosed bracket"),
        pytest.param("[example.com]", id="brackets around a host name"),
        pytest.param("[::1]x", id="junk after the bracket"),
        pytest.param("a..b", id="empty label"),
        pytest.param("-a.example.com", id="label starting with a hyphen"),
        pytest.param("a_b.example.com", id="underscore"),
        pytest.param("example.com.", id="trailing dot"),
        pytest.param("", id="empty"),
        pytest.param("user@example.com", id="userinfo"),
        pytest.param("example.com/path", id="path"),
        pytest.param("a" * 64 + ".com", id="label longer than 63"),
    ],
)
def test_parse_host_refuses(spec: str) -> None:
    with pytest.raises(InvalidInput, match="invalid"):
        parse_host(spec)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        pytest.param("[2001:DB8::1]", HostPattern("2001:db8::1"), id="IPv6 hex in upper case"),
        pytest.param("[::0:1]", HostPattern("::1"), id="IPv6 not in canonical form"),
        pytest.param("[fe80::1%ETH0]", HostPattern("fe80::1%eth0"), id="zone ID as the proxy"),
    ],
)
def test_parse_host_reads_an_ipv6_literal_as_the_proxy_does(
    spec: str, expected: HostPattern
) -> None:
    assert parse_host(spec) == expected
    assert normalize_host(expected.host) == expected.host


@pytest.mark.parametrize(
    "spec",
    [
        pytest.param("api.test:\u0664\u0664\u0663", id="a port in non-ASCII digits"),
        pytest.param("api.test:\u00b2", id="a superscript digit"),
        pytest.param("api.test:" + "1" * 5000, id="a port of 5000 digits"),
    ],
)
def test_parse_host_refuses_a_port_the_proxy_would_refuse(spec: str) -> None:
    with pytest.raises(InvalidInput, match="invalid port"):
        parse_host(spec)


def test_public_suffixes_are_those_of_the_whole_list() -> None:
    whole = PublicSuffixList()
    domains = {"example", "svc0.example", "a.b.example", "xn--unknown-tld.a"}
    with open(PSL_FILE, encoding="utf-8") as f:
        for line in f:
            rule = line.strip()
            if rule and not rule.startswith("//"):
                name = rule.lstrip("!").replace("*", "x").encode("idna").decode()
                domains |= {name, f"a.{name}", name.partition(".")[2]}
    domains.discard("")
    differ = [d for d in sorted(domains) if _is_public_suffix(d) != (whole.get_tld(d) == d)]
    assert differ == []


@pytest.mark.parametrize(
    ("pattern", "host", "port", "default", "expected"),
    [
        pytest.param("api.github.com", "api.github.com", 443, 443, True, id="exact host"),
        pytest.param("api.github.com", "github.com", 443, 443, False, id="parent domain"),
        pytest.param("api.github.com", "xapi.github.com", 443, 443, False, id="longer host"),
        pytest.param("api.github.com", "api.github.com", 8443, 443, False, id="other port"),
        pytest.param("api.github.com", "api.github.com", 80, 80, True, id="default port on http"),
        pytest.param("api.github.com:8443", "api.github.com", 8443, 443, True, id="explicit port"),
        pytest.param("api.github.com:8443", "api.github.com", 443, 443, False, id="default port"),
        pytest.param("*.example.com", "a.example.com", 443, 443, True, id="one extra label"),
        pytest.param("*.example.com", "a.b.example.com", 443, 443, False, id="two extra labels"),
        pytest.param("*.example.com", "example.com", 443, 443, False, id="the base domain"),
        pytest.param("*.example.com", "aexample.com", 443, 443, False, id="suffix not on a dot"),
        pytest.param("*.example.com", ".example.com", 443, 443, False, id="empty label"),
        pytest.param("[::1]", "::1", 443, 443, True, id="IPv6"),
    ],
)
def test_host_pattern_matches(
    pattern: str, host: str, port: int, default: int, expected: bool
) -> None:
    assert parse_host(pattern).matches(host, port, default) is expected


@pytest.mark.parametrize(
    ("outer", "inner", "expected"),
    [
        pytest.param("api.github.com", "api.github.com", True, id="the same host"),
        pytest.param("api.github.com", "api.github.com:443", True, id="explicit default port"),
        pytest.param("api.github.com:443", "api.github.com", True, id="implicit default port"),
        pytest.param("api.github.com", "api.github.com:8443", False, id="another port"),
        pytest.param("api.github.com", "uploads.github.com", False, id="a sibling host"),
        pytest.param("api.github.com", "*.github.com", False, id="a wildcard inside a host"),
        pytest.param("*.example.com", "a.example.com", True, id="a host under the wildcard"),
        pytest.param("*.example.com", "*.example.com", True, id="the same wildcard"),
        pytest.param("*.example.com", "a.b.example.com", False, id="two labels down"),
        pytest.param("*.example.com", "*.a.example.com", False, id="a narrower wildcard"),
        pytest.param("*.example.com", "example.com", False, id="the wildcard's base"),
        pytest.param("*.example.com", "a.example.com:8443", False, id="under it on another port"),
    ],
)
def test_host_pattern_covers(outer: str, inner: str, expected: bool) -> None:
    assert parse_host(outer).covers(parse_host(inner)) is expected


# -- Canonical request paths ------------------------------------------------------------------


SLASH_PARTS = "empty or dot part around an encoded slash"

ACCEPTED = [
    pytest.param(b"/", "/", None, id="the root is canonical as it is"),
    pytest.param(b"/v1/issues", "/v1/issues", None, id="a plain path is unchanged"),
    pytest.param(b"/v1/issues/", "/v1/issues/", None, id="a single trailing slash is kept"),
    pytest.param(b"/V1/Issues", "/V1/Issues", None, id="case is preserved, never folded"),
    pytest.param(b"/a/./b", "/a/b", None, id="a dot segment is removed"),
    pytest.param(b"/a/b/../c", "/a/c", None, id="a dot-dot segment climbs one level"),
    pytest.param(b"/a/b/../../c", "/c", None, id="dot-dot may climb back to the root"),
    pytest.param(b"/a/b/..", "/a/", None, id="a final dot-dot leaves a directory"),
    pytest.param(b"/a/b/.", "/a/b/", None, id="a final dot leaves a directory"),
    pytest.param(b"/a/..", "/", None, id="climbing to the root exactly is allowed"),
    pytest.param(b"/a/%2e%2e/b", "/b", None, id="lower-case encoded dot-dot is resolved"),
    pytest.param(b"/a/%2E./b", "/b", None, id="half-encoded dot-dot is resolved"),
    pytest.param(b"/a/.%2e/b", "/b", None, id="dot-dot with the second dot encoded is resolved"),
    pytest.param(b"/a/%2e/b", "/a/b", None, id="an encoded dot segment is removed"),
    pytest.param(b"/...", "/...", None, id="three dots are an ordinary segment"),
    pytest.param(b"/a..b/..c", "/a..b/..c", None, id="dots inside a segment are ordinary"),
    pytest.param(b"/%41%62", "/Ab", None, id="escaped letters are decoded"),
    pytest.param(b"/%7e%2D%5f%30", "/~-_0", None, id="escaped unreserved marks are decoded"),
    pytest.param(b"/caf%c3%a9", "/caf%C3%A9", None, id="valid utf-8 stays encoded, hex upper"),
    pytest.param(b"/caf%C3%A9", "/caf%C3%A9", None, id="upper-case utf-8 escape is unchanged"),
    pytest.param(b"/%f0%9f%98%80", "/%F0%9F%98%80", None, id="a four-byte utf-8 escape is kept"),
    pytest.param(b"/a%3ab", "/a%3Ab", None, id="an escaped reserved char is kept, not decoded"),
    pytest.param(b"/a%3fb", "/a%3Fb", None, id="an escaped question mark is data"),
    pytest.param(b"/a%23b", "/a%23b", None, id="an escaped hash is data"),
    pytest.param(b"/a%20b", "/a%20b", None, id="an escaped space is data"),
    pytest.param(b"/100%25", "/100%25", None, id="a lone escaped percent is kept"),
    pytest.param(b"/%25zz", "/%25zz", None, id="escaped percent before non-hex is kept"),
    pytest.param(b"/%25a", "/%25a", None, id="escaped percent before one hex digit is kept"),
    pytest.param(b"/!$&'()*+,=:@", "/!$&'()*+,=:@", None, id="sub-delims colon and at are pchar"),
    pytest.param(b"/@scope%2fname", "/@scope%2Fname", None, id="npm's scoped name, hex upper"),
    pytest.param(b"/@scope%2Fname", "/@scope%2Fname", None, id="an encoded slash stays encoded"),
    pytest.param(
        b"/api/v4/projects/group%2Fsub%2Fproject/issues",
        "/api/v4/projects/group%2Fsub%2Fproject/issues",
        None,
        id="gitlab's group%2Fproject id, several encoded slashes",
    ),
    pytest.param(b"/a%2F...", "/a%2F...", None, id="three dots beside an encoded slash are a name"),
    pytest.param(b"/a%2F.b", "/a%2F.b", None, id="a dotted name beside an encoded slash"),
    pytest.param(b"/a%2F%41", "/a%2FA", None, id="unreserved escapes beside a slash are decoded"),
    pytest.param(b"/x/a%2Fb/..", "/x/", None, id="a dot-dot climbs over a whole slash segment"),
    pytest.param(b"/a?", "/a", b"", id="an empty query is kept apart from no query"),
    pytest.param(b"/a?b?c", "/a", b"b?c", id="the query starts at the first question mark"),
    pytest.param(
        b"/v1/x?r=%2F..%2f&s=%00",
        "/v1/x",
        b"r=%2F..%2f&s=%00",
        id="the query is returned byte-exact and unchecked for escapes",
    ),
    pytest.param(b"/a?x=/../..", "/a", b"x=/../..", id="dot segments in the query are data"),
    pytest.param(b"/a/..?q=1", "/", b"q=1", id="the path resolves independently of the query"),
    pytest.param(b"/a?\xc3\xa9", "/a", b"\xc3\xa9", id="raw non-ascii in the query passes through"),
]

REFUSED = [
    pytest.param(b"/..", "dot segment above root", id="dot-dot at the root is refused"),
    pytest.param(b"/../etc/passwd", "dot segment above root", id="classic traversal is refused"),
    pytest.param(b"/a/../..", "dot segment above root", id="climbing past the root is refused"),
    pytest.param(b"/%2e%2e", "dot segment above root", id="encoded dot-dot at the root"),
    pytest.param(b"/%2E./x", "dot segment above root", id="half-encoded dot-dot at the root"),
    pytest.param(b"/.%2E/x", "dot segment above root", id="dot then encoded dot at the root"),
    pytest.param(b"/a/%2e%2e/%2e%2e/x", "dot segment above root", id="encoded traversal past root"),
    pytest.param(b"/..%2f..%2fetc", SLASH_PARTS, id="traversal hidden by encoded slashes"),
    pytest.param(b"/a/%2F..", SLASH_PARTS, id="an encoded slash before dot-dot"),
    pytest.param(b"/a/..%2F", SLASH_PARTS, id="dot-dot before a trailing encoded slash"),
    pytest.param(b"/a%2F.%2Fb", SLASH_PARTS, id="a dot between encoded slashes"),
    pytest.param(b"/a%2F%2Fb", SLASH_PARTS, id="two encoded slashes make an empty part"),
    pytest.param(b"/%2e%2e%2Fx", SLASH_PARTS, id="an encoded dot-dot before an encoded slash"),
    pytest.param(b"/x/.%2e%2fetc", SLASH_PARTS, id="half-encoded dot-dot, lower-case slash"),
    pytest.param(b"/%2Fetc", SLASH_PARTS, id="a leading encoded slash makes an empty part"),
    pytest.param(b"/a%2F", SLASH_PARTS, id="a trailing encoded slash makes an empty part"),
    pytest.param(b"/%2F", SLASH_PARTS, id="a segment that is only an encoded slash"),
    pytest.param(b"/a%2F%5Cb", "backslash", id="an encoded backslash beside an encoded slash"),
    pytest.param(b"/a%2F\\b", "backslash", id="a raw backslash beside an encoded slash"),
    pytest.param(b"/a%2F%3Bb", "matrix parameter", id="a semicolon beside an encoded slash"),
    pytest.param(b"/a%2F%00", "control character", id="a NUL beside an encoded slash"),
    pytest.param(b"/a\\b", "backslash", id="a raw backslash is refused"),
    pytest.param(b"/..\\..\\etc", "backslash", id="backslash traversal is refused"),
    pytest.param(b"/a%5cb", "backslash", id="an encoded backslash is refused"),
    pytest.param(b"/a/..;/b", "matrix parameter", id="tomcat dot-dot-semicolon is refused"),
    pytest.param(b"/a;jsessionid=1", "matrix parameter", id="a matrix parameter is refused"),
    pytest.param(b"/a%3bb", "matrix parameter", id="an encoded semicolon is refused"),
    pytest.param(b"//a", "empty segment", id="a leading double slash is refused"),
    pytest.param(b"/a//b", "empty segment", id="an inner double slash is refused"),
    pytest.param(b"/a//", "empty segment", id="a trailing double slash is refused"),
    pytest.param(b"/a/.//b", "empty segment", id="an empty segment after a dot is refused"),
    pytest.param(b"/a\x00b", "control character", id="a raw NUL is refused"),
    pytest.param(b"/a%00b", "control character", id="an encoded NUL is refused"),
    pytest.param(b"/a%0d%0aHost:x", "control character", id="encoded CRLF injection is refused"),
    pytest.param(b"/a\r\nX-A: b", "control character", id="raw CRLF injection is refused"),
    pytest.param(b"/a\tb", "control character", id="a raw tab is refused"),
    pytest.param(b"/a b", "control character", id="a raw space is refused"),
    pytest.param(b"/a\x7f", "control character", id="a raw DEL is refused"),
    pytest.param(b"/a%7F", "control character", id="an encoded DEL is refused"),
    pytest.param(b"/a?x\r\nHost: y", "control character", id="CRLF in the query is refused"),
    pytest.param(b"/a?x y", "control character", id="a space in the query is refused"),
    pytest.param(b"/a?x\x00", "control character", id="a NUL in the query is refused"),
    pytest.param(b"/%c0%ae%c0%ae/x", "invalid utf-8", id="overlong utf-8 dots are refused"),
    pytest.param(b"/a%c0%afb", "invalid utf-8", id="an overlong utf-8 slash is refused"),
    pytest.param(b"/%ed%a0%80", "invalid utf-8", id="an encoded surrogate is refused"),
    pytest.param(b"/caf%c3", "invalid utf-8", id="a truncated utf-8 sequence is refused"),
    pytest.param(b"/%ff", "invalid utf-8", id="a byte that never starts utf-8 is refused"),
    pytest.param(b"/%252e%252e/x", "double encoding", id="double-encoded dot-dot is refused"),
    pytest.param(b"/%255c", "double encoding", id="a double-encoded backslash is refused"),
    pytest.param(b"/%252F", "double encoding", id="a double-encoded slash is refused"),
    pytest.param(b"/%2500", "double encoding", id="a double-encoded NUL is refused"),
    pytest.param(b"/%25%32%65", "double encoding", id="double encoding spelt with escapes"),
    pytest.param(b"/%25252e", "double encoding", id="triple encoding is refused"),
    pytest.param(b"/%ef%bc%8e%ef%bc%8e/x", "confusable character", id="fullwidth dot-dot"),
    pytest.param(b"/a%ef%bc%8fb", "confusable character", id="a fullwidth solidus is refused"),
    pytest.param(b"/a#frag", "fragment", id="a fragment is refused"),
    pytest.param(b"/a?x#y", "fragment", id="a fragment after the query is refused"),
    pytest.param(b"*", "not origin-form", id="asterisk-form is refused"),
    pytest.param(b"http://evil.test/a", "not origin-form", id="absolute-form is refused"),
    pytest.param(b"evil.test:443", "not origin-form", id="authority-form is refused"),
    pytest.param(b"", "not origin-form", id="an empty target is refused"),
    pytest.param(b"?a", "not origin-form", id="a bare query is refused"),
    pytest.param(b"/a%", "invalid escape", id="a percent at the end is refused"),
    pytest.param(b"/a%2", "invalid escape", id="a percent with one digit is refused"),
    pytest.param(b"/a%zz", "invalid escape", id="a percent before non-hex is refused"),
    pytest.param(b"/a%%41", "invalid escape", id="a doubled percent is refused"),
    pytest.param(b"/caf\xc3\xa9", "invalid character", id="raw non-ascii in the path is refused"),
    pytest.param(b"/a<script>", "invalid character", id="a raw angle bracket is refused"),
    pytest.param(b"/a[0]", "invalid character", id="a raw square bracket is refused"),
    pytest.param(b'/a"b', "invalid character", id="a raw double quote is refused"),
    pytest.param(b"/a{b}|c^`", "invalid character", id="raw braces and pipes are refused"),
]


@pytest.mark.parametrize(("target", "path", "query"), ACCEPTED)
def test_canonicalize_accepts(target: bytes, path: str, query: bytes | None) -> None:
    assert canonicalize(target) == (path, query)


@pytest.mark.parametrize(("target", "detail"), REFUSED)
def test_canonicalize_refuses(target: bytes, detail: str) -> None:
    with pytest.raises(BadPath) as caught:
        canonicalize(target)
    assert caught.value.detail == detail
    assert str(caught.value) == detail


# -- Path patterns ----------------------------------------------------------------------------


MATCHES = [
    pytest.param("/v1/issues", "/v1/issues", True, id="a pattern matches itself"),
    pytest.param("/v1/issues", "/v1/issues/", True, id="a pattern matches its directory form"),
    pytest.param("/v1/issues", "/v1/issues/7", True, id="a pattern matches a child"),
    pytest.param("/v1/issues", "/v1/issues/7/comments", True, id="a pattern matches descendants"),
    pytest.param("/v1/issues", "/v1/issuesX", False, id="a prefix must end at a segment"),
    pytest.param("/v1/issues", "/v1/issue", False, id="a shorter path does not match"),
    pytest.param("/v1/issues", "/v1", False, id="a parent does not match"),
    pytest.param("/v1/issues", "/V1/issues", False, id="matching is case-sensitive"),
    pytest.param("/v1/", "/v1/", True, id="a trailing-slash pattern matches its directory"),
    pytest.param("/v1/", "/v1/x", True, id="a trailing-slash pattern matches a child"),
    pytest.param("/v1/", "/v1", False, id="a trailing-slash pattern is strictly below"),
    pytest.param("/v1/", "/v1x/y", False, id="a trailing-slash pattern is segment-bounded"),
    pytest.param("/", "/", True, id="the root pattern matches the root"),
    pytest.param("/", "/anything/at/all", True, id="the root pattern matches every path"),
    pytest.param("/repos/*/issues", "/repos/a/issues", True, id="a star matches one segment"),
    pytest.param("/repos/*/issues", "/repos/a/issues/3", True, id="a star pattern has children"),
    pytest.param("/repos/*/issues", "/repos/a/b/issues", False, id="a star is only one segment"),
    pytest.param("/repos/*/issues", "/repos//issues", False, id="a star never matches empty"),
    pytest.param("/repos/*/issues", "/repos/issues", False, id="a star is not optional"),
    pytest.param("/repos/*/issues", "/repos/a/issuesX", False, id="a star pattern is bounded"),
    pytest.param("/repos/*", "/repos/a", True, id="a final star matches a child"),
    pytest.param("/repos/*", "/repos/a/b", True, id="a final star matches descendants"),
    pytest.param("/repos/*", "/repos", False, id="a final star needs a segment"),
    pytest.param("/repos/*", "/repos/", False, id="a final star does not match an empty one"),
    pytest.param("/repos/*/", "/repos/a/", True, id="a star with trailing slash matches below"),
    pytest.param("/repos/*/", "/repos/a", False, id="a star with trailing slash is strict"),
    pytest.param("/*", "/", False, id="a root star does not match the bare root"),
    pytest.param("/*/x", "/a/x", True, id="a leading star matches one segment"),
    pytest.param("/@s%2Fn", "/@s%2Fn", True, id="a literal encoded slash matches itself"),
    pytest.param("/@s%2Fn", "/@s%2Fn/-/n.tgz", True, id="a literal encoded slash has children"),
    pytest.param("/@s%2Fn", "/@s/n", False, id="a literal encoded slash is no separator"),
    pytest.param("/@s/n", "/@s%2Fn", False, id="a separator never matches an encoded slash"),
    pytest.param("/@s", "/@s%2Fn", False, id="an encoded slash does not end a segment"),
    pytest.param("/@s%2Fn", "/@s%2Fnx", False, id="an encoded-slash pattern is bounded"),
    pytest.param("/a/", "/a/b%2Fc", True, id="below a directory, a slash segment is below"),
    pytest.param("/*", "/@s%2Fn", False, id="a star skips a segment holding an encoded slash"),
    pytest.param("/p/*/i", "/p/g%2Fp/i", False, id="an inner star skips an encoded slash"),
    pytest.param("/p/*/", "/p/g%2Fp/", False, id="a star before a slash skips one too"),
    pytest.param("/p/*/i", "/p/g/i/a%2Fb", True, id="an encoded slash below a star is below"),
]


@pytest.mark.parametrize(("pattern", "path", "expected"), MATCHES)
def test_path_matches(pattern: str, path: str, expected: bool) -> None:
    assert path_matches(validate_path_pattern(pattern), path) is expected


@pytest.mark.parametrize(
    ("pattern", "path", "expected"),
    [
        pytest.param("/*", "/@s%2Fn", True, id="an opted-in star matches an encoded slash"),
        pytest.param("/p/*/i", "/p/a%2Fb%2Fc/i", True, id="and several in one segment"),
        pytest.param("/*", "/@s/n", True, id="an opted-in star still matches plain segments"),
        pytest.param("/p/*/i", "/p/a/b/i", False, id="an opted-in star is still one segment"),
        pytest.param("/p/*/i", "/p//i", False, id="an opted-in star never matches empty"),
        pytest.param("/@s/n", "/@s%2Fn", False, id="opting in changes no literal segment"),
    ],
)
def test_path_matches_with_encoded_slash(pattern: str, path: str, expected: bool) -> None:
    assert path_matches(validate_path_pattern(pattern), path, encoded_slash=True) is expected


@pytest.mark.parametrize(
    "pattern",
    [
        pytest.param("/", id="the root is a pattern"),
        pytest.param("/v1/issues", id="a plain path is a pattern"),
        pytest.param("/v1/", id="a trailing slash is allowed"),
        pytest.param("/repos/*/issues", id="a star may be a whole inner segment"),
        pytest.param("/repos/*/", id="a star may precede a trailing slash"),
        pytest.param("/*", id="a star may be the only segment"),
        pytest.param("/a.b/~x/!$&'()+,=:@", id="pchar punctuation is allowed"),
        pytest.param("/...", id="three dots are an ordinary segment"),
        pytest.param("/@scope%2Fname", id="an encoded slash between two names"),
        pytest.param("/p/g%2Fs%2Fp/*/i", id="several encoded slashes before a star"),
        pytest.param("/a%2F.../", id="three dots beside an encoded slash"),
    ],
)
def test_validate_pattern_accepts(pattern: str) -> None:
    assert validate_path_pattern(pattern) == pattern


def test_a_pattern_writes_its_encoded_slash_as_canonicalize_does() -> None:
    assert validate_path_pattern("/@scope%2fname/-/") == "/@scope%2Fname/-/"
    assert canonicalize(b"/@scope%2fname/-/")[0] == "/@scope%2Fname/-/"


@pytest.mark.parametrize(
    "pattern",
    [
        pytest.param("", id="an empty pattern is refused"),
        pytest.param("v1/issues", id="a relative pattern is refused"),
        pytest.param("https://api.test/v1", id="a URL is refused"),
        pytest.param("//", id="a pattern of two slashes is refused"),
        pytest.param("//v1", id="a leading empty segment is refused"),
        pytest.param("/v1//x", id="an inner empty segment is refused"),
        pytest.param("/v1//", id="a doubled trailing slash is refused"),
        pytest.param("/a/../b", id="a dot-dot segment is refused"),
        pytest.param("/./a", id="a dot segment is refused"),
        pytest.param("/a/.", id="a final dot segment is refused"),
        pytest.param("/a;b", id="a semicolon is refused"),
        pytest.param("/a?b", id="a question mark is refused"),
        pytest.param("/a#b", id="a hash is refused"),
        pytest.param("/a%41b", id="a percent escape is refused"),
        pytest.param("/a%20b", id="an escape that is not a slash is refused"),
        pytest.param("/a%5Cb", id="an encoded backslash is refused"),
        pytest.param("/a%2", id="a truncated escape is refused"),
        pytest.param("/a%2F", id="a trailing encoded slash is refused"),
        pytest.param("/%2Fa", id="a leading encoded slash is refused"),
        pytest.param("/a%2F%2Fb", id="an empty part between encoded slashes is refused"),
        pytest.param("/a%2F..", id="a dot-dot part is refused"),
        pytest.param("/a%2F./b", id="a dot part is refused"),
        pytest.param("/a%2F%2e%2e", id="an encoded dot-dot part is refused"),
        pytest.param("/*%2Fa", id="a star beside an encoded slash is refused"),
        pytest.param("/a%2F*", id="a star after an encoded slash is refused"),
        pytest.param("/a%252Fb", id="a double-encoded slash is refused"),
        pytest.param("/a\\b", id="a backslash is refused"),
        pytest.param("/a b", id="a space is refused"),
        pytest.param("/a\nb", id="a newline is refused"),
        pytest.param("/caf\u00e9", id="non-ascii is refused"),
        pytest.param("/a*", id="a star inside a segment is refused"),
        pytest.param("/*b", id="a star before text is refused"),
        pytest.param("/**", id="a double star is refused"),
    ],
)
def test_validate_pattern_refuses(pattern: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        validate_path_pattern(pattern)
    message = str(caught.value)
    assert repr(pattern) in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("pattern", "ok"),
    [
        pytest.param("/", True, id="accept the root"),
        pytest.param("/v1/issues", True, id="accept a prefix"),
        pytest.param("/v1/", True, id="accept a trailing slash"),
        pytest.param("/repos/*/issues", True, id="accept a star segment"),
        pytest.param("/a-b_c.d~e/@x:y", True, id="accept unreserved and sub-delim characters"),
        pytest.param("v1", False, id="refuse no leading slash"),
        pytest.param("", False, id="refuse empty"),
        pytest.param("/a//b", False, id="refuse an empty segment"),
        pytest.param("//", False, id="refuse a double slash"),
        pytest.param("/a/../b", False, id="refuse a dot-dot segment"),
        pytest.param("/a/./b", False, id="refuse a dot segment"),
        pytest.param("/..", False, id="refuse a final dot-dot"),
        pytest.param("/v1/issue*", False, id="refuse a partial star"),
        pytest.param("/a/%2e%2e/b", False, id="refuse percent-encoding"),
        pytest.param("/a;x=1", False, id="refuse matrix parameters"),
        pytest.param("/a?b=1", False, id="refuse a query"),
        pytest.param("/a#b", False, id="refuse a fragment"),
        pytest.param("/a b", False, id="refuse a space"),
        pytest.param("/a\\b", False, id="refuse a backslash"),
    ],
)
def test_validate_path_pattern(pattern: str, ok: bool) -> None:
    if ok:
        assert validate_path_pattern(pattern) == pattern
    else:
        with pytest.raises(InvalidInput, match="invalid path pattern"):
            validate_path_pattern(pattern)


PATHISH = "/.%2eEfF5ca;\\x"
# Tokens that keep most generated targets acceptable, so the properties below see real paths.
TOKENS = ["a", "b", "A", "~", "@", ":", ".", "..", "%2e", "%2E", "%41", "%c3%a9", "%25", "%20"]
TOKENS += ["%2F", "%2f"]
segments = st.lists(st.sampled_from(TOKENS), min_size=1, max_size=3).map("".join)
targets = st.builds(
    lambda parts, slash, query: (
        "/" + "/".join(parts) + ("/" if slash and parts else "") + query
    ).encode(),
    st.lists(segments, max_size=6),
    st.booleans(),
    st.sampled_from(["", "?", "?a=1&b=%2F"]),
)
any_targets = st.one_of(
    st.binary(max_size=40),
    st.binary(max_size=40).map(lambda b: b"/" + b),
    st.text(PATHISH, max_size=40).map(lambda s: ("/" + s).encode()),
    st.text(PATHISH, max_size=40).map(str.encode),
    targets,
)
patterns = st.builds(
    lambda parts, slash: "/" + "/".join(parts) + ("/" if slash and parts else ""),
    st.lists(st.sampled_from(["a", "b", "A", "~", "a.b", "@", "a%2Fb", "@s%2F~"]), max_size=3),
    st.booleans(),
)


def canonical_or_none(target: bytes) -> str | None:
    try:
        return canonicalize(target)[0]
    except BadPath as e:
        assert e.detail in DETAILS
        return None


@settings(max_examples=300, deadline=None)
@given(any_targets)
def test_canonicalize_raises_only_bad_path_with_a_fixed_detail(target: bytes) -> None:
    canonical_or_none(target)


@settings(max_examples=300, deadline=None)
@given(st.one_of(targets, any_targets))
def test_canonicalize_is_idempotent(target: bytes) -> None:
    path = canonical_or_none(target)
    if path is not None:
        assert canonicalize(path.encode()) == (path, None)


@settings(max_examples=500, deadline=None)
@given(st.one_of(targets, any_targets))
def test_the_fast_path_agrees_with_the_segment_by_segment_path(target: bytes) -> None:
    """canonicalize returns a plain path unchanged without parsing it; the full parser must
    give the same answer for every target the shortcut takes, and refuse none of them."""
    try:
        path, _ = canonicalize(target)
    except BadPath:
        return
    assert _canonical_path(target.partition(b"?")[0]) == path


@settings(max_examples=300, deadline=None)
@given(st.one_of(targets, any_targets))
def test_canonical_path_has_no_ambiguous_parts(target: bytes) -> None:
    path = canonical_or_none(target)
    if path is None:
        return
    assert path.startswith("/")
    assert "//" not in path
    assert not {".", ".."} & set(path.split("/"))
    assert "%5C" not in path.upper()
    # A backend that decodes %2F before routing sees no empty or dot segment either.
    decoded = decode_slashes(path).split("/")[1:]
    if path.endswith("/"):
        decoded.pop()
    assert not {"", ".", ".."} & set(decoded), path
    assert path.isascii()
    assert not any(c in path for c in "\\;?# \x00")


@settings(max_examples=300, deadline=None)
@given(patterns, targets)
def test_a_plain_pattern_matches_only_itself_and_below(pattern: str, target: bytes) -> None:
    path = canonical_or_none(target)
    if path is None or not path_matches(validate_path_pattern(pattern), path):
        return
    if pattern.endswith("/"):
        assert path.startswith(pattern)
    else:
        assert path == pattern or path.startswith(pattern + "/")


@settings(max_examples=300, deadline=None)
@given(patterns, targets, st.integers(min_value=0))
def test_a_star_generalises_the_segment_it_replaces(
    pattern: str, target: bytes, which: int
) -> None:
    path = canonical_or_none(target)
    parts = pattern.strip("/").split("/")
    if path is None or pattern == "/" or not path_matches(pattern, path):
        return
    parts[which % len(parts)] = "*"
    starred = "/" + "/".join(parts) + ("/" if pattern.endswith("/") else "")
    assert path_matches(validate_path_pattern(starred), path, encoded_slash=True)


def decode_slashes(text: str) -> str:
    return text.replace("%2F", "/")


@settings(max_examples=500, deadline=None)
@given(patterns, targets, st.integers(min_value=0))
def test_what_a_grant_matches_a_slash_decoding_backend_would_match_too(
    pattern: str, target: bytes, which: int
) -> None:
    """Without the opt-in, a grant never covers a path that a backend decoding %2F would
    read as a path outside it: %2F is no separator to the grant, and may be one upstream."""
    path = canonical_or_none(target)
    if path is None:
        return
    for candidate in {pattern, _starred(pattern, which)}:
        if path_matches(validate_path_pattern(candidate), path):
            assert path_matches(decode_slashes(candidate), decode_slashes(path)), candidate


SLASHED = st.sampled_from(["a%2Fb", "b%2fa", "@s%2F~", "a%2F~%2Fb", "a", "b"])


@settings(max_examples=300, deadline=None)
@given(patterns, st.integers(min_value=0), SLASHED, st.lists(SLASHED, max_size=2))
def test_a_star_never_covers_what_a_slash_decoding_backend_reads_as_more_segments(
    pattern: str, which: int, filler: str, tail: list[str]
) -> None:
    """The same, with the star's own segment holding %2F: the case a star could get wrong."""
    starred = _starred(pattern, which)
    if starred == "/":
        return
    parts = [filler if part == "*" else part for part in starred.strip("/").split("/")]
    path = canonical_or_none(("/" + "/".join(parts + tail)).encode())
    if path is not None and path_matches(starred, path):
        assert path_matches(decode_slashes(starred), decode_slashes(path)), (starred, path)


def _starred(pattern: str, which: int) -> str:
    if pattern == "/":
        return pattern
    parts = pattern.strip("/").split("/")
    parts[which % len(parts)] = "*"
    return "/" + "/".join(parts) + ("/" if pattern.endswith("/") else "")


@settings(max_examples=300, deadline=None)
@given(patterns, st.integers(min_value=0))
def test_every_path_pattern_is_its_own_canonical_path(pattern: str, which: int) -> None:
    """What an operator may write as a pattern, the canonicaliser leaves as it is."""
    starred = pattern
    if pattern != "/":
        parts = pattern.strip("/").split("/")
        parts[which % len(parts)] = "*"
        starred = "/" + "/".join(parts) + ("/" if pattern.endswith("/") else "")
    validate_path_pattern(starred)
    assert canonicalize(starred.encode()) == (starred, None)
    assert path_matches(starred, starred.replace("*", "x"))


def test_path_patterns_and_request_paths_share_one_pchar_set() -> None:
    """A character a pattern may hold is one a canonical path keeps as it is, and no other."""
    for char in map(chr, range(0x80)):
        if char in "/*":  # structure: the separator, and the star of a whole segment
            continue
        text = f"/a{char}b"
        try:
            in_patterns = validate_path_pattern(text) == text
        except InvalidInput:
            in_patterns = False
        try:
            kept = canonicalize(text.encode()) == (text, None)
        except BadPath:
            kept = False
        assert in_patterns == (char in PCHAR) == kept, repr(char)


# -- Expiry -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("30s", NOW + timedelta(seconds=30), id="seconds"),
        pytest.param("10m", NOW + timedelta(minutes=10), id="minutes"),
        pytest.param("2h", NOW + timedelta(hours=2), id="hours"),
        pytest.param("7d", NOW + timedelta(days=7), id="days"),
        pytest.param(
            "2031-01-01T00:00:00+02:00", datetime(2030, 12, 31, 22, tzinfo=UTC), id="ISO with zone"
        ),
        pytest.param("2031-01-01T00:00:00Z", datetime(2031, 1, 1, tzinfo=UTC), id="ISO with Z"),
        pytest.param("2031-01-01T00:00:00", datetime(2031, 1, 1, tzinfo=UTC), id="naive is UTC"),
        pytest.param("2031-01-01", datetime(2031, 1, 1, tzinfo=UTC), id="a date"),
    ],
)
def test_parse_expiry_accepts(text: str, expected: datetime) -> None:
    when = parse_expiry(text, now=NOW)
    assert when == expected
    assert when.utcoffset() == timedelta(0)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        pytest.param("2030-06-01T11:59:59Z", "past", id="refuse an instant in the past"),
        pytest.param("2030-06-01T12:00:00Z", "past", id="refuse now"),
        pytest.param("2030-06-01T13:00:00+02:00", "past", id="refuse the past in another zone"),
        pytest.param("0s", "use 30s", id="refuse a zero duration"),
        pytest.param("-5m", "use 30s", id="refuse a negative duration"),
        pytest.param("1w", "use 30s", id="refuse an unknown unit"),
        pytest.param("10 m", "use 30s", id="refuse a space"),
        pytest.param("tomorrow", "use 30s", id="refuse words"),
        pytest.param("", "use 30s", id="refuse empty"),
        pytest.param("999999999d", "too far", id="refuse a duration past the calendar"),
    ],
)
def test_parse_expiry_refuses(text: str, reason: str) -> None:
    with pytest.raises(InvalidInput, match=reason):
        parse_expiry(text, now=NOW)


def test_parse_expiry_defaults_to_the_current_time() -> None:
    before = datetime.now(UTC)
    assert (
        before + timedelta(seconds=29)
        < parse_expiry("30s")
        <= datetime.now(UTC) + timedelta(seconds=30)
    )
