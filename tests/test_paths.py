import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from addon.paths import DETAILS, BadPath, _canonical_path, canonicalize, path_matches
from store.errors import InvalidInput
from store.patterns import validate_path_pattern as validate_pattern

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
    pytest.param(b"/a%2fb", "encoded slash", id="a lower-case encoded slash is refused"),
    pytest.param(b"/a%2Fb", "encoded slash", id="an upper-case encoded slash is refused"),
    pytest.param(b"/..%2f..%2fetc", "encoded slash", id="traversal hidden by encoded slashes"),
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
]


@pytest.mark.parametrize(("pattern", "path", "expected"), MATCHES)
def test_path_matches(pattern: str, path: str, expected: bool) -> None:
    assert path_matches(validate_pattern(pattern), path) is expected


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
    ],
)
def test_validate_pattern_accepts(pattern: str) -> None:
    assert validate_pattern(pattern) == pattern


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
        pytest.param("/a%2fb", id="a percent escape is refused"),
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
        validate_pattern(pattern)
    message = str(caught.value)
    assert repr(pattern) in message
    assert "\n" not in message


PATHISH = "/.%2eEfF5ca;\\x"
# Tokens that keep most generated targets acceptable, so the properties below see real paths.
TOKENS = ["a", "b", "A", "~", "@", ":", ".", "..", "%2e", "%2E", "%41", "%c3%a9", "%25", "%20"]
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
    st.lists(st.sampled_from(["a", "b", "A", "~", "a.b", "@"]), max_size=3),
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
    assert "%2F" not in path.upper()
    assert "%5C" not in path.upper()
    assert path.isascii()
    assert not any(c in path for c in "\\;?# \x00")


@settings(max_examples=300, deadline=None)
@given(patterns, targets)
def test_a_plain_pattern_matches_only_itself_and_below(pattern: str, target: bytes) -> None:
    path = canonical_or_none(target)
    if path is None or not path_matches(validate_pattern(pattern), path):
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
    assert path_matches(validate_pattern(starred), path)
