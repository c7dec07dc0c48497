"""Redaction of echoed secrets, across chunk boundaries."""

from __future__ import annotations

import base64
import itertools
from unittest import mock
from urllib.parse import quote

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from addon.redaction import redact
from addon.redaction.redact import MARK, SLICE, Redactor, Unredactable, _begins, encodings
from tests.fakes import LONG_SECRET

SECRET = b"sk-live/abc+def=123"


def run(redactor: Redactor, chunks: list[bytes]) -> bytes:
    return b"".join(redactor.feed(c) for c in chunks) + redactor.feed(b"")


def test_every_form_is_redacted():
    body = b" | ".join([SECRET, base64.b64encode(SECRET), quote(SECRET, safe="").encode(), b"fine"])
    redactor = Redactor([SECRET])
    out = run(redactor, [body])
    assert out == b" | ".join([MARK, MARK, MARK, b"fine"])
    assert redactor.count == 3


def test_a_secret_split_across_chunks_is_redacted():
    redactor = Redactor([SECRET])
    body = b"xx" + SECRET + b"yy"
    for cut in range(len(body)):
        redactor = Redactor([SECRET])
        assert run(redactor, [body[:cut], body[cut:]]) == b"xx" + MARK + b"yy"


def test_text_that_cannot_start_a_secret_is_not_held_back():
    redactor = Redactor([SECRET])
    assert redactor.feed(b"data: event-1\n\n") == b"data: event-1\n\n"


@settings(max_examples=200, deadline=None)
@given(
    prefix=st.binary(max_size=40),
    suffix=st.binary(max_size=40),
    cuts=st.lists(st.integers(min_value=0, max_value=120), max_size=6),
)
def test_redaction_never_lets_the_secret_through(prefix, suffix, cuts):
    body = prefix + SECRET + suffix
    points = sorted({min(c, len(body)) for c in cuts})
    chunks = [body[a:b] for a, b in zip([0, *points], [*points, len(body)], strict=True)]
    out = run(Redactor([SECRET]), chunks)
    assert SECRET not in out
    assert base64.b64encode(SECRET) not in out


@given(body=st.binary(max_size=200), at=st.integers(min_value=0, max_value=200))
@settings(max_examples=200)
def test_a_held_body_is_redacted_like_a_stream(body: bytes, at: int):
    body = body[:at] + SECRET + body[at:]
    held, streamed = Redactor([SECRET]), Redactor([SECRET])
    assert held.whole(body) == run(streamed, [body])
    assert held.count == streamed.count >= 1
    assert SECRET not in held.whole(body)


def test_header_values_holding_a_secret_are_redacted_and_names_holding_one_dropped():
    redactor = Redactor([SECRET])
    fields = (
        (b"content-type", b"application/json"),
        (b"x-echo", b"Bearer " + SECRET),
        (b"x-" + base64.b64encode(SECRET), b"1"),
        (b"www-authenticate", quote(SECRET, safe="").encode()),
    )
    assert redactor.headers(fields) == (
        (b"content-type", b"application/json"),
        (b"x-echo", b"Bearer " + MARK),
        (b"www-authenticate", MARK),
    )
    assert redactor.count == 3


def test_headers_without_a_secret_come_back_unchanged():
    redactor = Redactor([SECRET])
    fields = ((b"content-type", b"text/plain"), (b"x-part", SECRET[:6]), (b"x-rest", SECRET[6:]))
    assert redactor.headers(fields) is fields
    assert redactor.count == 0


def test_a_held_body_exactly_as_long_as_the_shortest_form_is_redacted():
    # whole() skips bodies shorter than every form; one of exactly that length is a secret.
    assert Redactor([b"abcd"]).whole(b"abcd") == MARK
    assert Redactor([b"abcd"]).whole(b"abc") == b"abc"


# -- every escaping of a form ---------------------------------------------------------------

JSON_SHORT = {b'"': b'\\"', b"\\": b"\\\\", b"/": b"\\/", b"\n": b"\\n", b"\t": b"\\t"}


