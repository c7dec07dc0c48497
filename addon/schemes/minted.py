"""The minted schemes on a request (oauth2-client, oauth2-refresh, google-service-account,
github-app): the credential's current token in its header, dropped on an upstream 401."""

from __future__ import annotations

from typing import TYPE_CHECKING

from addon.schemes.mint import TOKENS, minter_for
from addon.schemes.refresh import sealed
from addon.schemes.renewal import Unavailable
from addon.schemes.stamp import WATCHED, Stamp, Stamping, slot, write
from addon.schemes.tokens import UNAVAILABLE, Token, TokenSession
from store.rules.mintspec import DEFAULT_PREFIX

if TYPE_CHECKING:
    from mitmproxy import http

    from addon.core.verdict import HeaderScan, Verdict
    from store.records import CredentialRecord

EXPIRED = "the minted token expired before the request left"


class MintedStamp(Stamp):
    """The session's token, after `token_prefix`, in `header_name` (Authorization)."""

    __slots__ = ("session", "token_header")

    def __init__(self, credential: CredentialRecord) -> None:
        name = (credential.header_name or "Authorization").encode("ascii")
        super().__init__(credential, removed=frozenset({slot(name)}))
        self.session = TOKENS.get(credential)
        prefix = credential.options.get("token_prefix", DEFAULT_PREFIX).encode("ascii")
        self.token_header = (name, prefix)

    @classmethod
    def stored(cls, credential: CredentialRecord) -> tuple[bytes, ...]:
        return minter_for(credential, TOKENS.vault).secrets()

    def prepare(
        self, verdict: Verdict, request: http.Request, headers: HeaderScan, limit: int
    ) -> Stamping:
        return Minting(self)


class RefreshStamp(MintedStamp):
    """oauth2-refresh: the store holds the refresh token and the access token beside it."""

    __slots__ = ()

    @classmethod
    def stored(cls, credential: CredentialRecord) -> tuple[bytes, ...]:
        return sealed(credential)


class Minting(Stamping):
    """One request's minted token, taken as the request leaves."""

    __slots__ = ("stamp", "session", "token", "token_fp")

    def __init__(self, stamp: MintedStamp) -> None:
        self.stamp, self.session = stamp, stamp.session
        self.token: Token | None = None
        self.token_fp: str | None = None

    def pending(self) -> TokenSession | None:
        session = self.session
        return session if session.now() is None else None

    def redacted(self) -> tuple[bytes, ...]:
        token = self.session.now()
        if token is None:  # expired while the request waited: never stamp it
            raise Unavailable(EXPIRED, UNAVAILABLE)
        self.token, self.token_fp = token, token.fingerprint
        # The long-lived secret's parts as they are now (a refresh token rotates).
        return self.session.minter.secrets() + (token.value,)

    def apply(self, flow: http.HTTPFlow, path: str, query: bytes | None) -> None:
        token = self.token
        assert token is not None
        stamp = self.stamp
        name, prefix = stamp.token_header
        write(flow.request, stamp.names, (*stamp.fields, (name, prefix + token.value)), path, query)
        WATCHED[flow] = self

    def answered(self, status: int) -> None:
        if status == 401 and self.token is not None:
            self.session.drop(self.token)
