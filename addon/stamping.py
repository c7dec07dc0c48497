"""Writing a credential onto a request: replace, never append."""

from __future__ import annotations

import base64
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


def stamp_query(query: bytes | None, param: str, secret: bytes) -> bytes:
    """Drop every `param` the client sent (in any encoding), then add ours, URL-encoded."""
    wanted = param.encode()
    kept = [
        pair
        for pair in (query.split(b"&") if query else [])
        if pair and unquote_to_bytes(pair.split(b"=", 1)[0].replace(b"+", b" ")) != wanted
    ]
    kept.append(wanted + b"=" + quote(secret, safe="").encode("ascii"))
    return b"&".join(kept)
