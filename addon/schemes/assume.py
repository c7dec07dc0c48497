"""AssumeRole for sigv4 credentials: temporary keys from STS, renewed before they expire.

The stored keys sign only the AssumeRole call (botocore's SigV4Auth, to the global endpoint
sts.amazonaws.com, dialled like any upstream: --resolve or the vetted resolver, verified
TLS). Requests are signed with the temporary keys it returns. A session renews itself in the
background once two thirds of its life have passed (the loop is renewal.py's), and retries
every RETRY seconds while STS fails; keys within MARGIN of their expiry are never used: the
request is refused 502 `credentials-unavailable` instead.
"""

from __future__ import annotations

import asyncio
import time
import xml.etree.ElementTree as ET  # noqa: S405 - STS's answer over verified TLS, size-bounded
from datetime import datetime
from typing import TYPE_CHECKING, Any, NamedTuple
from urllib.parse import urlencode

from addon.observe import audit
from addon.redaction.redactset import ROLE, SETS
from addon.schemes.awssdk import botocore
from addon.schemes.https import Dial, Tunnel, https_call
from addon.schemes.renewal import IDLE, Renewal, Unavailable

if TYPE_CHECKING:
    from botocore.credentials import Credentials

__all__ = ["IDLE", "RoleSession", "SESSIONS", "Sessions", "Temporary", "Unavailable"]

STS_HOST = "sts.amazonaws.com"
DURATION = 3600
MARGIN = 1.0
RETRY = 2.0
ROLE_UNAVAILABLE = "the role's temporary credentials could not be renewed"
_NS = "{https://sts.amazonaws.com/doc/2011-06-15/}"


class Temporary(NamedTuple):
    credentials: Credentials
    expires: float  # time.time()
    secrets: tuple[bytes, ...]


class RoleSession(Renewal[Temporary]):
    """One role of one credential: its current temporary keys, and the task renewing them.

    Unlike a token session, closing one (its credential rotated or changed) cancels its
    renewals but keeps its keys: requests holding the old record sign with them until they
    expire.
    """

    error = "role-keys-unavailable"
    changed = ROLE_UNAVAILABLE

    def __init__(
        self,
        name: str,
        base: Credentials,
        options: dict[str, Any],
        dial: Dial,
        cafile: str | None,
        tunnel: Tunnel | None = None,
    ) -> None:
        super().__init__(name)
        self._base = base
        self.arn: str = options["assume_role"]
        self._external_id: str | None = options.get("external_id")
        self._policy: str | None = options.get("session_policy")
        self._dial = dial
        self._cafile = cafile
        self._tunnel = tunnel
        self._failure = ROLE_UNAVAILABLE

    def _usable(self, value: Temporary) -> bool:
        return time.time() < value.expires - MARGIN

    async def _obtain(self) -> Temporary:
        address = await self._dial(STS_HOST, 443)
        return await asyncio.to_thread(self._fetch, address)

    def _renewed(self, fresh: Temporary) -> float:
        left = fresh.expires - time.time()
        audit.logger().info("credentials.renewed", credential=self.name, expires_in_s=round(left))
        return max(left * 2 / 3, MARGIN)

    def _failed(self, e: Exception) -> float:
        audit.logger().warning(
            "credentials.renewal_failed",
            credential=self.name,
            error_type=type(e).__name__,
            valid=self._valid() is not None,
        )
        return RETRY

    def _fetch(self, address: tuple[str, int]) -> Temporary:
        """In a thread: new keys, in the redaction set (compiled here) before they sign."""
        fresh = self._assume(address)
        SETS.hold(self.name, ROLE, fresh.secrets, build=True)
        return fresh

    def _assume(self, address: tuple[str, int]) -> Temporary:
        """One AssumeRole call (in a thread). Raises on any failure."""
        form = {
            "Action": "AssumeRole",
            "Version": "2011-06-15",
            "RoleArn": self.arn,
            "RoleSessionName": f"credproxy-{self.name}"[:64],
            "DurationSeconds": str(DURATION),
        }
        if self._external_id is not None:
            form["ExternalId"] = self._external_id
        if self._policy is not None:
            form["Policy"] = self._policy
        sdk = botocore()
        request = sdk.AWSRequest(method="POST", url=f"https://{STS_HOST}/", data=urlencode(form))
        request.headers["Host"] = STS_HOST
        request.headers["Content-Type"] = "application/x-www-form-urlencoded; charset=utf-8"
        sdk.SigV4Auth(self._base, "sts", "us-east-1").add_auth(request)
        headers = {k: v for k, v in request.headers.items() if k.lower() != "host"}
        answer = https_call(
            address, STS_HOST, 443, self._cafile, "POST", "/", request.body, headers, self._tunnel
        )
        if answer.status != 200:
            raise RuntimeError(f"STS answered {answer.status}")
        data = answer.data
        found = ET.fromstring(data).find(f"{_NS}AssumeRoleResult/{_NS}Credentials")  # noqa: S314
        if found is None:
            raise RuntimeError("no credentials in STS's answer")

        def text(tag: str) -> str:
            value = found.findtext(f"{_NS}{tag}")
            if not value:
                raise RuntimeError(f"no {tag} in STS's answer")
            return value

        key_id, secret, token = text("AccessKeyId"), text("SecretAccessKey"), text("SessionToken")
        expires = datetime.fromisoformat(text("Expiration")).timestamp()
        return Temporary(
            botocore().Credentials(key_id, secret, token),
            expires,
            (secret.encode(), token.encode(), key_id.encode()),
        )


class Sessions:
    """Every credential's role session, kept across policy reloads (keyed by what defines it)."""

    def __init__(self) -> None:
        self.dial: Dial = _no_network
        self.tunnel: Tunnel | None = None  # through the corporate proxy, when there is one
        self.cafile: str | None = None
        self._sessions: dict[str, tuple[tuple[Any, ...], RoleSession]] = {}

    def get(
        self, name: str, fingerprint: str, base: Credentials, options: dict[str, Any]
    ) -> RoleSession:
        key = (
            fingerprint,
            options.get("assume_role"),
            options.get("external_id"),
            options.get("session_policy"),
        )
        found = self._sessions.get(name)
        if found is not None and found[0] == key:
            return found[1]
        if found is not None:
            found[1].close()  # rotated or changed: its keys must not sign any more
            SETS.hold(name, ROLE, ())  # retired: redacted for the grace period
        session = RoleSession(name, base, options, self.dial, self.cafile, self.tunnel)
        self._sessions[name] = (key, session)
        return session


async def _no_network(host: str, port: int) -> tuple[str, int]:
    raise Unavailable("no proxy is running to reach STS", RoleSession.error)


SESSIONS = Sessions()
