from datetime import UTC, datetime, timedelta

import pytest
from publicsuffix2 import PSL_FILE, PublicSuffixList

from store.errors import InvalidInput
from store.patterns import (
    HostPattern,
    _is_public_suffix,
    parse_expiry,
    parse_host,
    validate_header_name,
    validate_method,
    validate_name,
    validate_path_pattern,
)

NOW = datetime(2030, 6, 1, 12, 0, tzinfo=UTC)


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
    assert before + timedelta(seconds=29) < parse_expiry("30s") <= datetime.now(UTC) + timedelta(
        seconds=30
    )

