"""addon/runtime/wiring.py: the chain's order, and every injection made in one place."""

from __future__ import annotations

import pytest

from addon.core.guard import DestinationGuard
from addon.core.hosts import ResolveMap
from addon.proxy.access import AccessRequests
from addon.proxy.approval import Holds
from addon.proxy.forward import Forward
from addon.proxy.gate import Gate
from addon.proxy.limits import Limits
from addon.proxy.notify import Notifier, Webhook
from addon.runtime.wiring import build_chain
from addon.schemes.assume import SESSIONS
from addon.schemes.mint import TOKENS
from tests.fakes import StaticLive, make_policy

ORDER = [
    "Lifecycle",
    "CertExpiry",
    "Auth",
    "Pinning",
    "Reuse",
    "ClientCerts",
    "Gate",
    "BodyGate",
    "Forward",
    "AccessEndpoint",
    "Signing",
    "Responses",
    "Budgets",
    "Trail",
    "Holds",
    "Limits",
]


@pytest.fixture(autouse=True)
def _schemes_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    """The schemes' registries are process-wide: each test leaves them as it found them."""
    registries = ((SESSIONS, ("dial", "cafile")), (TOKENS, ("dial", "cafile", "vault", "count")))
    for registry, names in registries:
        for name in names:
            monkeypatch.setattr(registry, name, getattr(registry, name))


def _live() -> StaticLive:
    live = StaticLive(make_policy())
    live.store = object()  # type: ignore[attr-defined]
    return live


def test_the_addons_run_in_the_chain_order() -> None:
    chain = build_chain(_live(), ResolveMap({}), DestinationGuard())
    assert [type(part).__name__ for part in chain.parts] == ORDER


def test_the_notifier_comes_last_and_is_what_holds_and_access_requests_call() -> None:
    webhook = Webhook.parse("https://hooks.test/credproxy")
    chain = build_chain(_live(), ResolveMap({}), DestinationGuard(), notify=webhook)
    assert [type(part).__name__ for part in chain.parts] == [*ORDER, "Notifier"]
    notifier, holds = chain.part(Notifier), chain.part(Holds)
    access: AccessRequests = chain.part(Gate).access
    assert holds.notify == notifier.post and access.notify == notifier.post


def test_the_schemes_go_out_as_requests_do_trusting_the_upstream_bundle() -> None:
    live = _live()
    chain = build_chain(live, ResolveMap({}), DestinationGuard(), cafile="/run/ca/bundle.pem")
    forward = chain.part(Forward)
    assert SESSIONS.dial == forward.dial and TOKENS.dial == forward.dial
    assert TOKENS.vault is live.store  # type: ignore[attr-defined]
    assert SESSIONS.cafile == TOKENS.cafile == "/run/ca/bundle.pem"
    assert chain.part(Holds).on_hold == chain.part(Limits).hold


def test_without_an_upstream_bundle_the_schemes_keep_theirs() -> None:
    SESSIONS.cafile = TOKENS.cafile = None
    build_chain(_live(), ResolveMap({}), DestinationGuard())
    assert SESSIONS.cafile is None and TOKENS.cafile is None
