"""Shared test fakes: a policy and its live stand-in, flows, and the addon chain.

`Chain` builds the runner's chain (addon/runtime/wiring.py `build_chain`), so that a test calls a
hook on every addon that has it, in the order mitmproxy would.
"""

from __future__ import annotations

import base64
import inspect
import json
from dataclasses import replace
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

from mitmproxy import hooks, http
from mitmproxy.test import tflow

from addon.core.guard import DestinationGuard
from addon.core.hosts import ResolveMap
from addon.core.policy import Policy
from addon.core.reasons import STATUS, Reason
from addon.core.verdict import Tunnel
from addon.observe.metrics import Metrics
from addon.proxy.access import AccessRequests
from addon.proxy.limits import LimitSettings
from addon.proxy.state import Clients
from addon.proxy.trail import Trail
from addon.runtime.wiring import build_chain
from store.crypto import Secret, hash_token
from store.errors import StoreUnavailable
from store.records import CredentialRecord, GrantRecord, Snapshot
from store.rules.grammar import parse_host

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
CRED = CredentialRecord(
    name="gh",
    scheme="bearer",
    header_name=None,
    param_name=None,
    hosts=(parse_host("api.test"), parse_host("*.wild.test")),
    secret=Secret(b"s"),
    fingerprint="fp-x",
)


def grant(
    gid: int,
    hosts: tuple[str, ...] = ("api.test",),
    methods: tuple[str, ...] = ("GET",),
    paths: tuple[str, ...] = ("/v1/",),
    *,
    cred: bool = True,
    once: bool = False,
    websocket: bool = False,
    expires: datetime | None = None,
    principal: str = "a",
    encoded_slash: bool = False,
) -> GrantRecord:
    return GrantRecord(
        id=gid,
        principal=principal,
        credential="gh" if cred else None,
        hosts=tuple(parse_host(h) for h in hosts),
        methods=frozenset(methods),
        paths=tuple(paths),
        once=once,
        websocket=websocket,
        expires_at=expires,
        encoded_slash=encoded_slash,
    )


def policy(*grants: GrantRecord) -> Policy:
    return Policy(
        Snapshot(
            counter=1,
            key_id="k",
            token_hashes={"a": hash_token("tok-a"), "b": hash_token("tok-b")},
            credentials={"gh": CRED},
            grants=grants,
            unreadable=(),
        )
    )


def make_policy() -> Policy:
    return Policy(
        Snapshot(
            counter=1,
            key_id="k",
            token_hashes={"a": hash_token("tok-a")},
            credentials={"gh": CRED},
            grants=(grant(1),),
            unreadable=(),
        )
    )


class StaticLive:
    """Serves one Policy; `fail` makes current() raise, to inject a fault."""

    def __init__(self, policy: Policy | None, fail: bool = False) -> None:
        self.policy = policy
        self.fail = fail
        self.store_up = True

    def current(self) -> Policy | None:
        if self.fail:
            raise RuntimeError("injected fault")
        return self.policy

    async def consume_once(self, grant_id: int) -> bool:
        return True

    store = SimpleNamespace(
        record_access_request=None, get_access_request=None, record_budget_request=None
    )

    async def call(self, *args: Any) -> Any:
        raise StoreUnavailable("no store behind the unit tests")


class Chain:
    """The runner's chain around one live policy; `chain.requestheaders(flow)` runs it.

    The addons are reachable by name: `clients`, `trail`, `metrics`, `access`, and each
    addon by its class name in lower case (`chain.forward`, `chain.responses`, ...). The
    request-side hooks (which may wait) are always awaitable here, as mitmproxy awaits them.
    """

    REQUEST_SIDE = frozenset({"http_connect", "requestheaders", "request"})

    def __init__(
        self,
        live: Any,
        resolve: ResolveMap | None = None,
        guard: DestinationGuard | None = None,
        limits: LimitSettings | None = None,
    ) -> None:
        resolve, guard = resolve or ResolveMap({}), guard or DestinationGuard()
        self.entry = build_chain(live, resolve, guard, 20, limits)
        for part in self.entry.parts:
            setattr(self, type(part).__name__.lower(), part)
        self.clients: Clients = self.auth.clients
        self.trail: Trail = self.entry.part(Trail)
        self.metrics: Metrics = self.trail.metrics
        self.access: AccessRequests = self.gate.access

    def __getattr__(self, hook: str) -> Any:
        if hook.startswith("_") or hook not in hooks.all_hooks:
            raise AttributeError(hook)
        call = getattr(self.entry, hook)
        if hook not in self.REQUEST_SIDE:
            return call

        async def awaited(*args: Any) -> None:
            result = call(*args)
            if result is not None and inspect.isawaitable(result):
                await result

        return awaited

    def tunnel(self, client: Any) -> Tunnel | None:
        return self.clients.tunnel(client)

    def bind(self, client: Any, tunnel: Tunnel) -> None:
        """What a CONNECT that passed leaves behind on its client connection."""
        self.clients.state(client).tunnel = tunnel