def _hex(byte: int, upper: tuple[bool, bool]) -> bytes:
    return bytes(
        ord(chr(d).upper()) if up else d for d, up in zip(b"%02x" % byte, upper, strict=True)
    )


@st.composite
def escaped(draw: st.DrawFn, form: bytes) -> bytes:
    """`form` with each byte written independently: literal, %hh in either case, +, JSON,
    HTML/XML references."""
    out = b""
    for byte in form:
        char = bytes((byte,))
        ways = [char, b"%" + _hex(byte, draw(st.tuples(st.booleans(), st.booleans())))]
        if char == b" ":
            ways.append(b"+")
        if byte < 0x80:
            ways.append(b"\\u00" + _hex(byte, draw(st.tuples(st.booleans(), st.booleans()))))
        if char in JSON_SHORT:
            ways.append(JSON_SHORT[char])
        if byte < 0x80:
            ways.append(draw(reference(byte)))
        out += draw(st.sampled_from(ways))
    return out


NAMED = {b"&": [b"&amp;", b"&AMP;"], b"<": [b"&lt;", b"&LT;"], b">": [b"&gt;", b"&GT;"]}
NAMED |= {b'"': [b"&quot;", b"&QUOT;"], b"'": [b"&apos;"]}
# HTML5's names, as an HTML5 serializer (PHP's htmlentities with ENT_HTML5) writes them.
NAMED |= {b"+": [b"&plus;"], b"/": [b"&sol;"], b"=": [b"&equals;"], b"_": [b"&lowbar;"]}
NAMED |= {b"`": [b"&DiacriticalGrave;", b"&grave;"], b"|": [b"&VerticalLine;", b"&vert;"]}
NAMED |= {b"\n": [b"&NewLine;"], b"\\": [b"&bsol;"], b":": [b"&colon;"]}


@st.composite
def reference(draw: st.DrawFn, byte: int) -> bytes:
    """An HTML/XML character reference to `byte`, as serializers write them."""
    kind = draw(st.sampled_from(["decimal", "x", "X", "named"]))
    if kind == "named" and bytes((byte,)) in NAMED:
        return draw(st.sampled_from(NAMED[bytes((byte,))]))
    if kind in ("decimal", "named"):
        return b"&#%0*d;" % (draw(st.sampled_from([1, 3, 4])), byte)
    digits = b"%0*x" % (draw(st.sampled_from([1, 2, 4])), byte)
    cased = bytes(ord(chr(d).upper()) if draw(st.booleans()) else d for d in digits)
    return b"&#" + kind.encode() + cased + b";"


def _forms(secret: bytes) -> list[bytes]:
    b64 = base64.b64encode(secret)
    url = base64.urlsafe_b64encode(secret)
    return [f for f in (secret, b64, b64.rstrip(b"="), url, url.rstrip(b"=")) if len(f) >= 4]


def _chunks(body: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(body)) for c in cuts})
    return [body[a:b] for a, b in zip([0, *points], [*points, len(body)], strict=True)]


secrets = st.binary(min_size=4, max_size=24).filter(lambda s: s not in MARK)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), secret=secrets, prefix=st.binary(max_size=30), suffix=st.binary(max_size=30))
def test_any_escaping_of_any_form_is_redacted_whole_and_at_every_split(
    data, secret, prefix, suffix
):
    form = data.draw(st.sampled_from(_forms(secret)))
    echo = data.draw(escaped(form))
    body = prefix + echo + suffix
    out = Redactor([secret]).whole(body)
    assert echo not in out and secret not in out
    assert MARK in out
    for cut in range(len(body) + 1):
        streamed = run(Redactor([secret]), [body[:cut], body[cut:]])
        assert echo not in streamed and secret not in streamed, cut
    cuts = data.draw(st.lists(st.integers(0, len(body)), max_size=8))
    streamed = run(Redactor([secret]), _chunks(body, cuts))
    assert echo not in streamed and secret not in streamed


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    secret=secrets,
    pieces=st.lists(st.binary(max_size=12), max_size=8),
    cuts=st.lists(st.integers(0, 200), max_size=8),
)
def test_text_without_a_form_is_unchanged_and_wholly_emitted(data, secret, pieces, cuts):
    # Unfinished escaped forms between random bytes: held back at most, never altered.
    starts = [
        data.draw(escaped(f))[: data.draw(st.integers(0, len(f) - 1))] for f in _forms(secret)
    ]
    body = b"".join(p + s for p, s in zip(pieces, starts * 3, strict=False))
    redactor = Redactor([secret])
    assume(redactor.whole(body) == body and redactor.count == 0)
    assert run(Redactor([secret]), _chunks(body, cuts)) == body


