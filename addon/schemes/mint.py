"""Minted tokens: short-lived tokens made from a stored secret, cached and refreshed ahead.

One TokenSession per credential (its fingerprint and settings are its key, so a rotated or
changed credential gets a new one and the old token is dropped). The first request that
needs a token waits for the mint; every other request at the same time waits for the same
mint (single flight). A token is refreshed in the background at REFRESH_AT of its lifetime,
and never stamped within its margin of expiry (MARGIN_SHARE of the lifetime, at most
MAX_MARGIN): tokens living a few seconds work as tokens living an hour do. A failed mint
backs off (BACKOFF doubling up to MAX_BACKOFF); meanwhile requests that need a token are
refused at once. An upstream 401 on a stamped token drops it, at most once per COOLDOWN.

The token endpoint is dialled as an upstream is (--resolve, or the destination guard's
vetted lookup) over verified TLS (--upstream-ca honoured); the call carries nothing of the
agent's request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import urllib3
import urllib3.connection

from addon.observe import audit
from addon.redaction.redactset import MINTED, SETS
from addon.schemes.https import Answer, Dial, MintFailed, Post, https_call
from addon.schemes.minters import GitHubApp, GoogleServiceAccount, OAuth2Client
from addon.schemes.refresh import OAuth2Refresh
from addon.schemes.tokens import (
    BACKOFF,
    CHANGED,
    COOLDOWN,
    IDLE,
    MAX_BACKOFF,
    Minter,
    Token,
    Unavailable,
)
from store.rules.mintspec import token_version

if TYPE_CHECKING:
    from store.records import CredentialRecord

class TokenSession:
    """One credential's current token and the task refreshing it."""

    def __init__(self, name: str, minter: Minter, tokens: Tokens) -> None:
        self.name = name
        self.minter = minter
        self._tokens = tokens
        self.current: Token | None = None
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._used = time.monotonic()
        self._failures = 0
        self._retry_at = 0.0
        self._failure = "no token yet"
        self._dropped_at = -COOLDOWN
        self.mints = 0
        self.closed = False  # rotated or removed: never mints again

    def __repr__(self) -> str:
        return f"TokenSession({self.name!r})"

    def now(self) -> Token | None:
        """The token to stamp, if it is usable for a while yet (a request is using it)."""
        self._used = time.monotonic()
        current = self.current
        if current is None or self.closed or time.monotonic() >= current.usable_until:
            return None
        return current

    async def ensure(self) -> Token:
        """A usable token, minted first if there is none. Raises: Unavailable."""
        if self.closed:
            raise Unavailable(CHANGED)
        if self.now() is None:
            if time.monotonic() < self._retry_at:
                raise Unavailable(self._failure)  # backing off: the endpoint is not asked
            task = self._renewal()
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                if not task.cancelled():
                    raise  # this request itself was cancelled
                raise Unavailable(CHANGED) from None
        found = self.now()
        if found is None:
            raise Unavailable(self._failure)
        return found

    def drop(self, stamped: Token) -> None:
        """The upstream refused `stamped` (401): the next request mints a fresh token, unless
        a token was dropped within COOLDOWN (a provider that keeps refusing is not hammered)."""
        now = time.monotonic()
        if self.current is not stamped or now - self._dropped_at < COOLDOWN:
            return
        self._dropped_at = now
        self.current = None
        self.minter.refused(stamped)
        audit.logger().warning(
            "token.dropped",
            credential=self.name,
            token_fp=stamped.fingerprint,
            cause="upstream-401",
        )

    def close(self) -> None:
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
        if self._task is not None:
            self._task.cancel()
        self.current = None

    def _renewal(self) -> asyncio.Task[None]:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._renew())
        return self._task

    def _refresh(self) -> None:
        if not self.closed:
            self._renewal()

    async def _renew(self) -> None:
        loop = asyncio.get_running_loop()
        minter = self.minter
        try:
            address = await self._tokens.dial(minter.host, minter.port)
            cafile = self._tokens.cafile

            def post(target: str, body: bytes, headers: dict[str, str]) -> Answer:
                return https_call(
                    address, minter.host, minter.port, cafile, "POST", target, body, headers
                )

            fresh = await asyncio.to_thread(self._mint, post)
        except Exception as e:  # noqa: BLE001 - the old token serves until its margin, then deny
            self._failed(loop, e)
            return
        self.current = fresh
        self.mints += 1
        self._failures = 0
        self._retry_at = 0.0
        self._tokens.count(self.name, "minted")
        audit.logger().info(
            "token.minted",
            credential=self.name,
            token_fp=fresh.fingerprint,
            expires_in_s=round(fresh.lifetime, 1),
        )
        self._schedule(loop, max(fresh.refresh_at - time.monotonic(), 0.0))

    def _mint(self, post: Post) -> Token:
        """In a thread: the token, in the redaction set (compiled here) before it is stamped."""
        fresh = self.minter.mint(post)
        SETS.hold(self.name, MINTED, (*self.minter.secrets(), fresh.value), build=True)
        return fresh

    def _failed(self, loop: asyncio.AbstractEventLoop, e: Exception) -> None:
        self._failures += 1
        delay = min(BACKOFF * 2 ** (self._failures - 1), MAX_BACKOFF)
        self._retry_at = time.monotonic() + delay
        fields: dict[str, Any] = {"error_type": type(e).__name__}
        if isinstance(e, MintFailed):
            self._failure = e.detail
            fields |= {"status": e.status, "error_code": e.code}
        elif isinstance(e, urllib3.exceptions.NewConnectionError):  # a ConnectTimeoutError too
            self._failure = "the token endpoint could not be reached"
        elif isinstance(e, TimeoutError | urllib3.exceptions.TimeoutError):
            self._failure = "the token endpoint did not answer in time"
        else:
            self._failure = "the token endpoint could not be reached"
        self._tokens.count(self.name, "failed")
        audit.logger().warning(
            "token.mint_failed",
            credential=self.name,
            detail=self._failure,
            retry_in_s=delay,
            valid=self.now() is not None,
            **fields,
        )
        self._schedule(loop, delay)

    def _schedule(self, loop: asyncio.AbstractEventLoop, delay: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.closed and time.monotonic() - self._used < IDLE:
            self._timer = loop.call_later(delay, self._refresh)


class Tokens:
    """Every minted credential's session, kept across policy reloads (keyed by what defines
    it); `retain` drops those of credentials rotated or removed."""

    def __init__(self) -> None:
        self.dial: Dial = _no_network
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
