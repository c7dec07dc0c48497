"""Writing a credential onto a request: replace, never append."""

from __future__ import annotations

import base64
import weakref
from typing import TYPE_CHECKING, NoReturn
from urllib.parse import quote, unquote_to_bytes

from store.records import CredentialRecord
from store.rules.mintspec import DEFAULT_PREFIX, MINTED

if TYPE_CHECKING:
    from addon.core.policy import Policy
    from addon.schemes.mint import TokenSession
    from addon.schemes.sigv4 import Signer


def header_for(credential: CredentialRecord) -> tuple[str, str] | None:
    """The header a credential is sent in, or None for the query, sigv4 and path schemes."""
    secret = credential.secret.reveal()
    if credential.scheme == "bearer":
        return "Authorization", "Bearer " + secret.decode("ascii")
    if credential.scheme == "basic":
        return "Authorization", "Basic " + base64.b64encode(secret).decode("ascii")
    if credential.scheme == "header":
        assert credential.header_name is not None
        return credential.header_name, secret.decode("ascii")
    return None


def redacted(credential: CredentialRecord) -> tuple[bytes, ...]:
    """What redaction looks for of a credential as the store holds it now: its secret, or
    the parts of one (a sigv4 key pair; a minted scheme's client secret, private key, refresh
    token, and the access token sealed beside it for the replicas)."""
    try:
        if credential.scheme == "oauth2-refresh":
            from addon.schemes.refresh import sealed

            return sealed(credential)
        if credential.scheme in MINTED:
            from addon.schemes.mint import TOKENS, minter_for

            return minter_for(credential, TOKENS.vault).secrets()
        if credential.scheme == "sigv4":
            from addon.schemes.sigv4 import key_secrets

            return key_secrets(credential)
    except (ValueError, KeyError, TypeError):  # no scheme could stamp it: looked for whole
        return (credential.secret.reveal(),)
    return (credential.secret.reveal(),)


def slot(name: bytes) -> bytes:
    """The header a field name lands in at the upstream: case and `_` / `-` ignored."""
    return name.lower().replace(b"_", b"-")


class Stamp:
    """What one credential writes onto every request it is stamped on, built once per policy.

    `fields` replace every field of the same names (`names`, lower-case); a query credential
    has `param` instead of a header, a sigv4 credential a `signer` (its fields are written per
    request), a path credential a `placeholder` and the `positions` it may take, a minted one
    its `minted` session and the `token_header` (name, prefix) its token goes in.
    Accept-Encoding: identity is always among the fields: redaction must see the response
    body as sent. `secrets` are what redaction looks for. Its repr never shows a secret.
    """

    __slots__ = (
        "fields",
        "names",
        "param",
        "secret",
        "secrets",
        "signer",
        "placeholder",
        "positions",
        "minted",
        "token_header",
    )

    def __init__(self, credential: CredentialRecord) -> None:
        self.secret = credential.secret.reveal()
        self.secrets: tuple[bytes, ...] = (self.secret,)
        self.param: str | None = None
        self.signer: Signer | None = None
        self.placeholder: str | None = None
        self.positions: tuple[str, ...] = ()
        self.minted: TokenSession | None = None
        self.token_header: tuple[bytes, bytes] = (b"", b"")
        fields = [(b"accept-encoding", b"identity")]
        removed: frozenset[bytes] = frozenset()
        if credential.scheme == "sigv4":
            from addon.schemes.sigv4 import AGENT_HEADERS, Signer

            self.signer = Signer(credential)
            self.secrets = self.signer.secrets
            removed = AGENT_HEADERS
        elif credential.scheme in MINTED:
            from addon.schemes.mint import TOKENS

            self.minted = TOKENS.get(credential)
            self.secrets = self.minted.minter.secrets()
            name = (credential.header_name or "Authorization").encode("ascii")
            prefix = credential.options.get("token_prefix", DEFAULT_PREFIX).encode("ascii")
            self.token_header = (name, prefix)
            removed = frozenset({slot(name)})
        elif credential.scheme == "path":
            self.placeholder = credential.options["placeholder"]
            self.positions = tuple(credential.options["positions"])
        else:
            header = header_for(credential)
            if header is not None:
                fields.append((header[0].encode("ascii"), header[1].encode("ascii")))
            else:
                self.param = credential.param_name
                assert self.param is not None
        self.fields = tuple(fields)
        # Lower-case, `_` as `-`: backends behind CGI or WSGI read X_Api_Key as X-Api-Key.
        self.names = frozenset(slot(name) for name, _ in fields) | removed

    def __repr__(self) -> str:
        return "Stamp([secure])"

    def __reduce__(self) -> NoReturn:
        raise TypeError("a Stamp cannot be pickled")

    def placed(self, path: str, target: bytes, headers: dict[bytes, list[bytes]]) -> str | None:
        """The path as it leaves, the secret in the placeholder's place; None if the request
        carries the placeholder anywhere but once at one of its positions, or the secret."""
        assert self.placeholder is not None
        decoded = unquote_to_bytes(target)
        if decoded.lower().count(self.placeholder.lower().encode()) != 1:
            return None
        if self.secret in decoded or any(self.secret in v for vs in headers.values() for v in vs):
            return None
        for position in self.positions:
            at = position.replace("{}", self.placeholder)
            if path == at or path.startswith(at + "/"):
                return position.replace("{}", self.secret.decode("ascii")) + path[len(at) :]
        return None


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


_STAMPS: weakref.WeakKeyDictionary[Policy, dict[str, tuple[CredentialRecord, Stamp]]] = (
    weakref.WeakKeyDictionary()
)


def stamp_for(policy: Policy, credential: CredentialRecord) -> Stamp:
    """The credential's Stamp, built on first use of each version of it under this policy."""
    stamps = _STAMPS.setdefault(policy, {})
    found = stamps.get(credential.name)
    if found is not None and found[0] is credential:
        return found[1]
    stamp = Stamp(credential)
    # A request still holding a rotated credential's old record gets its own Stamp.
    if policy.current(credential):
        stamps[credential.name] = (credential, stamp)
    return stamp