@pytest.mark.parametrize(
    "echo",
    [
        pytest.param(b"sk-live%2fabc%2bdef%3d123", id="lower-case hex escapes"),
        pytest.param(b"sk-live/abc%2Bdef%3D123", id="a slash left unescaped"),
        pytest.param(b"sk-live%2Fabc+def=123".replace(b"+", b"%2b"), id="mixed escapes"),
        pytest.param(b"sk-live\\/abc+def=123", id="a JSON-escaped slash"),
        pytest.param(b"\\u0073k-live/abc\\u002Bdef=123", id="JSON unicode escapes"),
        pytest.param(base64.b64encode(SECRET).replace(b"=", b"%3D"), id="URL-encoded base64"),
    ],
)
def test_escaped_echoes_are_redacted(echo: bytes):
    assert Redactor([SECRET]).whole(b'{"q": "' + echo + b'"}') == b'{"q": "' + MARK + b'"}'


def test_json_escaped_base64_is_redacted():
    secret = b"\xfb\xff\xbf\xfb"  # base64 "+/+/+w==": a JSON encoder may write "\\/"
    echo = base64.b64encode(secret).replace(b"/", b"\\/")
    assert b"\\/" in echo
    assert Redactor([secret]).whole(b'"' + echo + b'"') == b'"' + MARK + b'"'


def test_double_encoding_is_not_decoded():
    # Documented: %25 is an escaped percent sign, and `%252F` is not a slash.
    echo = b"sk-live%252Fabc+def=123"
    assert Redactor([SECRET]).whole(echo) == echo


@pytest.mark.parametrize(
    "end",
    [b"sk-live", b"sk-live%", b"sk-live%2", b"sk-live\\", b"sk-live\\u00", b"sk-live\\u002"],
)
def test_an_unfinished_escape_at_a_chunk_end_is_held_back(end: bytes):
    redactor = Redactor([SECRET])
    assert redactor.feed(b"data: " + end) == b"data: "
    assert redactor.feed(b"") == end


def test_a_secret_re_formed_around_a_mark_is_redacted_again():
    secret = b"ED]abc"  # a single pass would leave "[REDACTED]abc", which holds it again
    assert Redactor([secret]).whole(secret + b"abc") == b"[REDACT" + MARK


def test_a_secret_inside_the_mark_fails_closed():
    with pytest.raises(Unredactable):
        Redactor([b"EDAC"]).whole(b"EDAC")


def test_a_message_boundary_inside_a_form_is_seen():
    redactor = Redactor([SECRET])
    assert redactor.spans(b"x sk-li", b"ve/abc+def=123")
    assert not redactor.spans(b"x sk-li", b"nux")
    assert not redactor.spans(b"done ", SECRET)  # whole in the second: redacted there


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "zstd"])
def test_a_chunk_decoding_past_the_limit_is_refused(encoding: str) -> None:
    import gzip
    import zlib

    import zstandard

    from addon.redaction.redact import DECODE_LIMIT, DecodeLimit, Decoder

    plain = b"\0" * (DECODE_LIMIT + 1)
    packers = {
        "gzip": gzip.compress,
        "deflate": zlib.compress,
        "zstd": zstandard.ZstdCompressor().compress,
    }
    packed = packers[encoding](plain)
    with pytest.raises(DecodeLimit):
        Decoder(encoding).feed(packed)
    decoder = Decoder(encoding)
    assert decoder.feed(packers[encoding](b"hello")) + decoder.feed(b"") == b"hello"


