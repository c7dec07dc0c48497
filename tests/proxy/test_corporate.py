"""The corporate proxy's credential: a stored basic credential bound to the proxy alone."""

from __future__ import annotations

import base64
from types import SimpleNamespace
from typing import Any

import pytest

from addon.mitm.via import ProxyFailed, UpstreamProxy
from addon.proxy.corporate import ProxyCredential
from store.crypto import Secret
from store.errors import InvalidInput
from store.records import CredentialRecord
from store.rules.grammar import HostPattern

PROXY = UpstreamProxy("proxy.corp", 3128, credential="corp")


def _credential(scheme: str = "basic", *hosts: HostPattern) -> CredentialRecord:
    return CredentialRecord(
        name="corp",
        scheme=scheme,
        header_name=None,
        param_name=None,
        hosts=hosts or (HostPattern("proxy.corp", 3128),),
        secret=Secret(b"user:hunter2"),
        fingerprint="fp",
    )


class _Live:
    def __init__(self, *credentials: CredentialRecord) -> None:
        self.policy: Any = SimpleNamespace(credentials={c.name: c for c in credentials})

    def current(self) -> Any:
        return self.policy


def test_the_header_is_the_stored_secret_in_basic() -> None:
    header = ProxyCredential(_Live(_credential()), PROXY)()  # type: ignore[arg-type]
    assert header == b"Basic " + base64.b64encode(b"user:hunter2")


@pytest.mark.parametrize(
    "credential",
    [
        pytest.param(None, id="no such credential"),
        pytest.param(_credential("bearer"), id="not a basic credential"),
        pytest.param(
            _credential("basic", HostPattern("proxy.corp", 3128), HostPattern("api.example.com")),
            id="bound to another host as well: a grant could stamp it there",
        ),
        pytest.param(_credential("basic", HostPattern("proxy.corp")), id="bound to port 443"),
        pytest.param(_credential("basic", HostPattern("*.corp", 3128)), id="a wildcard host"),
    ],
)
def test_a_credential_not_bound_to_the_proxy_alone_is_never_sent(
    credential: CredentialRecord | None,
) -> None:
    live = _Live(*([credential] if credential is not None else []))
    found = ProxyCredential(live, PROXY)  # type: ignore[arg-type]
    with pytest.raises(ProxyFailed, match="proxy-credential-unavailable"):
        found()
    with pytest.raises(InvalidInput) as raised:
        found.check(live.policy)
    assert "hunter2" not in str(raised.value)


def test_a_stale_policy_sends_nothing() -> None:
    live = _Live(_credential())
    live.policy = None
    with pytest.raises(ProxyFailed, match="proxy-credential-unavailable"):
        ProxyCredential(live, PROXY)()  # type: ignore[arg-type]
