"""The schemes that write the stored secret as it is, the same on every request: bearer,
basic and header (a header field), query (a query parameter)."""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING
from urllib.parse import quote, unquote_to_bytes

from addon.schemes.stamp import Stamp, write

if TYPE_CHECKING:
    from mitmproxy import http

    from store.records import CredentialRecord


def header_for(credential: CredentialRecord) -> tuple[str, str]:
    """The header field a bearer, basic or header credential is sent in."""
    secret = credential.secret.reveal()
    if credential.scheme == "bearer":
        return "Authorization", "Bearer " + secret.decode("ascii")
    if credential.scheme == "basic":
        return "Authorization", "Basic " + base64.b64encode(secret).decode("ascii")
    assert credential.scheme == "header" and credential.header_name is not None
    return credential.header_name, secret.decode("ascii")


class HeaderStamp(Stamp):
    """bearer, basic, header: one header field, replacing the agent's."""

    __slots__ = ()

    def __init__(self, credential: CredentialRecord) -> None:
        name, value = header_for(credential)
        super().__init__(credential, ((name.encode("ascii"), value.encode("ascii")),))


class QueryStamp(Stamp):
    """query: one query parameter, replacing the agent's."""

    __slots__ = ("param",)

    def __init__(self, credential: CredentialRecord) -> None:
        super().__init__(credential)
        assert credential.param_name is not None
        self.param = credential.param_name

    def apply(self, flow: http.HTTPFlow, path: str, query: bytes | None) -> None:
        query = stamp_query(query, self.param, self.secret)
        write(flow.request, self.names, self.fields, path, query)


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