def test_brotli_is_not_decoded() -> None:
    from addon.redaction.redact import Decoder

    with pytest.raises(ValueError, match="unsupported"):
        Decoder("br")


def test_a_held_body_ending_in_the_start_of_a_secret_is_sent_whole() -> None:
    # A held (buffered) body has no next chunk: nothing may be kept back as a possible
    # secret prefix, or the body is cut short under a corrected Content-Length.
    body = b"token " + LONG_SECRET + b" then " + LONG_SECRET[:6]
    assert Redactor([LONG_SECRET]).whole(body) == b"token " + MARK + b" then " + LONG_SECRET[:6]


# -- the sieve: only the neighbourhood of a possible form is searched -----------------------


def _unsieved(secret: bytes, body: bytes) -> tuple[bytes, int]:
    """Redaction as it was before the sieve: the full pattern over the whole body."""
    pattern = Redactor([secret])._c.pattern  # type: ignore[union-attr]
    count = 0
    for _ in range(8):
        body, n = pattern.subn(MARK, body)
        count += n
        if not n:
            break
    return body, count


def _unsieved_partial(redactor: Redactor, data: bytes) -> int:
    c = redactor._c
    assert c is not None
    for m in c.starts.finditer(data, max(0, len(data) - c.longest + 1)):
        if any(_begins(data, m.start(), n) for n in c.needles):
            return len(data) - m.start()
    return 0


@st.composite
def near_misses(draw: st.DrawFn, secret: bytes) -> bytes:
    """Bytes full of escape starts, hex digits, pieces of the secret's forms and escapings."""
    pieces = [b"%", b"\\", b"\\u00", b"+", b"/", b"\\/", b"0", b"a", b"F", b"=", b" "]
    # Escape leads (the finder's two-byte patterns) next to texts and escapes.
    pieces += [b"%2", b"%3", b"%4", b"%5", b"%6", b"%7", b"\\u", b"\\\\", b"&", b"&#", b"&#x"]
    pieces += [f[: draw(st.integers(1, len(f)))] for f in _forms(secret)]
    pieces += [draw(escaped(f))[: draw(st.integers(1, 12))] for f in _forms(secret)]
    parts = draw(st.lists(st.sampled_from(pieces) | st.binary(max_size=6), max_size=40))
    return b"".join(parts)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), secret=secrets)
def test_the_sieve_never_hides_a_form_the_full_pattern_finds(data, secret):
    noise = data.draw(near_misses(secret))
    echoes = data.draw(st.lists(st.sampled_from(_forms(secret)), max_size=3))
    body = noise
    for form in echoes:
        at = data.draw(st.integers(0, len(body)))
        body = body[:at] + data.draw(escaped(form)) + body[at:]
    redactor = Redactor([secret])
    expected, count = _unsieved(secret, body)
    assert redactor.whole(body) == expected
    assert redactor.count == count
    assert redactor.partial(body) == _unsieved_partial(redactor, body)
    # Both sieves, the finder's and the regex pass for text dense with escape starts.
    c = redactor._c
    assert c is not None
    found = c.pattern.search(body) is not None
    assert c.suspect(body, dense=False)[0] is found
    assert c.suspect(body, dense=True)[0] is found
    with mock.patch.object(redact, "_KEPT", 0):  # every whole escape checked, never one search
        assert c.suspect(body, dense=True)[0] is found


