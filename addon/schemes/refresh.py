"""oauth2-refresh (RFC 6749 .6): access tokens from a stored refresh token.

With the store at hand, each refresh runs under the credential's row lock
(store.credentials.exchange): the refresh token is read from the store, not from memory, and
a rotated one is sealed back with the access token it came with before that token is used.
Another replica that waited on the lock finds that access token still fresh and uses it, so
a provider that invalidates a refresh token on use sees each one once.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from typing import TYPE_CHECKING, Any

from addon.schemes.https import TIMEOUT, MintFailed, Post
from addon.schemes.minters import FORM, Endpoint, bearer, client_auth, form_body, json_answer
from addon.schemes.tokens import REFRESH_AT, Token, token
from store.errors import Conflict, CredproxyError

if TYPE_CHECKING:
    from store.records import CredentialRecord

_REFRESH = re.compile(r"[\x21-\x7e]{1,4096}")
# Sealed beside the refresh token: the access token it last gave, for the other replicas.
# `access_for` names the settings it was minted for: after `apply` changed the scope or the
# token URL (the secret untouched), a token minted for the old ones is never taken up again.
SHARED = ("access_token", "access_issued", "access_expires", "access_for")


def sealed(credential: CredentialRecord) -> tuple[bytes, ...]:
    """The secret's parts as the store holds them: the client secret, the refresh token, and
    the access token a replica sealed beside it (stamped by the others)."""
    keys = json.loads(credential.secret.reveal())
    found = (keys.get("client_secret"), keys["refresh_token"], keys.get("access_token"))
    return tuple(value.encode() for value in found if value)


class OAuth2Refresh:
    def __init__(self, credential: CredentialRecord, vault: Any) -> None:
        """`vault`: the store, where the rotated refresh token is sealed back."""
        keys = json.loads(credential.secret.reveal())
        options = credential.options
        self.name, self._fingerprint = credential.name, credential.fingerprint
        self._endpoint = Endpoint(options["token_url"])
        self.host, self.port = self._endpoint.host, self._endpoint.port
        self._id: str = keys["client_id"]
        self._secret: str | None = keys.get("client_secret")
        self._refresh: str = keys["refresh_token"]
        default = "basic" if self._secret is not None else "none"
        self._auth: str = options.get("client_auth", default)
        self._scope = " ".join(options.get("scope", ()))
        self._vault = vault
        self._refused: str | None = None  # the access token an upstream answered 401 to
        settings = [options["token_url"], self._scope, self._auth, self._id]
        self._for = hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:16]

    def __repr__(self) -> str:
        return "OAuth2Refresh([secure])"

    def refused(self, token: Token) -> None:
        self._refused = token.value.decode("ascii")

    def secrets(self) -> tuple[bytes, ...]:
        found = (self._secret, self._refresh)
        return tuple(value.encode() for value in found if value)

    def mint(self, post: Post) -> Token:
        if self._vault is None:  # no store (unit tests): the refresh token lives in memory
            found, _ = self._exchange(post, {"refresh_token": self._refresh})
        else:
            found = self._sealing(post)
        if isinstance(found, MintFailed):
            raise found  # what was rotated is sealed already
        return found

    def _sealing(self, post: Post) -> Token | MintFailed:
        try:
            found: Token | MintFailed = self._vault.exchange_credential(
                self.name,
                self._fingerprint,
                lambda data: self._exchange(post, data),
                hold=TIMEOUT + 5,  # the endpoint's call, inside the row lock
            )
        except Conflict as e:
            raise MintFailed("the credential changed while its token was refreshed") from e
        except CredproxyError as e:
            raise MintFailed("the store did not answer: the refresh token stays sealed") from e
        return found

    def _exchange(
        self, post: Post, data: dict[str, Any]
    ) -> tuple[Token | MintFailed, dict[str, Any] | None]:
        """One refresh with the refresh token `data` holds; what to seal back, if anything.
        An answer that rotates the refresh token but gives no usable access token still has
        the new refresh token sealed (the old one is spent): the failure is returned, to be
        raised once that is committed."""
        self._refresh = data["refresh_token"]
        now = time.time()
        shared = data.get("access_token")
        if (
            shared
            and shared != self._refused
            and data.get("access_for") == self._for
            and now
            < data["access_issued"] + REFRESH_AT * (data["access_expires"] - data["access_issued"])
        ):
            return token(shared, data["access_expires"] - now), None  # another replica's
        form = {"grant_type": "refresh_token", "refresh_token": self._refresh}
        if self._scope:
            form["scope"] = self._scope
        headers = FORM | client_auth(self._auth, self._id, self._secret, form)
        answer = json_answer(post(self._endpoint.target, form_body(form), headers))
        rotated = answer.get("refresh_token")
        if rotated is not None and (
            not isinstance(rotated, str) or not _REFRESH.fullmatch(rotated)
        ):
            raise MintFailed("the token endpoint's answer has no usable refresh_token")
        updated = {k: v for k, v in data.items() if k not in SHARED}
        updated["refresh_token"] = rotated or self._refresh
        try:
            fresh = bearer(answer)
        except MintFailed as e:
            if rotated is None:
                raise
            self._refresh = updated["refresh_token"]
            return e, updated
        updated |= {
            "access_token": fresh.value.decode("ascii"),
            "access_issued": now,
            "access_expires": now + fresh.lifetime,
            "access_for": self._for,
        }
        self._refresh = updated["refresh_token"]
        return fresh, updated