def https_flow(chain: Chain, path: bytes = b"/v1/x") -> Any:
    flow = tflow.tflow()
    flow.request.scheme = "https"
    flow.request.host = "api.test"
    flow.request.port = 443
    flow.request.data.path = path
    flow.request.host_header = "api.test"
    flow.client_conn.tls = True
    flow.client_conn.sni = "api.test"
    chain.bind(flow.client_conn, Tunnel("a", "api.test", 443))
    return flow


def reason(flow: http.HTTPFlow) -> str:
    assert flow.response is not None
    found: str = json.loads(flow.response.content)["reason"]
    return found


# Long enough to be redacted (forms shorter than 4 bytes are not); a test value, not a secret.
LONG_SECRET = b"sk-test-0123456789abcdef"

LONG_CRED = replace(CRED, secret=Secret(LONG_SECRET))

RESOLVE = ["api.test=127.0.0.1:9443", "plain.test=127.0.0.1:9080", "x.wild.test=127.0.0.1:9443"]


def snapshot_policy(*grants: Any, tokens: dict[str, str] | None = None, cred: Any = CRED) -> Policy:
    return Policy(
        Snapshot(
            counter=1,
            key_id="k",
            token_hashes={n: hash_token(t) for n, t in (tokens or {"a": "tok-a"}).items()},
            credentials={"gh": cred},
            grants=tuple(grants),
            unreadable=(),
        )
    )


class SpyLive(StaticLive):
    """StaticLive that records which once-grants were consumed."""

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        self.consumed: list[int] = []

    async def consume_once(self, grant_id: int) -> bool:
        self.consumed.append(grant_id)
        return True


def assert_refused_unstamped(flow: Any, code: str) -> None:
    """Denied with `code` and its status, and no credential was written onto the request."""
    assert reason(flow) == code
    assert flow.response.status_code == STATUS.get(Reason(code), 403)
    assert flow.request.headers.get("authorization") is None


def make_addon(live: Any, resolve: list[str] | None = None) -> Chain:
    return Chain(live, ResolveMap.parse(RESOLVE if resolve is None else resolve))


def basic(user: str, token: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{token}".encode()).decode()


def plain_flow(host: str = "plain.test", port: int = 80, auth: str | None = None) -> Any:
    """An absolute-form plain-http request to the proxy (no tunnel)."""
    flow = tflow.tflow()
    flow.request.scheme = "http"
    flow.request.host, flow.request.port = host, port
    flow.request.data.path = b"/v1/x"
    flow.request.host_header = host if port == 80 else f"{host}:{port}"
    flow.request.headers["proxy-authorization"] = auth or basic("a", "tok-a")
    flow.client_conn.tls = False
    return flow


# The policy file of docs/policy-files.md: one principal, a credential read from GITHUB_TOKEN,
# one grant. A test adds `token_dir` or an expiry around it; the line numbers that its
# messages name follow this layout.
POLICY = """\
[[principal]]
name = "agent"

[[credential]]
name = "github"
scheme = "bearer"
hosts = ["api.github.com"]
secret_env = "GITHUB_TOKEN"

[[grant]]
id = "triage-widgets"
principal = "agent"
credential = "github"
methods = ["GET"]
paths = ["/repos/acme/widgets/issues"]
purpose = "triage widgets issues"
"""