@settings(max_examples=40, deadline=None)
@given(data=st.data(), secret=secrets)
def test_the_dense_sieve_keeps_an_escape_inside_every_match(data, secret):
    """Forms escaped byte by byte among near misses and lone escapes of the secret's bytes:
    the escapes the dense sieve keeps, windowed, find what the full pattern finds."""
    lone = [e for b in secret for e in encodings(b)[1:]]
    parts = data.draw(st.lists(st.sampled_from(lone) | near_misses(secret), max_size=12))
    for form in data.draw(st.lists(st.sampled_from(_forms(secret)), max_size=2)):
        parts.insert(data.draw(st.integers(0, len(parts))), data.draw(escaped(form)))
    body = b"".join(parts)
    c = Redactor([secret])._c
    assert c is not None
    with mock.patch.object(redact, "_KEPT", 0):
        assert c.suspect(body, dense=True)[0] is (c.pattern.search(body) is not None)


def _unsieved_cut(redactor: Redactor, raw: bytes) -> int:
    """Where a stream is cut after a replacement, by every form's start (no sieve)."""
    c = redactor._c
    assert c is not None
    cut = len(raw) - _unsieved_partial(redactor, raw)
    for start in range(max(0, cut - c.longest), cut):
        m = c.pattern.match(raw, start)
        if m is not None and m.start() == start and m.end() > cut:
            return start
    return cut


def _unsieved_stream(secret: bytes, pieces: list[bytes]) -> tuple[bytes, int]:
    """Streamed redaction as it was before the sieve."""
    redactor, tail, out, count = Redactor([secret]), b"", [], 0
    for piece in pieces:
        raw = tail + piece
        data, n = _unsieved(secret, raw)
        if n:
            cut = _unsieved_cut(redactor, raw)
            data, n = _unsieved(secret, raw[:cut])
            hold = _unsieved_partial(redactor, data)
            out.append(data[: len(data) - hold])
            tail, count = data[len(data) - hold :] + raw[cut:], count + n
            continue
        hold = _unsieved_partial(redactor, data)
        out.append(data[: len(data) - hold])
        tail, count = data[len(data) - hold :], count + n
    rest, n = _unsieved(secret, tail)
    return b"".join(out) + rest, count + n


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    secret=secrets,
    size=st.integers(1_000, 100_000),
    piece=st.sampled_from([7, 4096, 16_384, 65_535]),
)
def test_echoes_far_apart_in_a_large_body_are_redacted_at_any_piece_size(data, secret, size, piece):
    # Windows around sieve hits in a body much longer than a form; echoes spread over pieces.
    rng = data.draw(st.randoms(use_true_random=False))
    body = rng.randbytes(size if piece > 7 else 3_000)
    echoes = []
    for form in data.draw(st.lists(st.sampled_from(_forms(secret)), min_size=1, max_size=4)):
        at = data.draw(st.integers(0, len(body)))
        echoes.append(data.draw(escaped(form)))
        body = body[:at] + echoes[-1] + body[at:]
    pieces = [body[i : i + piece] for i in range(0, len(body), piece)]
    expected, count = _unsieved_stream(secret, pieces)
    redactor = Redactor([secret])
    out = run(redactor, pieces)
    assert out == expected
    assert redactor.count == count >= 1
    assert not any(echo in out for echo in echoes)


@pytest.mark.parametrize(
    "before",
    [
        pytest.param(b"%73", id="an escape of one of the secret's bytes, alone"),
        pytest.param(b"sk-live", id="the start of the secret, alone"),
        pytest.param(b"\\u0073k", id="a JSON escape and a byte, alone"),
    ],
)
def test_a_form_far_past_a_lone_near_miss_is_redacted(before: bytes):
    # The sieve's first window holds only the near miss; the form is in a later one.
    filler = b"." * 5000
    body = before + filler + SECRET + filler + before
    expected = before + filler + MARK + filler + before
    assert Redactor([SECRET]).whole(body) == expected
    assert run(Redactor([SECRET]), [body[:7000], body[7000:]]) == expected


