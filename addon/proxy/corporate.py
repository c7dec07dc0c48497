"""The corporate proxy's credential (`run --upstream-proxy-credential NAME`): a stored
`basic` credential, sealed in the store like any other, read from the live policy for each
CONNECT (a rotation needs no restart).

It must be bound to the proxy's host and port alone (`credential add NAME --scheme basic
--host PROXY:PORT`): the credential's hosts bound every grant that names it, so no grant can
ever stamp it on a request to anywhere else.
"""

from __future__ import annotations

from addon.core.policy import Policy
from addon.mitm.via import ProxyFailed, UpstreamProxy, basic
from addon.proxy.live import LivePolicy
from store.errors import InvalidInput
from store.records import CredentialRecord


class ProxyCredential:
    def __init__(self, live: LivePolicy, proxy: UpstreamProxy) -> None:
        assert proxy.credential is not None
        self.live = live
        self.proxy = proxy
        self.name = proxy.credential

    def __call__(self) -> bytes:
        """The Proxy-Authorization value. Raises: ProxyFailed when there is none to send."""
        credential = self._usable(self.live.current())
        if credential is None:
            raise ProxyFailed("proxy-credential-unavailable")
        return basic(credential.secret.reveal())

    def check(self, policy: Policy) -> None:
        """At start: one line for a credential that is missing or not bound to the proxy."""
        if self._usable(policy) is None:
            where = f"{self.proxy.host}:{self.proxy.port}"
            raise InvalidInput(
                f"--upstream-proxy-credential {self.name}: no readable basic credential of "
                f"that name bound to {where} alone (credproxy credential add {self.name} "
                f"--scheme basic --host {where}, the secret user:password on stdin)"
            )

    def _usable(self, policy: Policy | None) -> CredentialRecord | None:
        found = policy.credentials.get(self.name) if policy is not None else None
        if found is None or found.scheme != "basic" or not found.hosts:
            return None
        proxy = self.proxy
        if any(h.wildcard or (h.host, h.port) != (proxy.host, proxy.port) for h in found.hosts):
            return None
        return found
