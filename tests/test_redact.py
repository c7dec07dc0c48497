"""Redaction of echoed secrets, across chunk boundaries."""

from __future__ import annotations

import base64
from urllib.parse import quote

from hypothesis import given, settings
from hypothesis import strategies as st

from addon.redact import MARK, Redactor

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