def test_a_text_right_after_an_escape_lead_is_found():
    # `%4` leads escapes of the forms' bytes 0x40-0x4f; `%4z` is none. The finder reports no
    # overlaps, so it reports the lead and not the text that begins one byte on.
    secret = b"4zzzzzzzzzzz"
    assert any(0x40 <= b <= 0x4F for b in base64.b64encode(secret))
    body = b"%" + secret + b"."
    assert Redactor([secret]).whole(body) == b"%" + MARK + b"."
    assert run(Redactor([secret]), [body[:5], body[5:]]) == b"%" + MARK + b"."


@pytest.mark.parametrize("piece", [4096, 65536])
def test_echoes_in_text_dense_with_escape_starts_are_redacted(piece: int):
    # `%20` everywhere: `%2` leads the escapes of `-` and `/`, so pieces take the regex pass;
    # every REPROBE-th piece tries the finder again. Echoes in dense and in plain stretches.
    secret = b"sk-live/abc+def=123"
    dense = b"a%20b " * 20_000
    plain = b"." * 200_000
    body = dense[:50_000] + secret + dense[50_000:] + plain + quote(secret, safe="").encode()
    body += plain + dense
    expected = dense[:50_000] + MARK + dense[50_000:] + plain + MARK + plain + dense
    redactor = Redactor([secret])
    out = run(redactor, [body[i : i + piece] for i in range(0, len(body), piece)])
    assert out == expected
    assert redactor.count == 2


@pytest.mark.parametrize("at", [0, 5, 11])
def test_a_form_with_one_escape_alone_between_binary_bytes_is_redacted(at: int):
    # The finder's hit is the escape; the form around it is the only run of the forms'
    # alphabet there, two bytes longer than the secret.
    secret = b"4zzzzzzzzzzz"
    escape = b"%%%02X" % secret[at]
    form = secret[:at] + escape + secret[at + 1 :]
    body = b"\x00\xff" * 40 + form + b"\x00\xff" * 40
    expected = b"\x00\xff" * 40 + MARK + b"\x00\xff" * 40
    assert Redactor([secret]).whole(body) == expected
    assert run(Redactor([secret]), [body[:70], body[70:]]) == expected


def test_a_form_inside_a_longer_unfinished_one_does_not_expose_the_longer_one():
    # The shorter secret is whole at the chunk's end and replaced; the longer one that holds
    # it is unfinished there. Its bytes must not go out on either side of the mark.
    longer, shorter = b"abcd1234efgh", b"1234"
    expected = Redactor([longer, shorter]).whole(b"x" + longer + b"y")
    assert expected == b"x" + MARK + b"y"
    for cut in range(1, len(longer)):
        chunks = [b"x" + longer[:cut], longer[cut:] + b"y"]
        assert run(Redactor([longer, shorter]), chunks) == expected


def test_a_secret_whose_base64_begins_with_it_is_redacted_whole_when_streamed():
    secret = b"Vm0wd2QyUXlV"
    form = base64.b64encode(secret)
    assert form.startswith(secret)
    assert run(Redactor([secret]), [form[:12], form[12:]]) == MARK


def test_a_periodic_secret_in_a_long_stream_holds_little_back():
    # Forms overlap everywhere: the cut moves back one form at most, never to the start.
    redactor = Redactor([b"aaaa"])
    out = []
    for _ in range(50):
        out.append(redactor.feed(b"a" * 1000))
        assert len(redactor._tail) <= 3 * redactor._c.longest  # type: ignore[union-attr]
    out.append(redactor.feed(b""))
    assert b"aaaa" not in b"".join(out)


def test_html5_named_references_of_base64_bytes_are_redacted():
    # `+/+/+0FC` as PHP's htmlentities(..., ENT_HTML5) writes it.
    secret = base64.b64decode(b"+/+/+0FC")
    body = b"<p>&plus;&sol;&plus;&sol;&plus;0FC</p>"
    assert Redactor([secret]).whole(body) == b"<p>" + MARK + b"</p>"
    assert run(Redactor([secret]), [body[:9], body[9:]]) == b"<p>" + MARK + b"</p>"


