"""The minted credentials' token sessions, kept across policy reloads: TOKENS.

`credproxy run` wires TOKENS once (how to dial the token endpoints, the CA file, the store
for oauth2-refresh, the mint counter); every session reads that wiring at each mint.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from addon.observe import audit
from addon.redaction.redactset import MINTED, SETS
from addon.schemes.https import Dial, MintFailed, Tunnel
from addon.schemes.minters import GitHubApp, GoogleServiceAccount, OAuth2Client
from addon.schemes.refresh import OAuth2Refresh
from addon.schemes.tokens import Minter, TokenSession
from store.rules.mintspec import token_version

if TYPE_CHECKING:
    from store.records import CredentialRecord

__all__ = ["TOKENS", "TokenSession", "Tokens", "minter_for"]


class Tokens:
    """Every minted credential's session, kept across policy reloads (keyed by what defines
    it); `retain` drops those of credentials rotated or removed."""

    def __init__(self) -> None:
        self.dial: Dial = _no_network
        self.tunnel: Tunnel | None = None  # through the corporate proxy, when there is one
        self.cafile: str | None = None
        self.vault: Any = None  # the store, for schemes that seal state back (oauth2-refresh)
        self.count: Callable[[str, str], None] = lambda credential, outcome: None
        self._sessions: dict[str, tuple[str, TokenSession]] = {}
        self._live: Mapping[str, str] | None = None  # name -> token_version, at the last reload

    def get(self, credential: CredentialRecord) -> TokenSession:
        key = token_version(credential)
        if self._live is not None and self._live.get(credential.name) != key:
            # A request holding a record from before a rotation or removal: it gets a closed
            # session (no token), and never displaces the live credential's.
            stale = TokenSession(credential.name, minter_for(credential, self.vault), self)
            stale.close()
            return stale
        found = self._sessions.get(credential.name)
        if found is not None and found[0] == key:
            return found[1]
        if found is not None:
            found[1].close()  # rotated or changed: its token must not be stamped any more
            SETS.hold(credential.name, MINTED, ())  # retired: redacted for the grace period
        session = TokenSession(credential.name, minter_for(credential, self.vault), self)
        self._sessions[credential.name] = (key, session)
        return session

    def retain(self, live: Mapping[str, str]) -> None:
        """Keep only the sessions of these credentials as they are now (name ->
        token_version): rotated, removed, or with other settings (apply), a session is
        dropped."""
        self._live = dict(live)
        for name, (key, session) in list(self._sessions.items()):
            if live.get(name) != key:
                held = session.current
                session.close()
                del self._sessions[name]
                SETS.hold(name, MINTED, ())
                if held is not None:
                    audit.logger().info(
                        "token.dropped",
                        credential=name,
                        token_fp=held.fingerprint,
                        cause="credential-changed",
                    )


async def _no_network(host: str, port: int) -> tuple[str, int]:
    raise MintFailed("no proxy is running to reach the token endpoint")


def minter_for(credential: CredentialRecord, vault: Any) -> Minter:
    """The minter of the credential's scheme; `vault` is the store (oauth2-refresh seals its
    rotated refresh token back)."""
    if credential.scheme == "oauth2-client":
        return OAuth2Client(credential)
    if credential.scheme == "google-service-account":
        return GoogleServiceAccount(credential)
    if credential.scheme == "github-app":
        return GitHubApp(credential)
    return OAuth2Refresh(credential, vault)


TOKENS = Tokens()
