"""Writing a credential onto a request: replace, never append."""

from __future__ import annotations

import base64
from typing import NoReturn
from urllib.parse import quote, unquote_to_bytes

from store.records import CredentialRecord


def header_for(credential: CredentialRecord) -> tuple[str, str] | None:
    """The header a credential is sent in, or None for the query scheme."""
    secret = credential.secret.reveal()
    if credential.scheme == "bearer":
        return "Authorization", "Bearer " + secret.decode("ascii")
    if credential.scheme == "basic":
        return "Authorization", "Basic " + base64.b64encode(secret).decode("ascii")
    if credential.scheme == "header":
        assert credential.header_name is not None
        return credential.header_name, secret.decode("ascii")
    return None


def slot(name: bytes) -> bytes:
    """The header a field name lands in at the upstream: case and `_` / `-` ignored."""
    return name.lower().replace(b"_", b"-")


class Stamp:
    """What one credential writes onto every request it is stamped on, built once per policy.

    `fields` replace every field of the same names (`names`, lower-case); a query credential
    has `param` instead of a header. Accept-Encoding: identity is always among the fields:
    redaction must see the response body as sent. Its repr never shows the secret.
    """

    __slots__ = ("fields", "names", "param", "secret")

    def __init__(self, credential: CredentialRecord) -> None:
        self.secret = credential.secret.reveal()
        fields = [(b"accept-encoding", b"identity")]
        header = header_for(credential)
        if header is not None:
            fields.append((header[0].encode("ascii"), header[1].encode("ascii")))
        self.fields = tuple(fields)
        # Lower-case, `_` as `-`: backends behind CGI or WSGI read X_Api_Key as X-Api-Key.
        self.names = frozenset(slot(name) for name, _ in fields)
        self.param = credential.param_name if header is None else None
        assert header is not None or self.param is not None

    def __repr__(self) -> str:
        return "Stamp([secure])"

    def __reduce__(self) -> NoReturn:
        raise TypeError("a Stamp cannot be pickled")


def stamp_query(query: bytes | None, param: str, secret: bytes) -> bytes:
    """Drop every `param` the client sent (in any encoding), then add ours, URL-encoded."""
    wanted = param.encode()

    def theirs(part: bytes) -> bool:
        return unquote_to_bytes(part.split(b"=", 1)[0].replace(b"+", b" ")) == wanted

    kept = []
    for pair in query.split(b"&") if query else []:
        # Some parsers split on ";" too: a `;param=` inside a pair is the client's as well.
        pair = b";".join(part for part in pair.split(b";") if not theirs(part))
        if pair:
            kept.append(pair)
    kept.append(wanted + b"=" + quote(secret, safe="").encode("ascii"))
    return b"&".join(kept)