def test_a_whole_form_straddling_where_a_stream_would_be_cut_is_held_whole():
    # The chunk ends with `abcd12`, which begins the longer secret again, so the cut falls
    # inside its first, whole echo, which holds the shorter secret: cut before that echo.
    longer, shorter = b"abcd1234efab", b"1234"
    body = longer + b"cd12" + b"34efgh"
    expected = Redactor([longer, shorter]).whole(body)
    assert longer not in expected and shorter not in expected
    out = run(Redactor([longer, shorter]), [body[:16], body[16:]])
    assert out == expected
    assert b"abcd" not in out


@pytest.mark.parametrize("shift", [-40, -3, 0, 5])
def test_a_form_across_a_slice_boundary_of_a_large_piece_is_redacted(shift: int):
    # A decoded chunk may be megabytes: it is sieved in overlapping slices.
    secret = b"4zzzzzzzzzzz"
    form = b"%34" + secret[1:6] + b"\\u007a" + secret[7:]
    at = 3 * SLICE + shift
    body = b"\x00" * at + form + b"\x00" * (2 * SLICE)
    redactor = Redactor([secret])
    assert redactor.whole(body) == b"\x00" * at + MARK + b"\x00" * (2 * SLICE)


def test_a_large_piece_dense_with_escape_leads_is_sieved_in_bounded_memory():
    # 8 MiB of escape leads (a decoded chunk may be that long): the finder's hits are listed a
    # slice at a time, not all at once (512 MiB at once, before).
    import tracemalloc

    secret = b"sk-live/abc+def=123"
    body = b"%2" * (4 * 1024 * 1024)
    redactor = Redactor([secret])
    tracemalloc.start()
    try:
        out = redactor.feed(body)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert out + redactor.feed(b"") == body
    assert peak < len(body) * 3 + 32 * 1024 * 1024


@pytest.mark.parametrize("secret", [b"ab-c", b"a%2b", b"aaaa", b"&#3;", b"a b/", b"+/=a"])
def test_every_short_text_over_the_escapes_alphabet_is_held_and_redacted_as_without_the_sieve(
    secret: bytes,
):
    """Exhaustive over pieces of the secret's escapes: the tail held back and the redaction
    are those of the walk of every encoding from every place, and of the full pattern."""
    redactor = Redactor([secret])
    c = redactor._c
    assert c is not None
    # An escape whole or cut, of the first few of each byte (`%2d` and `%2D` do not differ).
    pieces = {e[:k] for b in secret for e in encodings(b)[:5] for k in (1, len(e) - 1, len(e))}
    pieces = sorted(pieces | {b"%", b"&#", b"\\u00", b"x", b";"})
    for size in range(1, 4):
        for parts in itertools.product(pieces, repeat=size):
            text = b"z" + b"".join(parts)
            assert redactor.partial(text) == _unsieved_partial(redactor, text), text
            assert redactor.whole(text) == _unsieved(secret, text)[0], text
            found = c.pattern.search(text) is not None
            assert bool(_dense_hits(c, text)) >= found, text  # every escape checked


def _dense_hits(c: redact._Compiled, data: bytes) -> list[int]:
    """The dense sieve's kept hits: a match lies within `reach` of one."""
    return c._kept(data, redact._exact(c).find_matches_as_indexes(data, overlapping=True))


def test_the_dense_sieve_sees_a_form_that_begins_inside_an_escape():
    """`%41` is an escape of the secret's `A`, and the secret itself begins at its `4`: a
    finder that reported only non-overlapping hits would give the escape (which nothing of
    the form precedes, so it is dropped) and skip the form."""
    secret = b"41Abcdefghijklmnop"
    body = b"x%" + secret + b"x"
    c = Redactor([secret])._c
    assert c is not None
    assert _dense_hits(c, body) == [2]
    with mock.patch.object(redact, "_KEPT", 0):
        assert c.suspect(body * 40, dense=True)[0]
