"""The chain of `credproxy run`: its addons in the order they run, and what each is given.

Every dependency is passed here, in one place: to an addon's constructor where it can be, or
set on the object right after it is built where two addons need each other (holds and the
deadlines, holds and the notifier), or where the object is a process-wide registry of the
credential schemes (SESSIONS and TOKENS, which mint tokens and renew keys for any chain).
"""

from __future__ import annotations

import time
from functools import partial

from addon.core.guard import DestinationGuard
from addon.core.hosts import ResolveMap
from addon.core.prices import Prices
from addon.mitm.clientcerts import ClientCerts
from addon.mitm.reuse import Reuse
from addon.mitm.via import Route, UpstreamProxy
from addon.observe import audit
from addon.observe.metrics import Metrics, StreakAlerts
from addon.proxy.access import AccessEndpoint, AccessRequests
from addon.proxy.approval import Holds, HoldSettings
from addon.proxy.auth import Auth
from addon.proxy.bodygate import BodyGate
from addon.proxy.budgets import Budgets
from addon.proxy.certexpiry import CertExpiry
from addon.proxy.chain import Chain, Lifecycle
from addon.proxy.corporate import ProxyCredential
from addon.proxy.dns import DEFAULT_TTL
from addon.proxy.forward import Forward
from addon.proxy.gate import Gate
from addon.proxy.limits import Limits, LimitSettings
from addon.proxy.live import LivePolicy
from addon.proxy.notify import Notifier, Webhook
from addon.proxy.pinning import Pinning
from addon.proxy.ratelimit import Limiter, SharedLimiter
from addon.proxy.responses import Responses
from addon.proxy.signing import Signing
from addon.proxy.sources import STATES
from addon.proxy.state import Clients
from addon.proxy.trail import Trail
from addon.schemes.assume import SESSIONS
from addon.schemes.mint import TOKENS


def build_chain(
    live: LivePolicy,
    resolve: ResolveMap,
    guard: DestinationGuard,
    alert_streak: int = 20,
    limits: LimitSettings | None = None,
    dns_ttl: float = DEFAULT_TTL,
    max_signed_body: int | None = None,
    notify: Webhook | None = None,
    cafile: str | None = None,
    shared_rates: bool = False,
    upstream_idle: float = 4.0,
    upstream_proxy: UpstreamProxy | None = None,
    prices: Prices | None = None,
) -> Chain:
    """credproxy's addons, in the order they run for each hook.

    `cafile` is the upstream trust bundle (the `ssl_verify_upstream_trusted_ca` option), for
    the calls credproxy makes itself: webhooks, AssumeRole, token endpoints.
    """
    log = audit.logger()
    metrics = Metrics(
        snapshot_age=lambda: time.monotonic() - getattr(live, "last_ok", 0.0),
        store_up=lambda: bool(getattr(live, "store_up", False)),
    )
    live.on_reload = metrics.reloads.inc
    held = getattr(live, "sources", None)
    if held is not None:
        for state in STATES:
            metrics.secret_sources.labels(state).set_function(partial(held.count, state))
    trail = Trail(metrics, StreakAlerts(alert_streak, log))
    clients = Clients()
    access = AccessRequests(live, log)
    limiter = SharedLimiter(live) if shared_rates else Limiter()
    signing = Signing(trail) if max_signed_body is None else Signing(trail, max_signed_body)
    limits = limits or LimitSettings()
    holds = Holds(live, metrics, HoldSettings(limits.max_holds, limits.max_held))
    budgets = Budgets(live, prices, access)
    forward = Forward(
        live,
        resolve,
        guard,
        clients,
        trail,
        metrics,
        dns_ttl,
        limiter=limiter,
        signing=signing,
        holds=holds,
        budgets=budgets,
    )
    deadlines = Limits(limits, clients, trail)
    holds.on_hold = deadlines.hold
    route = None
    if upstream_proxy is not None:
        credential = None
        if upstream_proxy.credential is not None:
            credential = ProxyCredential(live, upstream_proxy)
        route = Route(upstream_proxy, credential)
    notifier = None
    if notify is not None:
        notifier = Notifier(notify, forward.dial, metrics, cafile, route=route)
        holds.notify = access.notify = notifier.post
    _schemes(forward, live, metrics, cafile)
    if route is not None:
        # Token endpoints and STS go through the corporate proxy as the requests do.
        TOKENS.tunnel = SESSIONS.tunnel = partial(route.tunnel, timeout=limits.connect_timeout)
    return Chain(
        [
            Lifecycle(live),  # configure, running, done: the options and the policy poller
            CertExpiry(live, metrics),  # running, done: mtls certificates near their expiry
            Auth(live, clients, trail),  # http_connect, requestheaders: who, and the tunnel
            Pinning(clients),  # tls_clienthello, tls_start_client, server_connect
            # running, configure, responseheaders, done: parked upstream connections
            # every upstream connection, when there is a corporate proxy (addon/mitm/via.py)
            Reuse(clients, upstream_idle, limits.connect_timeout, route),
            # tls_start_server (after mitmproxy's tlsconfig): an mtls grant's certificate
            ClientCerts(),
            Gate(access, trail, limiter),  # requestheaders: the principal's rate, the verdict
            # requestheaders: hold a body that decides the grant; request: decide, then forward
            BodyGate(forward, trail),
            # requestheaders: the scheme's checks, the grant's rate, vet the address, use a
            # once- or counted grant, stamp
            forward,
            AccessEndpoint(access, trail),  # request: credproxy.internal
            signing,  # request: sign a held body (sigv4) once it is whole
            Responses(),  # responseheaders, response, websocket_message: redaction
            budgets,  # responseheaders, response, error: read the usage, charge the budget
            trail,  # response, error: the audit line
            holds,  # done: the poller of held requests' decisions
            # caps and deadlines, last: it sees what the others did
            deadlines,
            *([notifier] if notifier is not None else []),  # running, done: the sender
        ],
    )


def _schemes(forward: Forward, live: LivePolicy, metrics: Metrics, cafile: str | None) -> None:
    """What the process-wide registries of minted tokens and role keys go out with.

    They are module globals of addon/schemes/ (one per process, as the master is), so they
    are set here rather than passed.
    """
    SESSIONS.dial = forward.dial  # AssumeRole calls go out as the requests do
    TOKENS.dial = forward.dial  # and so do token endpoint calls
    TOKENS.vault = getattr(live, "store", None)
    TOKENS.count = lambda credential, outcome: metrics.token_mints.labels(credential, outcome).inc()
    if cafile is not None:
        SESSIONS.cafile = TOKENS.cafile = cafile
